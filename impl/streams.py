"""Streams and events for the copy engine, on CUDA or emulated on the CPU.

On CUDA these are ``torch.cuda`` streams and events. Without CUDA the "device" is host
memory and the emulation keeps the two properties the offload path depends on:

- the compute stream runs behind the scheduler: KV writes of a step are queued and run
  only when a marker recorded after them is waited on, or when they are more than ``lag``
  steps old (as a GPU running behind an asynchronous scheduler), so a copy that does not
  wait for compute reads stale bytes (the race of vLLM #45704);
- copies run on a copy engine, loads before stores, so completion order is not issue
  order; a caller polls or waits for one given transfer. :class:`CopyThread` runs them on
  a background thread, as a DMA engine beside the scheduler; :class:`InlineCopies`, the
  engine of lockstep mode, runs them on the caller's thread when the step's submissions
  are done, when one is waited for, or when the engine is drained, in the same order.

Old compute work is run only after the copy engine is drained, so whether a copy saw a
write never depends on thread timing: both engines are deterministic, and give the same
bytes.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import Counter, deque
from collections.abc import Callable
from typing import Protocol


class ComputeStream:
    """The emulated compute stream: queued work runs lazily, in order."""

    def __init__(self, lag: int = 1) -> None:
        self.lag = lag
        self._ops: deque[tuple[int, int, int, Callable[[], None]]] = deque()
        self._targets: Counter[int] = Counter()
        self._seq = 0
        self._step = 0
        self._lock = threading.Lock()

    def enqueue(self, target: int, op: Callable[[], None]) -> None:
        """Queue ``op``, which writes device block ``target``."""
        with self._lock:
            self._seq += 1
            self._ops.append((self._seq, self._step, target, op))
            self._targets[target] += 1

    def pending_targets(self) -> set[int]:
        """Device blocks with queued writes: their bytes are not final yet."""
        with self._lock:
            return {t for t, n in self._targets.items() if n}

    def _run_first(self) -> None:
        _, _, target, op = self._ops.popleft()
        op()
        self._targets[target] -= 1

    def record(self) -> int:
        """A marker after everything queued so far."""
        with self._lock:
            return self._seq

    def run_until(self, marker: int) -> None:
        with self._lock:
            while self._ops and self._ops[0][0] <= marker:
                self._run_first()

    def synchronize(self) -> None:
        self.run_until(self.record())

    def next_step(self) -> None:
        """A new step begins: work older than ``lag`` steps has finished by now. Call it
        with no copy running (``CopyThread.drain``)."""
        with self._lock:
            self._step += 1
            while self._ops and self._ops[0][1] < self._step - self.lag:
                self._run_first()


class CopyJob:
    """One copy: ``finished`` once it has run; ``signal`` (the thread's engine only) is set
    then too, for whoever blocks on it."""

    def __init__(self, run: Callable[[], None], signal: threading.Event | None = None) -> None:
        self.run = run
        self.finished = False
        self.signal = signal
        self.error: BaseException | None = None

    def execute(self) -> None:
        try:
            self.run()
        except BaseException as error:  # reported to whoever waits for the job
            self.error = error
        self.finished = True
        if self.signal is not None:
            self.signal.set()
        # The closure holds the worker: a finished job must not keep it alive.
        self.run = _nothing

    def result(self) -> None:
        """Raise what the copy raised, if anything (call once it is done)."""
        if self.error is not None:
            raise self.error


def _nothing() -> None:
    return None


class CopyEngine(Protocol):
    """Where a worker's copies run: :class:`CopyThread` or :class:`InlineCopies`."""

    LOAD: int
    STORE: int

    def submit(self, priority: int, run: Callable[[], None]) -> CopyJob: ...
    def wait(self, job: CopyJob) -> None: ...
    def drain(self) -> None: ...
    def stop(self) -> None: ...


class CopyThread:
    """One background thread running copy jobs, loads before stores. :meth:`stop` ends the
    thread once the jobs submitted so far have run; a stopped copy engine takes no more."""

    LOAD, STORE = 0, 1

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, CopyJob]] = []
        self._order = itertools.count()
        self._cv = threading.Condition()
        self._unfinished = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="kvoffload-copy", daemon=True)
        self._thread.start()

    def submit(self, priority: int, run: Callable[[], None]) -> CopyJob:
        job = CopyJob(run, threading.Event())
        with self._cv:
            if self._stopping:
                raise RuntimeError("the copy engine is stopped")
            heapq.heappush(self._heap, (priority, next(self._order), job))
            self._unfinished += 1
            self._cv.notify_all()
        return job

    def stop(self) -> None:
        """Run what was submitted, then end the thread (idempotent)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def drain(self) -> None:
        """Wait until every submitted job has run."""
        with self._cv:
            while self._unfinished:
                self._cv.wait()

    def wait(self, job: CopyJob) -> None:
        """Block until ``job`` has run; raise what it raised."""
        assert job.signal is not None, "a job of another engine"
        job.signal.wait()
        job.result()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._stopping:
                    self._cv.wait()
                if not self._heap:
                    return  # stopping, and every job has run
                _, _, job = heapq.heappop(self._heap)
            job.execute()
            # The idle thread must not keep the last job (and its worker) alive.
            del job
            with self._cv:
                self._unfinished -= 1
                self._cv.notify_all()


class InlineCopies:
    """The copy engine of lockstep mode: no thread. Jobs queue as they are submitted and run
    on the caller's thread, loads before stores and otherwise in submission order, when the
    worker's step has submitted everything (:meth:`drain`), or as far as needed when one of
    them is waited for. So every copy of a step has completed when the step returns, and the
    order and the bytes are those of :class:`CopyThread`. :meth:`stop` runs what is queued."""

    LOAD, STORE = CopyThread.LOAD, CopyThread.STORE

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, CopyJob]] = []
        self._order = itertools.count()
        self._stopped = False

    def submit(self, priority: int, run: Callable[[], None]) -> CopyJob:
        if self._stopped:
            raise RuntimeError("the copy engine is stopped")
        job = CopyJob(run)
        heapq.heappush(self._heap, (priority, next(self._order), job))
        return job

    def wait(self, job: CopyJob) -> None:
        """Run queued jobs in their order until ``job`` has run; raise what it raised."""
        while not job.finished:
            heapq.heappop(self._heap)[2].execute()
        job.result()

    def drain(self) -> None:
        while self._heap:
            heapq.heappop(self._heap)[2].execute()

    def stop(self) -> None:
        self.drain()
        self._stopped = True
