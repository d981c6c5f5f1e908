"""An emulated CUDA device on the CPU, beneath vLLM's unmodified worker code (issue 33).

vLLM's offload worker copies KV blocks with ``cuMemcpyBatchAsync`` on two copy streams, orders
its stores after the forward with an event, polls events for completion and pins its host
buffer with ``cudaHostRegister``. Without a GPU, :func:`install` (for the rest of a release
environment's process) or :func:`installed` (for a block) puts this emulation where those
calls go (``torch.cuda.Stream``, ``torch.cuda.current_stream``, ``torch.Event``,
``torch.cuda.cudart``, the driver's ``cuGetProcAddress``), leading them to the active
:class:`Host`, so that the worker's own code runs and an ordering bug is observable: device
memory is host memory, and work runs when the machine lets the device progress, not when it
is queued.

What is emulated, each with the semantics CUDA documents (``tests/test_device.py`` holds each):

- **Streams** run their work in the order it was queued, and only when the device is told to
  progress (:meth:`Device.run_until`, :meth:`Stream.synchronize`): a copy queued without a
  wait can run before the compute stream has written what it reads. Work on different
  streams is unordered unless an event orders it.
- **Events**: ``record(stream)`` captures the work queued on the stream so far (a later
  ``record`` captures anew); ``query()`` is true once that work has run, and for an event
  never recorded; ``synchronize()`` blocks until it has run (the device runs what it needs);
  ``stream.wait_event(event)`` makes the work queued on the stream after it wait for the work
  the event captured when it was recorded (a later ``record`` does not change that wait).
- **The current stream** is the device's compute stream, where the emulated forward queues
  its reads and writes of KV.
- **``cuMemcpyBatchAsync``**: ``count`` descriptors (destination, source, size), each
  attribute applying from its index on; every range must lie in one device allocation or one
  host registration (CUDA rejects a descriptor across two registrations), else
  ``CUDA_ERROR_INVALID_VALUE`` with ``failIdx`` naming the descriptor and nothing queued.
  ``srcAccessOrder`` STREAM reads the source when the copy runs; ANY lets the device read it
  at any time after the call, emulated as the earliest (at the call); the destination is
  written when the copy runs.
- **Host registration**: ``cudaHostRegister`` of a range that overlaps one registered is
  ``cudaErrorHostMemoryAlreadyRegistered``; ``cudaHostUnregister`` of an address that starts
  no registration is ``cudaErrorHostMemoryNotRegistered``.
- **Devices**: one per rank, each with its own streams; a stream's handle names its device.
- **Worker threads**: a thread over :class:`EmulatedQueue` s (vLLM's copy and IO threads)
  runs on the caller's thread when the host says (:meth:`Host.run_threads`), its device
  current, as long as its loop takes items: no thread timing reaches a verdict.

What is real: the bytes (every copy is a ``memmove`` between the addresses vLLM computed),
vLLM's code, torch's tensors. Not emulated: timing, priorities (recorded, never used),
pageable host copies (a descriptor outside every registration is refused: the emulation
cannot tell host memory it may read from memory it must not), peer copies, graphs.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
import types
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# CUDA's codes, as the driver and runtime return them
CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
SRC_ACCESS_ORDER_STREAM = 1
SRC_ACCESS_ORDER_ANY = 3

# The C signature of cuMemcpyBatchAsync (CUDA 12.8): dsts, srcs, sizes, count, attrs,
# attrsIdxs, numAttrs, failIdx, hStream.
BATCH_MEMCPY = ctypes.CFUNCTYPE(
    ctypes.c_uint,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_void_p,
    ctypes.c_void_p,
)


class _Location(ctypes.Structure):
    """``CUmemLocation``: a type and an id."""

    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """``CUmemcpyAttributes``, of which the emulation reads ``srcAccessOrder``."""

    _fields_ = [
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", _Location),
        ("dstLocHint", _Location),
        ("flags", ctypes.c_uint),
    ]


class DeviceError(RuntimeError):
    """A call the emulated device refuses as CUDA would fail it (out of range, unknown)."""


@dataclass
class Work:
    """One operation queued on a stream: run ``action``, or wait for ``event`` (a stream and
    a position in it) before the work after it."""

    what: str
    action: Callable[[], None] | None = None
    waits_for: tuple[Stream, int] | None = None
    writes: tuple[tuple[int, int], ...] = ()  # (address, bytes) it writes when it runs
    blocks: frozenset[int] = frozenset()  # the KV blocks it writes, where it says so


_handles = itertools.count(0x1000)


class Stream:
    """An emulated ``torch.cuda.Stream``: queued work, run in order when the device lets it."""

    def __init__(self, device: Device | None = None, priority: int = 0, **_: Any) -> None:
        self.device = device if device is not None else Device.current()
        self.priority = priority
        self.cuda_stream = next(_handles)
        self.queued: deque[Work] = deque()
        self.issued = 0  # work ever queued
        self.done = 0  # work run
        self.device.streams[self.cuda_stream] = self

    @staticmethod
    def priority_range() -> tuple[int, int]:
        """(lowest, highest), as CUDA numbers them: a lower number is a higher priority."""
        return 0, -5

    def enqueue(self, work: Work) -> None:
        self.queued.append(work)
        self.issued += 1

    def wait_event(self, event: Event) -> None:
        """Work queued after this waits for what ``event`` captured when it was recorded
        (nothing, for an event never recorded)."""
        if event.captured is not None:
            self.enqueue(Work("wait", waits_for=event.captured))

    def query(self) -> bool:
        return self.done == self.issued

    def synchronize(self) -> None:
        self.device.run_until(self, self.issued)

    def __repr__(self) -> str:
        return f"Stream(device={self.device.index}, handle={self.cuda_stream:#x})"


class Event:
    """An emulated ``torch.Event`` (and ``torch.cuda.Event``)."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.captured: tuple[Stream, int] | None = None

    def record(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else Device.current().current_stream
        self.captured = (stream, stream.issued)

    def query(self) -> bool:
        if self.captured is None:
            return True
        stream, position = self.captured
        return stream.done >= position

    def synchronize(self) -> None:
        if self.captured is not None:
            stream, position = self.captured
            stream.device.run_until(stream, position)


@dataclass
class Device:
    """One emulated GPU: its streams, its allocations, the host ranges registered with it."""

    index: int = 0
    streams: dict[int, Stream] = field(default_factory=dict)
    # device memory: (start address, bytes) of each allocation the runner declared
    allocations: list[tuple[int, int]] = field(default_factory=list)
    log: list[str] = field(default_factory=list)  # the work run, in order

    def __post_init__(self) -> None:
        self.current_stream = Stream(self)

    _current: Device | None = None

    @staticmethod
    def current() -> Device:
        if Device._current is None:
            raise DeviceError("no emulated device is current (emulation not installed)")
        return Device._current

    def make_current(self) -> None:
        Device._current = self

    def allocate(self, start: int, size: int) -> None:
        """Declare ``size`` bytes at ``start`` device memory (a KV cache's storage)."""
        self.allocations.append((start, size))

    def run_until(self, stream: Stream, position: int) -> None:
        """Run ``stream``'s work up to ``position`` (work ever queued), running first the
        work of other streams it waits for: the host blocks until all of it has run."""
        while stream.done < position:
            work = stream.queued[0]
            if work.waits_for is not None:
                other, at = work.waits_for
                if other.done < at:
                    self.run_until(other, at)
            stream.queued.popleft()
            if work.action is not None:
                work.action()
                self.log.append(work.what)
            stream.done += 1

    def runnable(self, stream: Stream) -> bool:
        """Whether ``stream``'s next work can run without running another stream first."""
        if not stream.queued:
            return False
        waits = stream.queued[0].waits_for
        return waits is None or waits[0].done >= waits[1]

    def run_copies(self) -> None:
        """Run every stream but the compute stream to its end, as early as their waits let
        them (the compute a wait needs runs first; the rest stays queued): a copy that does
        not wait for the compute it should follow runs before it."""
        for stream in list(self.streams.values()):
            if stream is not self.current_stream:
                self.run_until(stream, stream.issued)

    def pending_writes(self) -> list[tuple[int, int]]:
        """The (address, bytes) ranges queued work of this device is still to write."""
        return [w for s in self.streams.values() for work in s.queued for w in work.writes]

    def pending_blocks(self) -> set[int]:
        """The KV blocks queued work says it is still to write."""
        return {b for s in self.streams.values() for work in s.queued for b in work.blocks}


@dataclass
class Host:
    """The host side of the emulation: its registered (pinned) ranges, the devices by rank,
    and the worker threads it runs when the machine says."""

    devices: dict[int, Device] = field(default_factory=dict)
    registered: dict[int, int] = field(default_factory=dict)  # start -> bytes
    threads: list[EmulatedThread] = field(default_factory=list)

    def device(self, rank: int) -> Device:
        if rank not in self.devices:
            self.devices[rank] = Device(rank)
        return self.devices[rank]

    # -- cudaHostRegister / cudaHostUnregister ----------------------------------------------

    def host_register(self, ptr: int, size: int) -> int:
        if size <= 0:
            return CUDA_ERROR_INVALID_VALUE
        for start, length in self.registered.items():
            if ptr < start + length and start < ptr + size:
                return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
        self.registered[ptr] = size
        return CUDA_SUCCESS

    def host_unregister(self, ptr: int) -> int:
        if ptr not in self.registered:
            return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED
        del self.registered[ptr]
        return CUDA_SUCCESS

    def registration_of(self, start: int, size: int) -> tuple[int, int] | None:
        """The registration that holds ``[start, start + size)`` whole, or None."""
        for begin, length in self.registered.items():
            if begin <= start and start + size <= begin + length:
                return begin, length
        return None

    # -- cuMemcpyBatchAsync -----------------------------------------------------------------

    def batch_memcpy(
        self,
        dsts: int | None,
        srcs: int | None,
        sizes: int | None,
        count: int,
        attrs: int | None,
        attr_idxs: int | None,
        num_attrs: int,
        fail_idx: int | None,
        handle: int | None,
    ) -> int:
        """``cuMemcpyBatchAsync``: check every descriptor, then queue one copy on the stream
        ``handle`` names (the sources of ANY read now, those of STREAM when it runs)."""
        stream = self._stream(handle)
        if stream is None or count == 0 or not dsts or not srcs or not sizes:
            return CUDA_ERROR_INVALID_VALUE
        dst = (ctypes.c_uint64 * count).from_address(dsts)
        src = (ctypes.c_uint64 * count).from_address(srcs)
        size = (ctypes.c_size_t * count).from_address(sizes)
        orders = self._orders(attrs, attr_idxs, num_attrs, count)
        copies: list[tuple[int, int, int, bytes | None]] = []
        for i in range(count):
            if not self._known(stream.device, dst[i], size[i]) or not self._known(
                stream.device, src[i], size[i]
            ):
                if fail_idx:
                    ctypes.c_size_t.from_address(fail_idx).value = i
                return CUDA_ERROR_INVALID_VALUE
            early = ctypes.string_at(src[i], size[i]) if orders[i] == SRC_ACCESS_ORDER_ANY else None
            copies.append((dst[i], src[i], size[i], early))

        def run() -> None:
            for to, source, length, early in copies:
                if early is None:
                    ctypes.memmove(to, source, length)
                else:
                    ctypes.memmove(to, early, length)

        writes = tuple((to, length) for to, _, length, _ in copies)
        stream.enqueue(Work(f"copy of {count} descriptors on {stream!r}", run, writes=writes))
        return CUDA_SUCCESS

    def _stream(self, handle: int | None) -> Stream | None:
        for device in self.devices.values():
            if handle in device.streams:
                return device.streams[handle]
        return None

    @staticmethod
    def _orders(attrs: int | None, attr_idxs: int | None, num_attrs: int, count: int) -> list[int]:
        """Each descriptor's srcAccessOrder: attribute ``k`` applies from ``attrIdxs[k]`` on
        (STREAM where none is given, CUDA's default for a stream-ordered copy)."""
        orders = [SRC_ACCESS_ORDER_STREAM] * count
        if not num_attrs or not attrs or not attr_idxs:
            return orders
        size = ctypes.sizeof(_Attributes)
        starts = (ctypes.c_size_t * num_attrs).from_address(attr_idxs)
        for k in range(num_attrs):
            order = _Attributes.from_address(attrs + k * size).srcAccessOrder
            for i in range(starts[k], count):
                orders[i] = order
        return orders

    def _known(self, device: Device, start: int, size: int) -> bool:
        """Whether ``[start, start + size)`` lies in one allocation of ``device`` or in one
        host registration."""
        if size <= 0:
            return False
        if any(a <= start and start + size <= a + n for a, n in device.allocations):
            return True
        return self.registration_of(start, size) is not None

    # -- threads ----------------------------------------------------------------------------

    def run_threads(self) -> None:
        """Let every worker thread process what was queued for it."""
        for thread in list(self.threads):
            thread.run_pending()


class EmulatedQueue:
    """``queue.SimpleQueue`` for a thread the host runs: ``get`` hands out what was put, then
    ``None`` (the loop's end) when nothing is left. A ``None`` that was put (a shutdown)
    stops the thread that takes it."""

    taken = 0  # items handed out, by every queue: how a host sees a thread make progress

    def __init__(self) -> None:
        self.items: deque[Any] = deque()

    def put(self, item: Any) -> None:
        self.items.append(item)

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if not self.items:
            return None
        item = self.items.popleft()
        EmulatedQueue.taken += 1
        if item is None and EmulatedThread.running is not None:
            EmulatedThread.running.stopped = True
        return item


class EmulatedThread:
    """``threading.Thread`` for a loop over :class:`EmulatedQueue` s: it runs on the caller's
    thread, with the device current when it was started, when the host says
    (:meth:`Host.run_threads`), as long as its loop takes items; a loop that returns on an
    empty queue's ``None`` is simply started again the next time, one that took a ``None``
    put (a shutdown) has stopped."""

    host: Host | None = None
    running: EmulatedThread | None = None  # the thread whose loop runs now

    def __init__(
        self,
        target: Callable[..., Any] | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        daemon: bool | None = None,
        name: str | None = None,
    ) -> None:
        self.target, self.args, self.kwargs = target, args, kwargs or {}
        self.name = name or "emulated"
        self.daemon = daemon
        self.device: Device | None = None
        self.started = self.stopped = False

    def start(self) -> None:
        if EmulatedThread.host is None:
            raise DeviceError("no emulated host to start a thread on")
        self.started, self.device = True, Device._current
        EmulatedThread.host.threads.append(self)

    def run_pending(self) -> None:
        if not self.started or self.target is None:
            return
        caller = Device._current
        if self.device is not None:
            self.device.make_current()
        try:
            while not self.stopped:
                before = EmulatedQueue.taken
                EmulatedThread.running = self
                try:
                    self.target(*self.args, **self.kwargs)
                finally:
                    EmulatedThread.running = None
                if EmulatedQueue.taken == before:
                    break
        finally:
            Device._current = caller

    def join(self, timeout: float | None = None) -> None:
        self.run_pending()

    def is_alive(self) -> bool:
        return self.started and not self.stopped


_active: Host | None = None  # the host the doors lead to (activate)


def active() -> Host:
    if _active is None:
        raise DeviceError("no emulated host is active")
    return _active


def activate(host: Host) -> None:
    """Lead the doors to ``host`` (its devices, registrations and threads)."""
    global _active
    _active = host
    EmulatedThread.host = host


class _Cudart:
    """``torch.cuda.cudart()``: host registration through the active host."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> Any:
        return _Code(active().host_register(ptr, size))

    def cudaHostUnregister(self, ptr: int) -> Any:
        return _Code(active().host_unregister(ptr))

    def cudaGetLastError(self) -> Any:
        return _Code(CUDA_SUCCESS)


@dataclass(frozen=True)
class _Code:
    value: int


def _batch_memcpy(*args: Any) -> int:
    return active().batch_memcpy(*args)


# (a C function pointer to the active host's batch copy, alive as long as the module)
_BATCH_MEMCPY_CALLBACK = BATCH_MEMCPY(_batch_memcpy)


def driver_module() -> types.ModuleType:
    """A ``cuda.bindings.driver`` whose ``cuGetProcAddress(b"cuMemcpyBatchAsync", ...)``
    gives the address of the emulated batch copy."""
    module = types.ModuleType("cuda.bindings.driver")

    class CUresult:
        CUDA_SUCCESS = CUDA_SUCCESS
        CUDA_ERROR_NOT_FOUND = 500

    def cu_get_proc_address(symbol: bytes, version: int, flags: int) -> tuple[int, int, int]:
        if symbol != b"cuMemcpyBatchAsync":
            return CUresult.CUDA_ERROR_NOT_FOUND, 0, 0
        address = ctypes.cast(_BATCH_MEMCPY_CALLBACK, ctypes.c_void_p).value
        assert address is not None
        return CUresult.CUDA_SUCCESS, address, 0

    module.CUresult = CUresult  # type: ignore[attr-defined]
    module.cuGetProcAddress = cu_get_proc_address  # type: ignore[attr-defined]
    module.emulated = True  # type: ignore[attr-defined]
    return module


def _doors(patches: Sequence[tuple[Any, str, Any]]) -> list[tuple[Any, str, Any]]:
    import torch

    return [
        (torch.cuda, "Stream", Stream),
        (torch.cuda, "Event", Event),
        (torch.cuda, "current_stream", lambda device=None: Device.current().current_stream),
        (torch.cuda, "cudart", _Cudart),
        (torch, "Event", Event),
        *patches,
    ]


def _driver_modules() -> dict[str, types.ModuleType]:
    driver = driver_module()
    cuda_pkg, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
    cuda_pkg.bindings = bindings  # type: ignore[attr-defined]
    bindings.driver = driver  # type: ignore[attr-defined]
    return {"cuda": cuda_pkg, "cuda.bindings": bindings, "cuda.bindings.driver": driver}


_installed_for_good = False


def install(patches: Sequence[tuple[Any, str, Any]] = ()) -> None:
    """The doors installed for the rest of the process (a release's environment process
    that drives vLLM's worker does nothing else); once: a second call changes nothing."""
    global _installed_for_good
    if _installed_for_good:
        return
    sys.modules.update(_driver_modules())
    for obj, name, value in _doors(patches):
        setattr(obj, name, value)
    _installed_for_good = True


@contextmanager
def installed(host: Host, patches: Sequence[tuple[Any, str, Any]] = ()) -> Iterator[Host]:
    """``host`` active behind the doors (torch's CUDA calls, the driver's) and ``patches``
    (object, attribute, value) applied, for the block; everything restored after it."""
    modules = _driver_modules()
    saved_modules = {name: sys.modules.get(name) for name in modules}
    changes = _doors(patches)
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in changes]
    sys.modules.update(modules)
    for obj, name, value in changes:
        setattr(obj, name, value)
    activate(host)
    try:
        yield host
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        global _active
        _active = None
        EmulatedThread.host = None
        Device._current = None
