"""The targets the machines drive, as data: a registry of target specifications.

A :class:`TargetSpec` says everything the machines, the campaigns and a failure file need to
know of a target: how it is built from a configuration, which model variant it is compared
with, what it takes (injected faults, ``reset()``, stats, each configuration), whether it can
run here, and where its failures replay. The implementation (``impl``, ``impl-cuda``, a
``fault:NAME`` of :data:`kvoffload.impl.FAULTS` for every fault of the catalogue) and vLLM's
own offload code (``vllm``, :mod:`kvoffload.vllm_target`) are the built-in rows; a user's own
implementation is registered beside them with :func:`register`, or from another installed
package by an entry point of the group ``kvoffload.targets`` naming a :class:`TargetSpec`
(``docs/conformance.md``, "Your own target").

Invariants kept:

- BY DATA: nothing above this module asks a target's name what the target takes: the
  answers are the fields of its row.
- ONE ROW PER NAME: :func:`register` refuses a name already taken (a built-in's included)
  and a name that is not a short word of letters, digits and ``-_.:+``; nothing is changed
  then.
- CLEAR MISS: :func:`spec` of a name no row has raises :class:`UnknownTargetError` (a
  :class:`~kvoffload.model.errors.ConfigError`: exit status 2) naming it and the known
  names; :func:`adapters` lists only those that can run here.
- LAZY: the table imports neither torch nor vLLM; a row imports what its target needs when
  it is built or asked, and the rows of the fault catalogue (``fault:NAME``, a name no
  other row may take) are read from it the first time one is asked for, or the whole list.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvoffload.model.catalogue import canonical
from kvoffload.model.config import OffloadConfig
from kvoffload.model.errors import ConfigError
from kvoffload.model.limits import brief
from kvoffload.model.variants import is_variant
from kvoffload.testing.adapters import Adapter, Target

ENTRY_POINTS = "kvoffload.targets"
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.:+-]{0,63}")


class UnknownTargetError(ConfigError, KeyError):
    """A target name no row of the registry has; ``known`` says, in one short line, which
    names there are (for a ``fault:`` name, the catalogue's faults)."""

    def __init__(self, message: str, known: str = "") -> None:
        super().__init__(message)
        self.known = known

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


def _fixed() -> str:
    return "fixed"


def _yes() -> bool:
    return True


def _nothing() -> None:
    return None


def _any_config(config: OffloadConfig) -> str | None:
    return None


@dataclass(frozen=True)
class TargetSpec:
    """One target: how it is built and what it takes. Callables are asked when needed, since
    some answers depend on the environment (vLLM's release)."""

    name: str
    build: Adapter  # config -> a fresh target, in lockstep mode
    summary: str  # one line: what it is
    variant: Callable[[], str] = _fixed  # the model variant it is compared with
    injects: bool = True  # takes injected faults (fail_store, corrupt)
    resets: Callable[[], bool] = _yes  # has reset()
    reports_stats: Callable[[], bool] = _yes  # has stats()
    # why it cannot run a configuration (vLLM rejects some layouts), or None
    unsupported: Callable[[OffloadConfig], str | None] = _any_config
    # why it cannot run here at all (no GPU, no vLLM), or None
    unavailable: Callable[[], str | None] = _nothing
    faults: tuple[str, ...] = ()  # the planted faults it runs with
    # the implementation (OffloadImpl) on this device with ``faults``: how a failure's
    # reproducer builds it; None for any other target (rebuilt from the registry by name)
    device: str | None = None
    # vLLM's own Scheduler with the connector, as the scheduler machine drives it, built
    # from a configuration, whether admission reserves the whole sequence and (the worker
    # machine's) the layout of vLLM's own workers; None when the target has no scheduler
    scheduler: Callable[..., Any] | None = None
    # the vLLM release and the exact target it runs, as failures record them
    release: Callable[[], str | None] = _nothing
    identity: Callable[[], dict[str, str] | None] = _nothing
    # its failures replay in the environment they name (a vLLM release or tree), not in
    # whatever environment reads them (kvoffload.replaying)
    elsewhere: bool = False

    def available(self) -> bool:
        return self.unavailable() is None


def _impl(device: str, faults: tuple[str, ...] = ()) -> Adapter:
    # Lockstep mode: each step's copies complete before it returns, on this thread, in the
    # copy engine's order, so that a program replays alike and starts no thread.
    def build(config: OffloadConfig) -> Target:
        from kvoffload.impl import OffloadImpl

        return OffloadImpl(config, faults=list(faults), device=device, lockstep=True)

    return build


def _no_cuda() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "no CUDA device here"


def _vllm(config: OffloadConfig) -> Target:
    from kvoffload.vllm_target.offload import VllmOffload

    return VllmOffload(config)


def _vllm_scheduler(
    config: OffloadConfig, whole_sequence_admission: bool, workers: Any = None
) -> Any:
    from kvoffload.vllm_target.scheduler import VllmScheduler

    return VllmScheduler(config, whole_sequence_admission, workers)


def _no_vllm() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vLLM does not import here (a release runs in its own environment: --target vllm==X)"
    return None


def _vllm_variant() -> str:
    from kvoffload.vllm_target.releases import release

    return str(release(os.environ.get("KVOFFLOAD_VLLM_VERSION", "")).model_variant)


def _vllm_resets() -> bool:
    from kvoffload.vllm_target.world import takes_reset

    return takes_reset()


def _vllm_stats() -> bool:
    from kvoffload.vllm_target.world import takes_stats

    return takes_stats()


def _vllm_unsupported(config: OffloadConfig) -> str | None:
    from kvoffload.vllm_target.world import supported

    return supported(config)


def _vllm_release() -> str | None:
    # set by the release environment the check runs in (kvoffload.upstream.install)
    return os.environ.get("KVOFFLOAD_VLLM_VERSION") or None


def _vllm_identity() -> dict[str, str] | None:
    from kvoffload.vllm_target.forms import running_identity

    identity = running_identity()
    return None if identity is None else {k: v for k, v in identity.items() if v is not None}


FAULT = "fault:"  # the rows of the fault catalogue: fault:NAME


@functools.cache
def _fault_rows() -> dict[str, TargetSpec]:
    """A row per fault of the catalogue (which imports the implementation, and torch)."""
    from kvoffload.impl.faults import FAULTS

    rows = (
        TargetSpec(
            f"{FAULT}{name}",
            _impl("cpu", (name,)),
            f"the implementation with the fault {name} planted",
            faults=(name,),
            device="cpu",
        )
        for name in FAULTS
    )
    return {row.name: row for row in rows}


@functools.cache
def _built_in() -> dict[str, TargetSpec]:
    rows = [
        TargetSpec("impl", _impl("cpu"), "the implementation, host memory", device="cpu"),
        TargetSpec(
            "impl-cuda",
            _impl("cuda"),
            "the implementation on a CUDA device",
            unavailable=_no_cuda,
            device="cuda",
        ),
        TargetSpec(
            "vllm",
            _vllm,
            "vLLM's own offload code of this environment",
            variant=_vllm_variant,
            injects=False,
            resets=_vllm_resets,
            reports_stats=_vllm_stats,
            unsupported=_vllm_unsupported,
            unavailable=_no_vllm,
            release=_vllm_release,
            identity=_vllm_identity,
            elsewhere=True,
            scheduler=_vllm_scheduler,
        ),
    ]
    return {row.name: row for row in rows}


_registered: dict[str, TargetSpec] = {}
_plugins_loaded = False


def register(row: TargetSpec) -> None:
    """Add ``row`` to the registry under its name, which must be new."""
    if not isinstance(row, TargetSpec):
        raise ConfigError(f"a target is registered as a TargetSpec, got {brief(row)}")
    if not isinstance(row.name, str) or not _NAME.fullmatch(row.name):
        raise ConfigError(
            f"target name {brief(row.name)} must be a letter, then up to 63 letters, digits "
            "or -_.:+"
        )
    if row.name in _built_in() or row.name in _registered or row.name.startswith(FAULT):
        raise ConfigError(f"a target named {row.name!r} is already registered")
    if not callable(row.build):
        raise ConfigError(f"target {row.name!r}: build must be callable, got {brief(row.build)}")
    _registered[row.name] = row


def unregister(name: str) -> None:
    """Remove a target :func:`register` added (a built-in stays)."""
    if name not in _registered:
        raise UnknownTargetError(f"no registered target is named {brief(name)}")
    del _registered[name]


def _load_plugins() -> None:
    """The rows other installed packages declare (entry points of :data:`ENTRY_POINTS`),
    once. A plugin that fails to load, or declares a name already taken, is an error naming
    it, never a silent miss; then no plugin's row is added, and the next lookup says so
    again."""
    global _plugins_loaded
    if _plugins_loaded:
        return
    new: dict[str, TargetSpec] = {}
    for entry in importlib.metadata.entry_points(group=ENTRY_POINTS):
        try:
            row = entry.load()
        except Exception as error:
            raise ConfigError(
                f"the target plugin {entry.name!r} ({entry.value}) cannot be loaded: {error}"
            ) from error
        if not isinstance(row, TargetSpec):
            raise ConfigError(
                f"the target plugin {entry.name!r} ({entry.value}) is not a TargetSpec"
            )
        taken = _all(faults=False).get(row.name) or new.get(row.name)
        if taken is row:
            continue  # the plugin's module registered it when it was imported
        if taken is not None or row.name.startswith(FAULT):
            # Two rows under one name: which one a run meant cannot be told.
            raise ConfigError(
                f"the target plugin {entry.name!r} ({entry.value}) declares the target "
                f"{row.name!r}, which {'kvoffload' if row.name in _built_in() else 'another'}"
                " already registers"
            )
        new[row.name] = row
    for row in new.values():
        register(row)
    _plugins_loaded = True


def _all(faults: bool = True) -> dict[str, TargetSpec]:
    return _built_in() | (_fault_rows() if faults else {}) | _registered


def names() -> list[str]:
    """Every target name the registry has, whether or not it can run here."""
    _load_plugins()
    return list(_all())


def spec(name: str) -> TargetSpec:
    """The row of target ``name``, or :class:`UnknownTargetError`."""
    if not isinstance(name, str):
        raise UnknownTargetError(f"a target is named by a string, got {brief(name)}")
    if name.startswith(FAULT):  # an old name of a fault reads as the bug's id
        name = FAULT + canonical(name.removeprefix(FAULT))
    row = _all(faults=name.startswith(FAULT)).get(name)
    if row is None:
        _load_plugins()
        row = _all().get(name)
    if row is None:
        if name.startswith(FAULT):
            faults = ", ".join(sorted(n.removeprefix(FAULT) for n in _fault_rows()))
            raise UnknownTargetError(
                f"{brief(name)} names no fault of the catalogue; known: {faults}", faults
            )
        known = known_line()
        raise UnknownTargetError(f"unknown target {brief(name)}; known: {known}", known)
    return row


def with_scheduler() -> list[str]:
    """The targets the scheduler machine can drive (rows with a scheduler of their own); the
    fault catalogue's rows have none, so it is not read."""
    _load_plugins()
    return [name for name, row in _all(faults=False).items() if row.scheduler is not None]


def known_line() -> str:
    """The names of the registry in one short line, the fault catalogue's as ``fault:NAME``."""
    rows = [n for n in names() if not n.startswith(FAULT)]
    return ", ".join([*rows, f"{FAULT}NAME (a fault of the catalogue)"])


def variant_of(name: str, variant: str | None = None) -> str:
    """``variant`` if given (one of the model's), else the one target ``name`` is compared
    with."""
    chosen = variant or spec(name).variant()
    if not is_variant(chosen):
        raise ConfigError(f"target {name!r}: unknown model variant {brief(chosen)}")
    return chosen


def adapters() -> dict[str, Adapter]:
    """The targets that can run here, by name: their builders."""
    return {name: row.build for name in names() if (row := _all()[name]).available()}


def default_target() -> str:
    """The implementation on the default device."""
    return "impl-cuda" if spec("impl-cuda").available() else "impl"
