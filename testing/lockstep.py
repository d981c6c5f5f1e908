"""Run one program of driver calls against the model and an implementation side by side,
comparing every result, every snapshot and the KV bytes after every call.

A program is a list of calls, each a tuple: ``("add", id, prompt, max_tokens)``,
``("step", budget)``, ``("finish", id)``, ``("store", event, worker)``, ``("load", event,
worker)``, ``("reset",)``, ``("reset_prefix_cache", reset_connector[,
reset_running_requests])``, ``("lookup", prompt)``, ``("stats",)`` (drained), ``("drain",)``
(every outstanding completion, loads first), and the injected faults ``("fail_store", event,
worker)`` (a worker's copy failed) and ``("corrupt", cpu_block, worker)`` (a cached host block
damaged)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from kvoffload.impl import OffloadImpl
from kvoffload.model import InvariantViolation, KVOffloadError, OffloadConfig, OffloadModel
from kvoffload.model.invariants import statement_of
from kvoffload.model.observed import Observation, judge
from kvoffload.model.snapshot import PoolView, Snapshot
from kvoffload.model.types import STORED, KVEvent
from kvoffload.model.variants import keeps_invariants
from kvoffload.testing.adapters import (
    HoldsBytes,
    Injectable,
    Target,
)
from kvoffload.testing.failure import MODEL_BROKE_WORDS, TARGET_BROKE_WORDS
from kvoffload.testing.targets import spec, variant_of
from kvoffload.testing.words import difference_words, in_words, name_of

Call = tuple[Any, ...]


def apply(target: OffloadModel | Target, call: Call) -> object:
    name, *args = call
    if name == "add":
        return target.add_request(*args)
    if name == "step":
        return target.step(*args)
    if name == "finish":
        return target.finish(*args)
    if name == "store":
        return target.complete_store(*args)
    if name == "fail_store":
        return injectable(target).fail_store(*args)
    if name == "corrupt":
        injectable(target).corrupt(*args)
        return None
    if name == "load":
        return target.complete_load(*args)
    if name == "reset":
        return target.reset()
    if name == "reset_prefix_cache":
        return target.reset_prefix_cache(*args)
    if name == "lookup":
        return target.lookup(*args)
    if name == "stats":
        return target.stats()
    if name == "drain":
        done: list[object] = [target.complete_load(e, w) for e, w in target.outstanding("load")]
        done += [target.complete_store(e, w) for e, w in target.outstanding("store")]
        return done
    raise ValueError(f"unknown call {name!r}")


def injectable(target: OffloadModel | Target) -> Injectable:
    """The target, if it takes injected faults (vLLM's scheduler side does not)."""
    if not isinstance(target, Injectable):
        raise ValueError(f"{type(target).__name__} takes no injected faults")
    return target


def as_outcome(error: BaseException) -> str:
    """An error as a call's outcome: ``"Type: message"``."""
    return f"{type(error).__name__}: {error}"


def outcome(target: OffloadModel | Target, call: Call) -> object:
    """The model's result of the call, or its error as ``"Type: message"``. A violated
    invariant of the model is not an outcome: it propagates, since the specification itself
    is then wrong; so does any error the model does not raise on purpose."""
    try:
        return apply(target, call)
    except InvariantViolation:
        raise
    except (KVOffloadError, ValueError, AssertionError) as error:
        return as_outcome(error)


def model_broke_at(broken: InvariantViolation, call: Call, n: int) -> str:
    """A broken invariant of the model at call ``n``, as every machine words it
    (:data:`~kvoffload.testing.failure.MODEL_BROKE_WORDS`: a verdict of its own)."""
    return f"{MODEL_BROKE_WORDS}{broken.invariant} at call {n} {call}: {broken.detail}"


def target_outcome(target: Target, call: Call) -> object:
    """The target's result of the call, or its error as ``"Type: message"``, whatever the
    error: an exception raised inside the target under test (an ``IndexError`` in vLLM, a
    ``KeyError`` of the implementation) is its answer to the call, compared with the model's
    like any other, so that a crash is a disagreement with a shrunk reproducer (issue 16)."""
    try:
        return apply(target, call)
    except Exception as error:
        return as_outcome(error)


@dataclass
class Agreed:
    """The snapshots of a (model, target) pair after the last call where they were equal, and
    what the target returned for it."""

    model: OffloadModel
    model_snapshot: Snapshot
    target_snapshot: Snapshot
    result: object = None


# Keyed by the target, so that a finished program's entry goes with it.
_AGREED: weakref.WeakKeyDictionary[object, Agreed] = weakref.WeakKeyDictionary()


def changes_nothing(call: Call, expected: object) -> bool:
    """Whether the specification says the call leaves the model's observable state as it
    was, given the model's outcome: rejected input (the driver contract: nothing changes), a
    lookup (read-only), damage injected into a block's bytes (no snapshot field shows it),
    a drain of the stats (it restarts a count no snapshot field shows), a drain with nothing
    owed. ``tests/test_lockstep_incremental.py`` holds it to the
    model's own snapshots, call after call."""
    name = call[0]
    return (
        isinstance(expected, str)  # an error, as "Type: message"; no result is a string
        or name in ("lookup", "corrupt", "stats")
        or (name == "drain" and expected == [])
    )


def agreement(model: OffloadModel, impl: Target) -> Agreed | None:
    """The pair's snapshots after the last call where they agreed, or None (none yet, or a
    target that takes no weak reference)."""
    try:
        found = _AGREED.get(impl)
    except TypeError:  # a target that takes no weak reference is compared in full
        return None
    return found if found is not None and found.model is model else None


class EventComparison(NamedTuple):
    """How the kv-cache events of one call compare: the difference described (None where
    they agree), the target's events in the order it published them (None if it gave none),
    and the events only the model, only the target published."""

    difference: str | None
    published: tuple[KVEvent, ...] | None
    only_model: tuple[KVEvent, ...] = ()
    only_target: tuple[KVEvent, ...] = ()


def compare_events(model: OffloadModel, impl: Target) -> EventComparison:
    """Drain the kv-cache events of both sides since the last call and compare them. One
    call's events are compared as a multiset: vLLM publishes a block's secondary keys in the
    order of a set."""
    mine = sorted(model.take_events(), key=KVEvent.sort_key)
    try:
        published = tuple(impl.take_events())
    except Exception as error:
        return EventComparison(
            f"the implementation's take_events() raised {as_outcome(error)}", None
        )
    theirs = sorted(published, key=KVEvent.sort_key)
    if mine == theirs:
        return EventComparison(None, published)
    only_mine = tuple(e for e in mine if e not in theirs)
    only_theirs = tuple(e for e in theirs if e not in mine)
    return EventComparison(
        f"kv events differ: only the model published {_events(only_mine)}, only the "
        f"implementation {_events(only_theirs)}",
        published,
        only_mine,
        only_theirs,
    )


def _events(events: Sequence[KVEvent], limit: int = 4) -> str:
    shown = [
        f"{e.kind} {e.key}"
        + (f" {list(e.token_ids)}/{e.block_size}" if e.kind == STORED else "")
        + (f" parent {e.parent[:6]}" if e.parent else "")
        for e in events[:limit]
    ]
    more = f" and {len(events) - limit} more" if len(events) > limit else ""
    return "[" + ", ".join(shown) + "]" + more if events else "nothing"


def compare(
    model: OffloadModel, impl: Target, call: Call, n: int, incremental: bool = True
) -> str | None:
    """Apply ``call`` to both; describe the first difference, or None.

    ``incremental`` (the default) compares only what the call can have changed, with the
    same verdict as the full comparison (``incremental=False``): the model's snapshot is
    taken again unless :func:`changes_nothing` says the call left it as it was; the two
    snapshots are compared unless both are the very objects last found equal (the
    implementation's snapshot is the same object while nothing it shows changes); the KV
    bytes are checked unless nothing the check reads changed (``data_mismatches``).

    A difference found is given its class (issue 34): where the target's own snapshot breaks
    an observable form of an invariant (:mod:`kvoffload.model.observed`), the difference is
    reported as ``the target breaks ID`` (:func:`target_broke_at`), a bug; otherwise as it is,
    a change with every invariant holding. Only a difference is judged, so a conforming run
    pays nothing for it."""
    # (the store events some worker reported failed: their copies are dropped, not
    # registered; copied only when there are any)
    failed = model.engine.connector.failed_store_events
    failed_before = frozenset(failed) if failed else frozenset()
    try:
        expected = outcome(model, call)
    except InvariantViolation as broken:
        # The specification itself is wrong on this program: a verdict of its own (exit
        # status 3), found, shrunk and saved like a difference (issue 35); the target is not
        # asked, since there is nothing right to compare it with.
        return model_broke_at(broken, call, n)
    actual = target_outcome(impl, call)
    # (the snapshots after the previous call, where they agreed: also the state before this
    # call, for the verdict's transition forms; reused for speed only when incremental)
    agreed = agreement(model, impl)
    events = compare_events(model, impl)
    published = events.published
    found, snapshots, wrong = _difference(
        model, impl, call, n, incremental, expected, actual, events.difference, agreed
    )
    if found is None:
        return None
    # The difference in words (issue 34), after its raw text: what a reviewer reads first.
    mine, theirs = snapshots if snapshots is not None else (None, None)
    only = (events.only_model, events.only_target) if events.difference else None
    name = name_of(impl)
    said = difference_words(expected, actual, mine, theirs, only, name)
    found += in_words(said + [f"in {name}, {w}" for w in wrong])
    if wrong:
        return bytes_broken(wrong, call, n, found)
    if mine is None or theirs is None:
        return found
    if call[0] == "fail_store":
        failed_before |= {call[1]}
    before = agreed.target_snapshot if agreed is not None else None
    judged = Observation(model.config, theirs, before, call, failed_before, actual, published)
    return classified(model, found, judged, mine, expected, n)


def classified(
    model: OffloadModel,
    found: str,
    target: Observation,
    mine: Snapshot,
    expected: object,
    n: int,
    forms: Collection[str] | None = None,
) -> str:
    """A difference ``found`` at call ``n`` given its class (issue 34): where the target's
    own state (``target``: its snapshot after the call, before it, the call and its result)
    breaks an observable form of an invariant (of ``forms`` where given), ``the target
    breaks ID``, a bug; otherwise ``found`` as it is, a change with every invariant
    holding. Both machines' locksteps judge their differences here."""
    breaks = judge(target, forms)
    if breaks and not keeps_invariants(model.variant):
        # A variant that models other bugs breaks invariants of its own: an invariant it
        # breaks on this call too is that modelled bug's, not this difference's (the
        # history's isolations).
        modelled = {
            v.invariant
            for v in judge(replace(target, after=mine, result=expected, events=None), forms)
        }
        breaks = [v for v in breaks if v.invariant not in modelled]
    return found if not breaks else target_broke_at(breaks[0], target.call or (), n, found)


def bytes_broken(wrong: Sequence[str], call: Call, n: int, found: str) -> str:
    """Wrong KV bytes (``wrong``, each in words, the first named) as a verdict: a bug
    whatever the model decided, the byte check judging the target's own blocks against each
    key's content (issue 34), the contract KV-BYTES broken."""
    more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
    return target_broke_at(InvariantViolation("KV-BYTES", wrong[0] + more), call, n, found)


def target_broke_at(broken: InvariantViolation, call: Call, n: int, found: str) -> str:
    """A difference where the target's own state breaks an invariant of the spec (a bug):
    the invariant, its statement, what breaks it, then how the target differs from the
    model (:data:`~kvoffload.testing.failure.TARGET_BROKE_WORDS`: a verdict of its own)."""
    statement = statement_of(broken.invariant)
    return (
        f"{TARGET_BROKE_WORDS}{broken.invariant} at call {n} {call}: {broken.detail} "
        f"({broken.invariant}: {statement}). It differs from the model: {found}"
    )


def _difference(
    model: OffloadModel,
    impl: Target,
    call: Call,
    n: int,
    incremental: bool,
    expected: object,
    actual: object,
    events: str | None,
    agreed: Agreed | None,
) -> tuple[str | None, tuple[Snapshot, Snapshot] | None, list[str]]:
    """How the target differs from the model after ``call`` (``events``: how their kv
    events of the call differ), or None; with the model's and the target's snapshots, when
    the target gave one, and the blocks whose bytes are wrong, when that is the difference."""
    results = None
    if expected != actual:
        results = f"call {n} {call}: model returned {expected!r}, implementation {actual!r}"
    if events is not None:
        results = f"{results or f'call {n} {call}'}; {events}"
    reuse = incremental and agreed is not None and changes_nothing(call, expected)
    mine = agreed.model_snapshot if agreed is not None and reuse else model.snapshot()
    try:
        theirs = impl.snapshot()
    except Exception as error:
        return (
            (results or f"call {n} {call}")
            + (f": the implementation's snapshot raised {as_outcome(error)}"),
            None,
            [],
        )
    unchanged = incremental and agreed is not None and unchanged_since(agreed, mine, theirs)
    if unchanged or mine == theirs:
        with contextlib.suppress(TypeError):  # a target that takes no weak reference
            _AGREED[impl] = Agreed(model, mine, theirs, actual)
    elif mine != theirs:
        fields = [f for f in mine.__dataclass_fields__ if getattr(mine, f) != getattr(theirs, f)]
        details = "; ".join(
            describe_difference(f, getattr(mine, f), getattr(theirs, f)) for f in fields
        )
        # With the results, what the state says: the cause is often there (a pin missing)
        # while the result shows only its effect (a request scheduled otherwise).
        head = f"{results}; snapshots" if results else f"call {n} {call}: snapshots"
        return f"{head} differ in {fields}: {details}", (mine, theirs), []
    if results:
        return results, (mine, theirs), []
    try:
        wrong = wrong_bytes(model, impl, incremental)
    except Exception as error:
        return (
            f"call {n} {call}: the implementation's data check raised {as_outcome(error)}",
            (mine, theirs),
            [],
        )
    if wrong:
        return f"call {n} {call}: {wrong[0]}", (mine, theirs), wrong
    return None, (mine, theirs), []


def unchanged_since(agreed: Agreed, mine: Snapshot, theirs: Snapshot) -> bool:
    """Whether both snapshots are the very objects last found equal: then they are equal
    still, whatever the call was (the model's is reused only where the call changes
    nothing, the target's is the same object only while nothing it shows changed)."""
    return mine is agreed.model_snapshot and theirs is agreed.target_snapshot


def wrong_bytes(model: OffloadModel, impl: Target, incremental: bool) -> list[str]:
    """The blocks whose KV bytes are not the model's content for their keys (the
    implementation's own check; incremental: only where something it reads changed). A
    target without KV bytes (vLLM's scheduler side) is compared on its state alone."""
    if not isinstance(impl, HoldsBytes):
        return []
    # A block damaged on purpose holds the wrong bytes until a lookup finds it out.
    exempt = frozenset(model.engine.connector.cpu_pool.damaged)
    return (impl.data_mismatches if incremental else impl.check_data)(exempt)


def describe_difference(name: str, expected: object, actual: object, limit: int = 3) -> str:
    """What differs in one snapshot field, model first: for a pool, the blocks and the keys
    that differ; for anything else, both values."""
    if isinstance(expected, PoolView) and isinstance(actual, PoolView):
        parts = [
            f"block {a.block_id} is {b} in the model, {a} in the implementation"
            for b, a in zip(expected.blocks, actual.blocks, strict=True)
            if a != b
        ][:limit]
        mine, theirs = dict(expected.cached), dict(actual.cached)
        parts += [
            f"key {key} maps to {mine.get(key, ())} in the model, {theirs.get(key, ())} in the "
            "implementation"
            for key in sorted(mine.keys() | theirs.keys())
            if mine.get(key) != theirs.get(key)
        ][:limit]
        if expected.free_queue != actual.free_queue:
            parts.append(
                f"free queue {expected.free_queue} in the model, {actual.free_queue} in the "
                "implementation"
            )
        return f"{name}: " + ", ".join(parts)
    return f"{name}: {expected} in the model, {actual} in the implementation"


def first_disagreement(
    config: OffloadConfig,
    program: Sequence[Call],
    faults: Sequence[str] = (),
    device: str | None = None,
    adapter: str | None = None,
    variant: str | None = None,
    lockstep: bool = True,
) -> str | None:
    """None when the implementation conforms on ``program``; else what differed first.
    ``adapter`` names another target (:mod:`kvoffload.testing.targets`), compared with
    ``variant`` of the model (default: the variant it is expected to match). The
    implementation runs in lockstep mode unless ``lockstep`` is False (copies on a thread)."""
    factory: Callable[[OffloadConfig], Target] = (
        spec(adapter).build
        if adapter is not None
        else lambda c: OffloadImpl(c, faults=faults, device=device, lockstep=lockstep)
    )
    return disagreement(factory, variant_of(adapter or "impl", variant), config, program)


def disagreement(
    factory: Callable[[OffloadConfig], Target],
    variant: str,
    config: OffloadConfig,
    program: Sequence[Call],
) -> str | None:
    """Drive ``program`` on a target built by ``factory`` and on ``variant`` of the model;
    the first difference, or None. The target is closed afterwards."""
    model = OffloadModel(config, variant=variant, check=keeps_invariants(variant))
    impl = factory(config)
    try:
        for n, call in enumerate(program):
            found = compare(model, impl, call, n)
            if found:
                return found
        return None
    finally:
        close = getattr(impl, "close", None)
        if close is not None:
            close()
