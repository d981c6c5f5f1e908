"""The worker's copy path, the content function, checksums and the stream emulation."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvoffload.impl import KVLayout, OffloadImpl
from kvoffload.impl.content import checksum, token_bytes, token_seeds
from kvoffload.impl.copy import copy_blocks, host_runs
from kvoffload.impl.streams import ComputeStream, CopyThread
from kvoffload.model import DataIntegrityError, InvalidArgumentError, OffloadConfig
from kvoffload.testing.lockstep import apply
from kvoffload.testing.stateful import machine_for

from helpers import config as cfg
from scenarios import STORE_THEN_EVICT


def test_host_runs_group_pairs_by_consecutive_host_ids() -> None:
    assert host_runs([1, 2, 3, 7, 9], [5, 9, 6, 0, 1]) == [(1, [5, 9, 6]), (7, [0]), (9, [1])]
    assert host_runs([], []) == []


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [([1, 2, 3, 6], [4, 5, 6, 0]), ([7, 1, 5, 2], [0, 1, 2, 3]), ([3], [3]), ([], [])],
)
def test_copy_blocks_moves_exactly_the_paired_blocks(
    src_ids: list[int], dst_ids: list[int]
) -> None:
    src = torch.arange(8 * 4, dtype=torch.uint8).reshape(8, 4) + 1
    dst = torch.zeros(8, 4, dtype=torch.uint8)
    copy_blocks(src, dst, src_ids, dst_ids)
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[d], src[s])
    untouched = [i for i in range(8) if i not in dst_ids]
    assert not dst[untouched].any()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("to_device", [True, False])
def test_copy_blocks_across_devices(to_device: bool) -> None:
    host = torch.arange(8 * 4, dtype=torch.uint8).reshape(8, 4).pin_memory()
    dev = torch.zeros(8, 4, dtype=torch.uint8, device="cuda")
    src, dst = (host, dev) if to_device else (dev.copy_(host.flip(0)), host.clone())
    src_ids, dst_ids = [7, 1, 5, 2, 3], [0, 1, 2, 6, 4]
    copy_blocks(src, dst, src_ids, dst_ids)
    torch.cuda.synchronize()
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(dst[d].cpu(), src[s].cpu())


def test_content_is_a_function_of_the_prefix_group_and_layer() -> None:
    seeds = token_seeds([1, 2, 3, 4])
    assert token_seeds([1, 2, 3, 4, 5])[:4] == seeds
    assert token_seeds([9, 2, 3, 4])[3] != seeds[3]
    continued = token_seeds([3, 4], 2, token_seeds([1, 2])[-1])
    assert continued == seeds[2:]
    a = token_bytes(seeds, 0, 0, 8)
    assert a.dtype == torch.uint8 and a.numel() == 32
    assert torch.equal(a, token_bytes(seeds, 0, 0, 8))
    assert not torch.equal(a, token_bytes(seeds, 1, 0, 8))
    assert not torch.equal(a, token_bytes(seeds, 0, 1, 8))
    assert checksum(a) != checksum(a.flip(0))


def test_a_corrupted_host_block_is_never_loaded() -> None:
    """The lookup verifies the hit's checksums: the damaged block is evicted, the hit ends
    before it, and what is loaded is intact."""
    impl = OffloadImpl(cfg(5), device="cpu")
    for call in STORE_THEN_EVICT[:-1]:
        apply(impl, call)
    first, second = impl.connector.cpu.keyed()[:2]
    impl.workers[0].cpu_kv[0][1][second, 5] ^= 0xFF
    result = impl.step(64)
    assert result.metadata.load_cpu_blocks == (first,)
    assert impl.connector.cpu.key[second] is None
    impl.complete_load(result.metadata.load_event)
    assert impl.data_mismatches() == []
    impl.close()


def test_a_load_of_a_block_that_fails_its_checksum_is_refused() -> None:
    """The last line of defence, under the lookup's check: a worker never copies a host
    block whose bytes changed since it was sealed."""
    impl = OffloadImpl(cfg(5), device="cpu")
    for call in STORE_THEN_EVICT[:-1]:
        apply(impl, call)
    block = impl.connector.cpu.keyed()[0]
    worker = impl.workers[0]
    worker.cpu_kv[0][1][block, 5] ^= 0xFF
    with pytest.raises(DataIntegrityError, match=f"cpu block {block} does not match"):
        worker.submit_load(99, [1], [block])
    impl.close()


def test_without_checksums_the_corruption_reaches_the_device() -> None:
    impl = OffloadImpl(cfg(5), layout=KVLayout(checksums=False), device="cpu")
    for call in STORE_THEN_EVICT[:-1]:
        apply(impl, call)
    block = impl.connector.cpu.keyed()[0]
    impl.workers[0].cpu_kv[0][1][block, 5] ^= 0xFF
    impl.step(64)
    impl.complete_load(0)
    assert any("layer 1 does not hold" in m for m in impl.data_mismatches())


def test_loads_run_before_earlier_stores_on_the_copy_thread() -> None:
    copier = CopyThread()
    gate = threading.Event()
    order: list[str] = []

    def hold() -> None:
        gate.wait(5)

    blocker = copier.submit(CopyThread.STORE, hold)
    store = copier.submit(CopyThread.STORE, lambda: order.append("store"))
    load = copier.submit(CopyThread.LOAD, lambda: order.append("load"))
    gate.set()
    for job in (blocker, store, load):
        copier.wait(job)
    assert order == ["load", "store"]
    copier.stop()


def test_a_failed_copy_is_raised_to_whoever_waits_for_it() -> None:
    copier = CopyThread()

    def fail() -> None:
        raise RuntimeError("copy failed")

    job = copier.submit(CopyThread.LOAD, fail)
    copier.drain()
    assert isinstance(job.error, RuntimeError)


def test_compute_runs_lazily_until_waited_on_or_old() -> None:
    stream = ComputeStream(lag=1)
    done: list[int] = []
    stream.enqueue(7, lambda: done.append(1))
    assert done == [] and stream.pending_targets() == {7}
    stream.next_step()  # one step later: still within the lag
    assert done == []
    marker = stream.record()
    stream.enqueue(8, lambda: done.append(2))
    stream.run_until(marker)
    assert done == [1] and stream.pending_targets() == {8}
    stream.next_step()
    stream.next_step()
    assert done == [1, 2] and stream.pending_targets() == set()


def test_ready_polls_copies_without_waiting() -> None:
    impl = OffloadImpl(OffloadConfig(gpu_blocks=16, cpu_blocks=8, world_size=2), device="cpu")
    impl.add_request("r", list(range(40)), max_tokens=1)
    impl.step(64)
    event = impl.step(0).metadata.store_event
    for worker in impl.workers:
        worker.stores[event].wait()
    assert impl.ready("store") == [(event, 0), (event, 1)]
    impl.complete_store(event, 1)
    assert impl.ready("store") == [(event, 0)]


def test_a_caller_can_wait_for_one_given_store() -> None:
    impl = OffloadImpl(OffloadConfig(gpu_blocks=16, cpu_blocks=8), device="cpu")
    impl.add_request("r", list(range(40)), max_tokens=1)
    impl.step(64)
    event = impl.step(0).metadata.store_event
    transfer = impl.workers[0].stores[event]
    transfer.wait()
    assert transfer.done()
    assert impl.complete_store(event) is True
    assert impl.data_mismatches() == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_host_blocks_are_pinned_and_device_blocks_on_the_gpu() -> None:
    impl = OffloadImpl(OffloadConfig(gpu_blocks=16, cpu_blocks=8), device="cuda")
    worker = impl.workers[0]
    assert worker.gpu_kv[0][0].is_cuda
    assert worker.cpu_kv[0][0].is_pinned()


def _copy_threads() -> int:
    """Copy threads alive once every implementation dropped so far has been collected (its
    finalizer stops its threads as it is collected). A worker whose finalizer runs in one
    collection can keep a sibling in the same cycle to the next, hence two."""
    gc.collect()
    gc.collect()
    return sum(1 for t in threading.enumerate() if t.name == "kvoffload-copy")


def test_close_stops_every_copy_thread_and_is_idempotent() -> None:
    before = _copy_threads()
    impl = OffloadImpl(cfg(gpu_blocks=8, cpu_blocks=4, world_size=3))
    assert _copy_threads() == before + 3
    for call in STORE_THEN_EVICT:
        apply(impl, call)
    impl.close()
    impl.close()
    assert _copy_threads() == before
    with OffloadImpl(cfg(gpu_blocks=8, cpu_blocks=4)) as other:
        assert _copy_threads() == before + 1
        other.add_request("r", [1, 2, 3], 1)
    assert _copy_threads() == before


def test_an_implementation_dropped_without_close_stops_its_threads() -> None:
    before = _copy_threads()
    impl = OffloadImpl(cfg(gpu_blocks=8, cpu_blocks=4, world_size=2))
    for call in STORE_THEN_EVICT:
        apply(impl, call)
    del impl
    assert _copy_threads() == before


def test_programs_of_the_machine_leave_no_copy_thread_behind() -> None:
    before = _copy_threads()
    machine = machine_for("impl", loads=False)
    run_state_machine_as_test(machine, settings=settings(max_examples=100, database=None))
    assert _copy_threads() == before


def test_a_stopped_copy_engine_takes_no_more_jobs() -> None:
    thread = CopyThread()
    ran: list[int] = []
    thread.submit(CopyThread.STORE, lambda: ran.append(1))
    thread.stop()
    assert ran == [1]  # what was submitted ran before the thread ended
    with pytest.raises(RuntimeError, match="stopped"):
        thread.submit(CopyThread.STORE, lambda: ran.append(2))


def test_outstanding_names_a_bad_kind() -> None:
    impl = OffloadImpl(cfg(gpu_blocks=8, cpu_blocks=4))
    with pytest.raises(InvalidArgumentError, match="kind must be 'store' or 'load', got 'foo'"):
        impl.outstanding("foo")
    impl.close()
