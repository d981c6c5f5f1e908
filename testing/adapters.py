"""What an implementation under test must offer.

An adapter is a factory ``config -> Target``. ``Target`` is the driver API plus the snapshot
and a data check: any implementation that has them can be driven by the conformance machine.
The targets known, and what each takes, are rows of :mod:`kvoffload.testing.targets`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from kvoffload.model import FinishResult, OffloadConfig, Snapshot, StepResult
from kvoffload.model.types import KVEvent, OffloadStats


class Target(Protocol):
    """The driver API of :class:`kvoffload.model.OffloadModel` and its snapshot."""

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int = 1,
        skip_reading_prefix_cache: bool = False,
    ) -> None: ...
    def step(self, token_budget: int) -> StepResult: ...
    def finish(self, request_id: str) -> FinishResult: ...
    def complete_store(self, event: int, worker: int = 0) -> bool: ...
    def complete_load(self, event: int, worker: int = 0) -> tuple[str, ...]: ...
    def lookup(self, tokens: Sequence[int]) -> int: ...
    def reset(self) -> bool: ...
    def reset_prefix_cache(
        self, reset_connector: bool = False, reset_running_requests: bool = False
    ) -> bool: ...
    def has_pending_stores(self) -> bool: ...
    def stats(self) -> OffloadStats: ...
    def live_requests(self) -> list[str]: ...
    def outstanding(self, kind: str) -> list[tuple[int, int]]: ...
    def snapshot(self) -> Snapshot: ...
    def take_events(self) -> list[KVEvent]: ...


@runtime_checkable
class HoldsBytes(Protocol):
    """A target that moves KV bytes, and can say which blocks hold the wrong ones."""

    def data_mismatches(self, exempt: frozenset[int] = frozenset()) -> list[str]:
        """Every stored or loaded block whose bytes are not its key's KV, CPU blocks in
        ``exempt`` aside; empty if none. May skip the check when nothing it reads changed
        since it last found nothing."""
        ...

    def check_data(self, exempt: frozenset[int] = frozenset()) -> list[str]:
        """The same, always checked in full."""
        ...


@runtime_checkable
class Injectable(Protocol):
    """A target that takes injected faults: a worker's failed store, a damaged host block
    (``docs/spec.md``, the integrity contract)."""

    def fail_store(self, event: int, worker: int = 0) -> bool: ...
    def corrupt(self, cpu_block: int, worker: int = 0) -> None: ...


Adapter = Callable[[OffloadConfig], Target]
