"""What an implementation under test must offer, and the implementations known.

An adapter is a factory ``config -> Target``. ``Target`` is the driver API plus the snapshot
and a data check: any implementation that has them can be driven by the conformance machine.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from kvoffload.impl import FAULTS, OffloadImpl
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


def adapters() -> dict[str, Adapter]:
    """``impl`` (host memory), ``impl-cuda`` where CUDA is present, ``fault:NAME`` for every
    fault of the catalogue (host memory), all in lockstep mode, and ``vllm`` where vLLM
    imports (a release environment of ``kvoffload install``)."""
    # Lockstep mode: each step's copies complete before it returns, on this thread, in the
    # copy engine's order, so that a program replays alike and starts no thread.
    known: dict[str, Adapter] = {
        "impl": lambda config: OffloadImpl(config, device="cpu", lockstep=True)
    }
    if torch.cuda.is_available():
        known["impl-cuda"] = lambda config: OffloadImpl(config, device="cuda", lockstep=True)
    for name in FAULTS:
        known[f"fault:{name}"] = _faulty(name)
    if importlib.util.find_spec("vllm") is not None:
        known["vllm"] = _vllm
    return known


def _vllm(config: OffloadConfig) -> Target:
    from kvoffload.upstream.target import VllmOffload

    return VllmOffload(config)


def unsupported(adapter_name: str, config: OffloadConfig) -> str | None:
    """Why ``adapter_name`` cannot run ``config`` (vLLM rejects some layouts), or None."""
    if adapter_name != "vllm":
        return None
    from kvoffload.upstream.vllm_world import supported

    return supported(config)


def takes_reset(adapter_name: str) -> bool:
    """Whether ``adapter_name``'s target has ``reset()``: vLLM's offload code before 0.24.0
    has none, so the machine does not draw it there."""
    if adapter_name != "vllm":
        return True
    from kvoffload.upstream.vllm_world import takes_reset as vllm_takes_reset

    return vllm_takes_reset()


def takes_stats(adapter_name: str) -> bool:
    """Whether ``adapter_name``'s target reports stats: vLLM's offload code before 0.31.0
    has no ``get_stats``, so the machine does not ask there."""
    if adapter_name != "vllm":
        return True
    from kvoffload.upstream.vllm_world import takes_stats as vllm_takes_stats

    return vllm_takes_stats()


def expected_variant(adapter_name: str) -> str:
    """The model variant ``adapter_name`` is compared with: the fixed model, or for vLLM the
    variant of the running release (``kvoffload.upstream.releases``)."""
    if adapter_name != "vllm":
        return "fixed"
    from kvoffload.upstream.releases import release

    return str(release(os.environ.get("KVOFFLOAD_VLLM_VERSION", "")).model_variant)


def _faulty(name: str) -> Adapter:
    return lambda config: OffloadImpl(config, faults=[name], device="cpu", lockstep=True)


def default_adapter() -> str:
    """The implementation on the default device."""
    return "impl-cuda" if torch.cuda.is_available() else "impl"
