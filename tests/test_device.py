"""The emulated CUDA device (kvoffload.vllm_target.device) against the semantics CUDA documents
for each call vLLM's offload worker makes: streams, events, the current stream,
cuMemcpyBatchAsync with its source access orders, host registration, and the worker thread
the host runs when told. Calls go through the same doors vLLM's code uses (torch.cuda.Stream,
torch.Event, torch.cuda.cudart(), the driver's cuGetProcAddress, a ctypes function pointer)."""

from __future__ import annotations

import ctypes
import importlib
import queue
import threading
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvoffload.vllm_target.device import (
    BATCH_MEMCPY,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_SUCCESS,
    SRC_ACCESS_ORDER_ANY,
    SRC_ACCESS_ORDER_STREAM,
    Device,
    EmulatedQueue,
    EmulatedThread,
    Host,
    Work,
    installed,
)

# torch's doors, typed as what the emulation puts there
CUDA: Any = torch.cuda
TORCH: Any = torch


@pytest.fixture
def host() -> Iterator[Host]:
    with installed(Host()) as emulated:
        emulated.device(0).make_current()
        yield emulated


def _write(log: list[str], what: str) -> Work:
    return Work(what, lambda: log.append(what))


def test_a_stream_runs_its_work_in_order_and_only_when_the_device_progresses(host: Host) -> None:
    log: list[str] = []
    stream = CUDA.Stream(priority=CUDA.Stream.priority_range()[0])
    for what in ("a", "b", "c"):
        stream.enqueue(_write(log, what))
    assert log == [] and not stream.query()
    host.device(0).run_until(stream, 2)
    assert log == ["a", "b"] and not stream.query()
    stream.synchronize()
    assert log == ["a", "b", "c"] and stream.query()


def test_an_event_never_recorded_is_complete_and_a_recorded_one_when_its_work_ran(
    host: Host,
) -> None:
    log: list[str] = []
    event = TORCH.Event()
    assert event.query()  # cudaEventQuery of an event never recorded: cudaSuccess
    stream = CUDA.Stream()
    stream.enqueue(_write(log, "copy"))
    event.record(stream)
    stream.enqueue(_write(log, "later"))
    assert not event.query()
    event.synchronize()  # the host blocks until the captured work ran, no further
    assert event.query() and log == ["copy"]


def test_record_captures_the_work_queued_so_far_and_records_anew(host: Host) -> None:
    log: list[str] = []
    compute = CUDA.current_stream()
    compute.enqueue(_write(log, "first"))
    event = TORCH.Event()
    event.record()  # the current stream
    compute.enqueue(_write(log, "second"))
    event.synchronize()
    assert log == ["first"]
    event.record(compute)  # now after "second"
    assert not event.query()
    event.synchronize()
    assert log == ["first", "second"]


def test_a_wait_orders_later_work_after_what_the_event_captured(host: Host) -> None:
    """Work on two streams is unordered unless an event orders it; the wait is for what the
    event captured when recorded, whatever it records later."""
    log: list[str] = []
    compute, copy = CUDA.current_stream(), CUDA.Stream()
    compute.enqueue(_write(log, "forward writes"))
    done = TORCH.Event()
    done.record(compute)
    copy.wait_event(done)
    copy.enqueue(_write(log, "store reads"))
    compute.enqueue(_write(log, "next forward"))
    done.record(compute)  # a later record: the queued wait is unchanged
    device = host.device(0)
    assert not device.runnable(copy)
    copy.synchronize()  # runs what the wait needs, not the next forward
    assert log == ["forward writes", "store reads"]
    # without the wait, the copy runs before the compute it should follow
    unordered, other = CUDA.Stream(), CUDA.current_stream()
    other.enqueue(_write(log, "write"))
    unordered.enqueue(_write(log, "read"))
    unordered.synchronize()
    assert log[-1] == "read" and "write" not in log


def _buffers(host: Host, device_bytes: bytes, host_bytes: bytes) -> tuple[torch.Tensor, ...]:
    gpu = torch.tensor(list(device_bytes), dtype=torch.uint8)
    cpu = torch.tensor(list(host_bytes), dtype=torch.uint8)
    host.device(0).allocate(gpu.data_ptr(), gpu.numel())
    assert CUDA.cudart().cudaHostRegister(cpu.data_ptr(), cpu.numel(), 0).value == 0
    return gpu, cpu


def _batch(
    dsts: list[int], srcs: list[int], sizes: list[int], order: int, stream: object
) -> tuple[int, int]:
    """cuMemcpyBatchAsync called as vLLM's cuda_mem_ops calls it: a function pointer from
    cuGetProcAddress, arrays of addresses, one attribute from index 0."""
    driver: Any = importlib.import_module("cuda.bindings.driver")
    err, address, _ = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
    assert err == driver.CUresult.CUDA_SUCCESS
    fn = BATCH_MEMCPY(address)
    n = len(dsts)
    arrays = [(ctypes.c_uint64 * n)(*values) for values in (dsts, srcs)]
    size_array = (ctypes.c_size_t * n)(*sizes)

    class Attributes(ctypes.Structure):
        _fields_ = [
            ("srcAccessOrder", ctypes.c_uint),
            ("srcLocHint", ctypes.c_uint * 2),
            ("dstLocHint", ctypes.c_uint * 2),
            ("flags", ctypes.c_uint),
        ]

    attrs, idx, fail = Attributes(srcAccessOrder=order), ctypes.c_size_t(0), ctypes.c_size_t(0)
    code = fn(
        ctypes.addressof(arrays[0]),
        ctypes.addressof(arrays[1]),
        ctypes.addressof(size_array),
        n,
        ctypes.addressof(attrs),
        ctypes.byref(idx),
        1,
        ctypes.byref(fail),
        stream.cuda_stream,  # type: ignore[attr-defined]
    )
    return code, fail.value


def test_a_batch_copy_writes_when_it_runs_reading_its_source_as_its_order_says(
    host: Host,
) -> None:
    gpu, cpu = _buffers(host, bytes(range(16)), bytes(16))
    store = CUDA.Stream()
    # STREAM: the source is read when the copy runs, after the write before it
    code, _ = _batch([cpu.data_ptr()], [gpu.data_ptr()], [8], SRC_ACCESS_ORDER_STREAM, store)
    assert code == CUDA_SUCCESS and cpu[:8].tolist() == [0] * 8  # not yet run
    gpu[:8] = 99
    store.synchronize()
    assert cpu[:8].tolist() == [99] * 8
    # ANY: the source may be read from the call on: the emulation reads it at the call
    load = CUDA.Stream()
    cpu[8:] = 7
    code, _ = _batch([gpu.data_ptr() + 8], [cpu.data_ptr() + 8], [8], SRC_ACCESS_ORDER_ANY, load)
    cpu[8:] = 5  # written after the call: the copy may or may not see it
    load.synchronize()
    assert code == CUDA_SUCCESS and gpu[8:].tolist() == [7] * 8


def test_a_descriptor_outside_known_memory_fails_the_batch_naming_it(host: Host) -> None:
    gpu, cpu = _buffers(host, bytes(16), bytes(16))
    stream = CUDA.Stream()
    past_end = cpu.data_ptr() + 12  # 8 bytes from there run past the registration
    code, fail = _batch(
        [cpu.data_ptr(), past_end],
        [gpu.data_ptr(), gpu.data_ptr()],
        [8, 8],
        SRC_ACCESS_ORDER_STREAM,
        stream,
    )
    assert code == CUDA_ERROR_INVALID_VALUE and fail == 1
    assert stream.query()  # nothing queued


def test_a_descriptor_across_two_registrations_is_refused(host: Host) -> None:
    """CUDA batch copies reject a descriptor spanning adjacent registrations (vLLM's
    host_registration_ranges keeps them apart for that)."""
    gpu = torch.zeros(16, dtype=torch.uint8)
    cpu = torch.zeros(16, dtype=torch.uint8)
    host.device(0).allocate(gpu.data_ptr(), 16)
    cudart = CUDA.cudart()
    assert cudart.cudaHostRegister(cpu.data_ptr(), 8, 0).value == CUDA_SUCCESS
    assert cudart.cudaHostRegister(cpu.data_ptr() + 8, 8, 0).value == CUDA_SUCCESS
    stream = CUDA.Stream()
    code, _ = _batch([cpu.data_ptr() + 4], [gpu.data_ptr()], [8], SRC_ACCESS_ORDER_STREAM, stream)
    assert code == CUDA_ERROR_INVALID_VALUE


def test_host_registration_refuses_overlaps_and_unknown_addresses(host: Host) -> None:
    cpu = torch.zeros(64, dtype=torch.uint8)
    cudart = CUDA.cudart()
    assert cudart.cudaHostRegister(cpu.data_ptr(), 32, 0).value == CUDA_SUCCESS
    again = cudart.cudaHostRegister(cpu.data_ptr() + 16, 32, 0)
    assert again.value == CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
    assert cudart.cudaHostUnregister(cpu.data_ptr() + 8).value == (
        CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
    )
    assert cudart.cudaHostUnregister(cpu.data_ptr()).value == CUDA_SUCCESS
    assert host.registered == {}


def test_a_worker_thread_runs_its_queue_when_the_host_says_and_stops_on_none(host: Host) -> None:
    seen: list[int] = []

    def loop(q: EmulatedQueue, tag: str) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            seen.append(item)

    q = EmulatedQueue()
    thread = EmulatedThread(target=loop, args=(q, "t"), daemon=True)
    thread.start()
    q.put(1)
    q.put(2)
    assert seen == []  # queued, not yet run
    host.run_threads()
    assert seen == [1, 2] and thread.is_alive()
    q.put(3)
    q.put(None)  # shutdown
    thread.join()
    assert seen == [1, 2, 3] and not thread.is_alive()


def test_streams_of_two_devices_are_their_own(host: Host) -> None:
    first, second = host.device(0), host.device(1)
    a = CUDA.Stream()
    second.make_current()
    b = CUDA.Stream()
    assert a.device is first and b.device is second
    assert CUDA.current_stream() is second.current_stream
    assert Device.current() is second


def test_installing_replaces_the_doors_and_restores_them() -> None:
    import sys

    threads: Any = threading
    queues: Any = queue
    before = (CUDA.Stream, TORCH.Event, CUDA.current_stream)
    with installed(Host(), [(threading, "Thread", EmulatedThread), (queue, "SimpleQueue", list)]):
        assert CUDA.Stream is not before[0] and isinstance(
            sys.modules["cuda.bindings.driver"], types.ModuleType
        )
        assert threads.Thread is EmulatedThread
    assert (CUDA.Stream, TORCH.Event, CUDA.current_stream) == before
    assert threads.Thread is not EmulatedThread and queues.SimpleQueue is not list
    assert not getattr(sys.modules.get("cuda.bindings.driver"), "emulated", False)
