"""The scheduler machine's lockstep: a call of :mod:`kvoffload.vllm_target.scheduler` on the
model and on vLLM's own ``Scheduler``, compared on its result, the snapshot and the kv-cache
events (:func:`compare_call`), and a program replayed on both (:func:`first_difference`).

The model's side of each call (:func:`model_call`) is the model engine admitting as vLLM
0.34.0's scheduler does (:func:`scheduling`); finished requests are gone from vLLM's
scheduler, so the model's snapshot is compared without them (:func:`model_snapshot`). Beside
vLLM's own workers (the worker machine), transfers complete in issue order per worker
(:func:`model_step`), and the workers' KV bytes are checked after every call (KV-BYTES).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

from kvoffload.model import OffloadModel
from kvoffload.model.config import OffloadConfig
from kvoffload.model.engine import VLLM_SCHEDULING, RequestStatus, Scheduling
from kvoffload.model.errors import InvalidArgumentError, InvariantViolation
from kvoffload.model.observed import Observation
from kvoffload.model.snapshot import Snapshot
from kvoffload.model.types import ConnectorMetadata, KVEvent
from kvoffload.model.variants import keeps_invariants
from kvoffload.testing.lockstep import (
    Call,
    as_outcome,
    bytes_broken,
    classified,
    describe_difference,
    model_broke_at,
)
from kvoffload.testing.targets import spec
from kvoffload.testing.words import (
    difference_words,
    event_words,
    in_words,
    metadata_words,
    result_words,
)
from kvoffload.vllm_target.scheduler import CALLS, StepView, VllmScheduler, picked
from kvoffload.vllm_target.worker import WorkerLayout, completes_at_once

TARGET = "vLLM's scheduler"  # how a difference in words names the target
EVENT_FORMS = frozenset({"EVENT-STREAM"})  # the forms that judge a step's published events
# vLLM's scheduler's snapshot after the last call where it agreed with the model: the state
# before the next call, for the verdict's transition forms (keyed by the target, so that a
# finished program's entry goes with it).
_AGREED: weakref.WeakKeyDictionary[VllmScheduler, Snapshot] = weakref.WeakKeyDictionary()
# With kv-cache events: vLLM's scheduler's snapshot when it last published them (after the
# last step, or before the first call), from which the events of the next step are read
# (EVENT-STREAM).
_PUBLISHED: weakref.WeakKeyDictionary[VllmScheduler, Snapshot] = weakref.WeakKeyDictionary()


def model_step(
    model: OffloadModel,
    token_budget: int,
    report: bool = True,
    picks: Sequence[int] = (),
    in_order: bool = False,
) -> StepView:
    """The model's step, and with ``report`` every completion owed reported by every
    worker, else the reports ``picks`` chooses, seen as :meth:`VllmScheduler.step` shows
    vLLM's. ``in_order`` (vLLM's own workers, issue 33): a worker's transfers of a kind
    complete in the order they were issued, so a report picked brings every earlier one
    (:func:`~kvoffload.vllm_target.scheduler.picked`), and a step whose output preempts a
    request (one the step preempted, or a reset since the last step) has every worker
    finish the transfers issued before it first (vLLM's ``need_flush``: the preempted
    blocks may be reused at once)."""
    before = {kind: model.outstanding(kind) for kind in ("load", "store")} if in_order else None
    preempting = bool(model.engine.reset_preempted)
    result = model.step(token_budget)
    if report:
        model.complete_all()
    elif picks or before is not None:
        loads = sorted({event for event, _ in model.outstanding("load")})
        chosen = picked(loads, model.outstanding("store"), picks, in_order)
        if before is not None and (preempting or result.preempted):
            chosen = (
                sorted(set(chosen[0]) | {event for event, _ in before["load"]}),
                sorted(set(chosen[1]) | set(before["store"])),
            )
        if chosen[0] or chosen[1]:
            model._report(*chosen)
    meta = result.metadata
    return (
        {rid: end - start for rid, (start, end) in result.scheduled.items()},
        meta.store_event,
        meta.store_gpu_blocks,
        meta.store_cpu_blocks,
        meta.load_event,
        meta.load_gpu_blocks,
        meta.load_cpu_blocks,
    )


def model_call(model: OffloadModel, call: Call, workers: WorkerLayout | None = None) -> object:
    """``call`` on the model; its result as :func:`vllm_call` gives vLLM's. Beside vLLM's own
    ``workers``, transfers complete in issue order per worker (:func:`model_step`), and with
    the disk backend every transfer completes in the step that issues it (its IO threads
    wait for their copies and write the files before the worker polls)."""
    name, *args = call
    if name == "add":
        model.add_request(*args)
        return None
    if name == "step":
        budget, report, *picks = args
        report = report or completes_at_once(workers)
        return model_step(
            model, budget, report, picks[0] if picks else (), in_order=workers is not None
        )
    if name == "abort":
        model.finish(args[0])
        return None
    return model.reset_prefix_cache(*args)


def vllm_call(target: VllmScheduler, call: Call) -> object:
    name, *args = call
    if name == "add":
        target.add_request(*args)
        return None
    if name == "step":
        return target.step(*args)
    if name == "abort":
        target.abort(args[0])
        return None
    return target.reset_prefix_cache(*args)


def model_snapshot(model: OffloadModel) -> Snapshot:
    """The model's snapshot as the scheduler target shows one: finished requests are gone
    from vLLM's scheduler, but for those whose blocks it keeps (a load still owed)."""
    snap = model.snapshot()
    live = tuple(
        r for r in snap.requests if r.status != RequestStatus.FINISHED.value or any(r.block_ids)
    )
    return Snapshot(**{**snap.__dict__, "requests": live})


def scheduling(whole_sequence: bool) -> Scheduling:
    """The model's scheduling for vLLM 0.34.0's scheduler with ``scheduler_reserve_full_isl``
    as ``whole_sequence`` says (the rest of :data:`VLLM_SCHEDULING` always on)."""
    return replace(VLLM_SCHEDULING, whole_sequence=whole_sequence)


def step_words(expected: object, actual: object) -> list[str]:
    """How two results of a call differ, in words; a step's (:data:`StepView`) by the tokens
    it scheduled per request and the transfers it sent."""
    views = (expected, actual)
    if not all(isinstance(v, tuple) and len(v) == 7 and isinstance(v[0], dict) for v in views):
        return result_words(expected, actual, TARGET)
    mine, theirs = cast(tuple[StepView, StepView], views)
    said = [
        f"the step computes {mine[0].get(rid, 0)} token(s) of {rid} in the model, "
        f"{theirs[0].get(rid, 0)} in {TARGET}"
        for rid in sorted(mine[0].keys() | theirs[0].keys())
        if mine[0].get(rid) != theirs[0].get(rid)
    ]
    # (a step view's transfers are the connector metadata's fields, in their order)
    return said + metadata_words(
        ConnectorMetadata(*mine[1:]), ConnectorMetadata(*theirs[1:]), TARGET
    )


def require_call(call: Call) -> None:
    if not call or call[0] not in CALLS:
        raise InvalidArgumentError(f"the scheduler target takes calls {CALLS}, got {call}")


def compare_call(
    model: OffloadModel,
    target: VllmScheduler,
    call: Call,
    n: int,
    model_events: list[KVEvent] | None = None,
) -> str | None:
    """Apply ``call`` to both and describe the first difference, or None. With kv-cache
    events, ``model_events`` holds the model's since the last step: vLLM's scheduler
    publishes the connector's once a step, so they are compared at each step."""
    require_call(call)
    if model.config.kv_events and target not in _PUBLISHED:
        _PUBLISHED[target] = target.snapshot()  # (nothing published yet)
    try:
        layout = None if target.workers is None else target.workers.layout
        expected: object = model_call(model, call, layout)
    except InvariantViolation as broken:
        # the specification itself is wrong on this program (as lockstep.compare says it)
        return model_broke_at(broken, call, n)
    except Exception as error:
        expected = as_outcome(error)
    try:
        actual: object = vllm_call(target, call)
    except Exception as error:
        actual = as_outcome(error)
    head = f"call {n} {call}"
    results = step_words(expected, actual) if expected != actual else []
    returned = f"{head}: the model returned {expected!r}, vLLM's scheduler {actual!r}"
    mine = model_snapshot(model)
    try:
        theirs = target.snapshot()
    except Exception as error:
        raised = f"{head}: vLLM's scheduler's snapshot raised {as_outcome(error)}"
        return (returned if results else raised) + in_words(results)
    before = _AGREED.get(target)
    # vLLM's own workers (issue 33): the KV their forwards read and every cached block's bytes
    wrong = target.data_mismatches(theirs)
    if results:
        found = returned
    elif mine != theirs:
        fields = [f for f in mine.__dataclass_fields__ if getattr(mine, f) != getattr(theirs, f)]
        details = "; ".join(
            describe_difference(f, getattr(mine, f), getattr(theirs, f)) for f in fields
        )
        found = f"{head}: snapshots differ in {fields}: {details}"
    elif wrong:
        found = f"{head}: the KV bytes differ: {wrong[0]}"
    else:
        _AGREED[target] = theirs
        return _compare_events(model, target, call, n, theirs, model_events)
    found += in_words(
        results
        + difference_words(None, None, mine, theirs, None, TARGET)
        + [f"in {TARGET}'s workers, {w}" for w in wrong[:1]]
    )
    if wrong:
        return bytes_broken(wrong, call, n, found)  # (the workers' blocks and forwards)
    # The class of the difference (issue 34), judged on vLLM's scheduler's own state. Its kv
    # events are judged only where the snapshots agree (_compare_events): vLLM publishes
    # those of the calls between two steps at the second, so no call's events go with its
    # snapshots, and a step's go with the snapshots since the step before.
    judged = Observation(model.config, theirs, before, call, frozenset(), actual)
    return classified(model, found, judged, mine, expected, n)


def _compare_events(
    model: OffloadModel,
    target: VllmScheduler,
    call: Call,
    n: int,
    theirs: Snapshot,
    pending: list[KVEvent] | None,
) -> str | None:
    """At a step, the kv-cache events vLLM's scheduler published in it (those of the calls
    since the step before) against the model's of the same calls; a difference classed by
    EVENT-STREAM, read from vLLM's snapshot when it last published to its snapshot now."""
    if pending is None or not model.config.kv_events:
        return None
    pending += model.take_events()
    if call[0] != "step":
        return None
    mine, published = list(pending), target.take_events()
    pending.clear()
    since = _PUBLISHED[target]
    _PUBLISHED[target] = theirs
    if mine == published:
        return None
    found = (
        f"call {n} {call}: kv-cache events differ: the model published {mine}, vLLM's "
        f"scheduler {published}" + in_words(event_words(mine, published, TARGET))
    )
    judged = Observation(model.config, theirs, since, call, events=tuple(published))
    return classified(model, found, judged, model_snapshot(model), None, n, EVENT_FORMS)


def invariant_broken(
    model: OffloadModel, call: Call, n: int, workers: WorkerLayout | None = None
) -> str | None:
    """Call ``n`` on the model alone: the invariant it breaks, or None."""
    require_call(call)
    try:
        model_call(model, call, workers)
    except InvariantViolation as broken:
        return model_broke_at(broken, call, n)
    return None


def first_difference(
    config: OffloadConfig,
    program: Sequence[Call],
    variant: str | None = None,
    whole_sequence_admission: bool = True,
    vllm: bool = True,
    workers: WorkerLayout | None = None,
) -> str | None:
    """Run ``program`` on vLLM's scheduler and on ``variant`` of the model (default: the
    running release's, as the release table names it), both admitting as
    ``whole_sequence_admission`` says (``model_admission`` of the model may differ: see
    :func:`first_difference_between`); the first difference, or None. Without ``vllm``,
    the model alone with every invariant checked: the first it breaks, or None. With
    ``workers``, vLLM's own worker on every rank, its KV laid out as they say."""
    if not vllm:
        for call in program:
            require_call(call)
        compared_with = variant or "fixed"
        model = OffloadModel(
            config,
            variant=compared_with,
            check=True,
            scheduling=scheduling(whole_sequence_admission),
        )
        for n, call in enumerate(program):
            found = invariant_broken(model, call, n, workers)
            if found:
                return found
        return None
    return first_difference_between(
        config, program, variant, whole_sequence_admission, whole_sequence_admission, workers
    )


def first_difference_between(
    config: OffloadConfig,
    program: Sequence[Call],
    variant: str | None,
    vllm_admission: bool,
    model_admission: bool,
    workers: WorkerLayout | None = None,
) -> str | None:
    """:func:`first_difference` with vLLM's admission and the model's set apart."""
    for call in program:
        require_call(call)
    target = VllmScheduler(config, vllm_admission, workers)
    compared_with = variant or spec("vllm").variant()
    model = OffloadModel(
        config,
        variant=compared_with,
        check=keeps_invariants(compared_with),
        scheduling=scheduling(model_admission),
    )
    events: list[KVEvent] = []
    try:
        for n, call in enumerate(program):
            found = compare_call(model, target, call, n, events)
            if found:
                return found
        return None
    finally:
        target.close()
