"""The worker's copy path, the content function, checksums and the stream emulation."""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from kvoffload.impl import KVLayout, OffloadImpl
from kvoffload.impl.content import checksum, tensor_bytes, token_bytes, token_seeds
from kvoffload.impl.streams import ComputeStream, CopyThread, InlineCopies
from kvoffload.model import DataIntegrityError, InvalidArgumentError, OffloadConfig
from kvoffload.testing.lockstep import apply, first_disagreement
from kvoffload.testing.stateful import machine_for

from helpers import config as cfg
from scenarios import SCENARIOS, STORE_THEN_EVICT


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


def test_tensor_bytes_are_the_memory_of_the_tensor_in_row_major_order() -> None:
    # The data check compares blocks as slices of these bytes: each block's row must be
    # where its index says, whatever the dtype and however the tensor was made.
    blocks = torch.arange(5 * 2 * 6, dtype=torch.int64).to(torch.uint8).reshape(5, 2, 6)
    assert tensor_bytes(blocks) == bytes(blocks.reshape(-1).tolist())
    assert tensor_bytes(blocks)[2 * 12 : 3 * 12] == bytes(blocks[2].reshape(-1).tolist())
    assert tensor_bytes(blocks[1:3]) == bytes(blocks[1:3].reshape(-1).tolist())
    columns = blocks.transpose(0, 2)  # not contiguous: its own row-major order
    assert tensor_bytes(columns) == bytes(columns.reshape(-1).tolist())
    words = torch.tensor([1, 256], dtype=torch.int16)
    assert tensor_bytes(words) == (1).to_bytes(2, "little") + (256).to_bytes(2, "little")
    assert tensor_bytes(blocks[:0]) == b""


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


def test_a_batch_of_checksums_is_each_blocks_own_group_by_group_and_layer_by_layer() -> None:
    impl = OffloadImpl(cfg(32, 16, (16, 32)), device="cpu")  # two groups, two layers each
    for call in STORE_THEN_EVICT[:-1]:
        apply(impl, call)
    worker = impl.workers[0]
    blocks = [2, 0, 5, 2]  # any order, the null block and repeats included
    one_by_one = [
        [checksum(layers[layer][b]) for layers in worker.cpu_kv for layer in range(2)]
        for b in blocks
    ]
    assert worker.block_sums(blocks) == one_by_one
    assert worker.block_sums([]) == []
    assert len(set(map(tuple, one_by_one))) > 1  # the blocks' bytes differ: a real check
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
    with pytest.raises(RuntimeError, match="copy failed"):
        copier.wait(job)
    copier.stop()


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
    # Copy threads are the CPU emulation's copy engine: on CUDA the copies run on streams
    # (the first run of .ci/cuda-check counted none there), so the test asks for host memory.
    before = _copy_threads()
    impl = OffloadImpl(cfg(gpu_blocks=8, cpu_blocks=4, world_size=3), device="cpu")
    assert _copy_threads() == before + 3
    for call in STORE_THEN_EVICT:
        apply(impl, call)
    impl.close()
    impl.close()
    assert _copy_threads() == before
    with OffloadImpl(cfg(gpu_blocks=8, cpu_blocks=4), device="cpu") as other:
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


def test_inline_copies_run_loads_before_stores_when_drained() -> None:
    copier = InlineCopies()
    order: list[str] = []
    store = copier.submit(InlineCopies.STORE, lambda: order.append("store"))
    load = copier.submit(InlineCopies.LOAD, lambda: order.append("load"))
    later = copier.submit(InlineCopies.STORE, lambda: order.append("later store"))
    assert order == [] and not store.finished  # nothing runs at submission
    copier.drain()
    assert order == ["load", "store", "later store"]
    assert load.finished and store.finished and later.finished


def test_waiting_for_an_inline_copy_runs_what_comes_before_it_only() -> None:
    copier = InlineCopies()
    order: list[str] = []
    first = copier.submit(InlineCopies.STORE, lambda: order.append("first"))
    second = copier.submit(InlineCopies.STORE, lambda: order.append("second"))
    load = copier.submit(InlineCopies.LOAD, lambda: order.append("load"))
    copier.wait(first)
    assert order == ["load", "first"] and not second.finished
    copier.stop()  # runs what is queued
    assert order == ["load", "first", "second"]
    with pytest.raises(RuntimeError, match="stopped"):
        copier.submit(InlineCopies.LOAD, lambda: None)
    assert load.finished


def test_a_failed_inline_copy_is_raised_to_whoever_waits_for_it() -> None:
    copier = InlineCopies()

    def fail() -> None:
        raise RuntimeError("copy failed")

    job = copier.submit(InlineCopies.LOAD, fail)
    copier.drain()  # the failure is kept for the waiter, not raised here
    with pytest.raises(RuntimeError, match="copy failed"):
        copier.wait(job)


def test_in_lockstep_mode_no_thread_starts_and_every_copy_is_done_after_the_step() -> None:
    before = _copy_threads()
    impl = OffloadImpl(cfg(gpu_blocks=8, cpu_blocks=4, world_size=3), lockstep=True)
    assert _copy_threads() == before
    impl.add_request("r", list(range(33)), max_tokens=1)
    impl.step(64)  # computes the prompt and finishes: the final flush goes out next
    event = impl.step(0).metadata.store_event
    assert all(w.stores[event].done() for w in impl.workers)
    assert impl.ready("store") == [(event, 0), (event, 1), (event, 2)]
    impl.close()


@pytest.mark.parametrize("lockstep", [True, False])
def test_the_store_race_shows_in_both_copy_engines(lockstep: bool) -> None:
    """vLLM #45704: a store that does not wait for the step's compute copies stale bytes,
    every time, whether copies run on a thread or inline. Host memory: on a real device the
    race depends on timing (the H200 of .ci/cuda-check's first run copied the new bytes)."""
    config, program = SCENARIOS["final-flush-33"]
    found = first_disagreement(
        config, program, faults=["store-skips-compute-wait"], device="cpu", lockstep=lockstep
    )
    assert found is not None and "does not hold the KV" in found


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_host_blocks_are_mapped_and_scattered_ones_cross_as_kernels() -> None:
    impl = OffloadImpl(OffloadConfig(gpu_blocks=16, cpu_blocks=8), device="cuda")
    worker = impl.workers[0]
    assert worker.cpu_mapped is not None  # an H200 addresses page-locked host memory
    assert worker._cuda_plan([6, 1, 4], [0, 1, 2], to_device=True).mapped
    assert not worker._cuda_plan([2, 3, 4], [9, 1, 5], to_device=True).mapped
    for t in worker.gpu_blocks:
        t.copy_(torch.arange(t.numel(), device="cuda").remainder(251).reshape(t.shape))
    worker.submit_store(1, [3, 9, 5], [6, 1, 4])  # scattered host blocks: mapped
    worker.wait_store(1)
    for gpu, cpu in worker.tensors():
        assert torch.equal(cpu[[6, 1, 4]], gpu[[3, 9, 5]].cpu())
    worker.submit_load(2, [10, 11, 12], [4, 6, 1])
    worker.wait_load(2)
    for gpu, _ in worker.tensors():
        assert torch.equal(gpu[[10, 11, 12]], gpu[[5, 3, 9]])
