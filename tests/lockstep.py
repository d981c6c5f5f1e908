"""Run one program of driver calls against the model and an implementation side by side,
comparing every result, every snapshot and the KV bytes after every call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoffload.impl import OffloadImpl
from kvoffload.model import KVOffloadError, OffloadConfig, OffloadModel

Call = tuple[Any, ...]


def apply(target: OffloadModel | OffloadImpl, call: Call) -> object:
    name, *args = call
    if name == "add":
        return target.add_request(*args)
    if name == "step":
        return target.step(*args)
    if name == "finish":
        return target.finish(*args)
    if name == "store":
        return target.complete_store(*args)
    if name == "load":
        return target.complete_load(*args)
    if name == "reset":
        return target.reset()
    if name == "lookup":
        return target.lookup(*args)
    if name == "drain":
        done: list[object] = [target.complete_load(e, w) for e, w in target.outstanding("load")]
        done += [target.complete_store(e, w) for e, w in target.outstanding("store")]
        return done
    raise ValueError(f"unknown call {name!r}")


def _outcome(target: OffloadModel | OffloadImpl, call: Call) -> object:
    try:
        return apply(target, call)
    except (KVOffloadError, ValueError, AssertionError) as error:
        return f"{type(error).__name__}: {error}"


def first_disagreement(
    config: OffloadConfig,
    program: Sequence[Call],
    faults: Sequence[str] = (),
    device: str | None = None,
) -> str | None:
    """None when the implementation conforms on ``program``; else what differed first."""
    model = OffloadModel(config, check=True)
    impl = OffloadImpl(config, faults=faults, device=device)
    for n, call in enumerate(program):
        expected, actual = _outcome(model, call), _outcome(impl, call)
        if expected != actual:
            return f"call {n} {call}: model returned {expected!r}, implementation {actual!r}"
        mine, theirs = model.snapshot(), impl.snapshot()
        if mine != theirs:
            fields = [
                f for f in mine.__dataclass_fields__ if getattr(mine, f) != getattr(theirs, f)
            ]
            return f"call {n} {call}: snapshots differ in {fields}"
        wrong = impl.data_mismatches()
        if wrong:
            return f"call {n} {call}: {wrong[0]}"
    return None
