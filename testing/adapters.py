"""What an implementation under test must offer, and the implementations known.

An adapter is a factory ``config -> Target``. ``Target`` is the driver API plus the snapshot
and a data check: any implementation that has them can be driven by the conformance machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kvoffload.impl import FAULTS, OffloadImpl
from kvoffload.model import FinishResult, OffloadConfig, Snapshot, StepResult


class Target(Protocol):
    """The driver API of :class:`kvoffload.model.OffloadModel`, plus ``data_mismatches``."""

    def add_request(self, request_id: str, prompt: Sequence[int], max_tokens: int = 1) -> None: ...
    def step(self, token_budget: int) -> StepResult: ...
    def finish(self, request_id: str) -> FinishResult: ...
    def complete_store(self, event: int, worker: int = 0) -> bool: ...
    def complete_load(self, event: int, worker: int = 0) -> tuple[str, ...]: ...
    def lookup(self, tokens: Sequence[int]) -> int: ...
    def reset(self) -> bool: ...
    def has_pending_stores(self) -> bool: ...
    def live_requests(self) -> list[str]: ...
    def outstanding(self, kind: str) -> list[tuple[int, int]]: ...
    def snapshot(self) -> Snapshot: ...
    def data_mismatches(self) -> list[str]:
        """Every stored or loaded block whose bytes are not its key's KV; empty if none."""
        ...


Adapter = Callable[[OffloadConfig], OffloadImpl]


def adapters() -> dict[str, Adapter]:
    """``impl`` (host memory), ``impl-cuda`` where CUDA is present, and ``fault:NAME`` for every
    fault of the catalogue (host memory)."""
    known: dict[str, Adapter] = {"impl": lambda config: OffloadImpl(config, device="cpu")}
    if torch.cuda.is_available():
        known["impl-cuda"] = lambda config: OffloadImpl(config, device="cuda")
    for name in FAULTS:
        known[f"fault:{name}"] = _faulty(name)
    return known


def _faulty(name: str) -> Adapter:
    return lambda config: OffloadImpl(config, faults=[name], device="cpu")


def default_adapter() -> str:
    """The implementation on the default device."""
    return "impl-cuda" if torch.cuda.is_available() else "impl"
