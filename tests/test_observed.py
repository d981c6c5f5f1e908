"""The invariants judged on a target's own state (issue 34): each observable form holds on
every snapshot of the model (sound), fails on a corrupted one (it can fail), and a target
whose state breaks one is reported as ``breaks ID``, a mere change as a difference."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from test_invariants import busy
from test_upstream_history import COUNTEREXAMPLES

from kvoffload.model import OffloadConfig, OffloadModel
from kvoffload.model.invariants import REGISTRY
from kvoffload.model.observed import OBSERVED, Observation, judge, observed
from kvoffload.model.snapshot import Snapshot
from kvoffload.model.types import REMOVED, STORED, KVEvent
from kvoffload.testing import profiles
from kvoffload.testing.campaign import report, run_campaign
from kvoffload.testing.failure import BREAKS, DIFFERS, target_broke, verdict_of
from kvoffload.testing.lockstep import Call, first_disagreement, outcome, target_outcome
from kvoffload.testing.machine import Recorder
from kvoffload.testing.scheduler_lockstep import model_call, model_snapshot
from kvoffload.testing.scheduler_machine import scheduler_machine
from kvoffload.testing.stateful import machine_for

from helpers import make, prompt


class _Judged:
    """Every call's model snapshot judged by the observable forms."""

    broken: ClassVar[list[str]] = []
    judged: ClassVar[list[int]] = [0]
    events: ClassVar[list[int]] = [0]

    model: Any
    target: Any
    config: Any

    def check(self, call: Call, n: int) -> str | None:
        before = self.model.snapshot()
        failed = frozenset(self.model.engine.connector.failed_store_events)
        result = outcome(self.model, call)
        events = tuple(self.model.take_events())
        target_outcome(self.target, call)  # (kept in step; its state is not compared here)
        if call[0] == "fail_store":
            failed |= {call[1]}
        after = self.model.snapshot()
        found = judge(Observation(self.config, after, before, call, failed, result, events))
        type(self).events[0] += len(events)
        type(self).judged[0] += 1
        if found:
            type(self).broken.append(f"{found[0]} after call {n} {call}")
            return f"the model's own snapshot breaks {found[0]}"
        return None


@pytest.mark.parametrize("variant", [None, "inclusive-cpu+reset-releases-hits"])
def test_every_form_holds_on_every_snapshot_of_the_model(variant: str | None) -> None:
    """Soundness: a form that fails where the model is right would call a conforming target
    buggy. 400 derandomized programs of the ci stream, every layout it draws."""

    class Judging(_Judged, machine_for("impl", variant=variant)):  # type: ignore[misc]
        broken: ClassVar[list[str]] = []
        judged: ClassVar[list[int]] = [0]
        events: ClassVar[list[int]] = [0]

    run_state_machine_as_test(Judging, settings=settings(profiles.get("ci"), max_examples=400))
    assert Judging.broken == [] and Judging.judged[0] > 4000
    assert Judging.events[0] > 200  # the event forms were judged on events


def test_every_form_holds_on_every_snapshot_of_the_scheduler_machine_s_model() -> None:
    """Soundness on the scheduler machine (vLLM's own ``Scheduler`` as the target): its calls
    are not the offload machine's (a step reports the workers' completions in its own
    output, an abort finishes from outside, finished requests leave the snapshot), and the
    verdict judges vLLM's scheduler's state with the same forms. 150 derandomized programs
    of its ci stream, the model alone."""
    broken: list[str] = []
    judged = [0]

    class Judging(scheduler_machine("fixed", Recorder(), vllm=False)):  # type: ignore[misc]
        def check(self, call: Call, n: int) -> str | None:
            before = model_snapshot(self.model)
            result = model_call(self.model, call)
            after = model_snapshot(self.model)
            found = judge(Observation(self.config, after, before, call, frozenset(), result))
            judged[0] += 1
            if found:
                broken.append(f"{found[0]} after call {n} {call}")
                return f"the model's own snapshot breaks {found[0]}"
            return None

    run_state_machine_as_test(Judging, settings=settings(profiles.get("ci"), max_examples=150))
    assert broken == [] and judged[0] > 2000, (broken[:3], judged)


def test_every_form_is_registered_under_an_invariant_once() -> None:
    assert set(OBSERVED) <= set(REGISTRY) and len(OBSERVED) >= 15
    with pytest.raises(ValueError, match="no invariant of the registry"):
        observed("NOT-AN-INVARIANT")(lambda o: iter(()))
    with pytest.raises(ValueError, match="registered twice"):
        observed("POOL-QUEUE")(lambda o: iter(()))


def _busy() -> tuple[Snapshot, Any]:
    model = busy()
    return model.snapshot(), model.config


def _pool(s: Snapshot, name: str, **fields: Any) -> Snapshot:
    return replace(s, **{name: getattr(s, name)._replace(**fields)})


def _block(s: Snapshot, name: str, block_id: int, **fields: Any) -> Snapshot:
    pool = getattr(s, name)
    blocks = list(pool.blocks)
    blocks[block_id] = blocks[block_id]._replace(**fields)
    return _pool(s, name, blocks=tuple(blocks))


def _free_keyed(s: Snapshot) -> int:
    return next(b.block_id for b in s.cpu.blocks[1:] if b.ref_cnt == 0 and b.primary)


def _registered_missing(s: Snapshot) -> tuple[Snapshot, Snapshot]:
    """A store that completed between two snapshots without its keys on the CPU block."""
    store = s.store_events[0]
    after = replace(s, store_events=s.store_events[1:])
    for cpu_id in store.cpu_block_ids:
        after = _block(after, "cpu", cpu_id, primary=None, primary_tokens=None, secondary=())
    return s, after


def _fresh_stamped(s: Snapshot) -> tuple[Snapshot, Snapshot]:
    before = replace(s, store_events=(), pending_flushes=())
    cpu_id = s.store_events[0].cpu_block_ids[0]
    key = s.gpu.blocks[s.store_events[0].gpu_block_ids[0]].primary
    return before, _block(s, "cpu", cpu_id, primary=key)


def _flush_missing(_: Snapshot) -> tuple[Snapshot, Snapshot, Call, object]:
    """A real finishing step (d's), in the model of vLLM #53498's second bug: no final
    flush, so d's blocks go back to the GPU pool with nothing queued."""
    model = OffloadModel(make(gpu_blocks=10, cpu_blocks=16).config, variant="no-final-flush")
    model.add_request("d", prompt(33, 8), max_tokens=1)
    before = model.snapshot()
    result = model.step(64)
    return before, model.snapshot(), ("step", 64), result


def _unsent(s: Snapshot) -> Snapshot:
    """``s`` before the step that sent its first store event."""
    return replace(s, store_events=s.store_events[1:])


def _held_key(s: Snapshot) -> Any:
    return s.cpu.cached[0][0]


# Each form's corruption: (before, after, call, result[, the call's kv events]) from a busy
# snapshot.
Corruption = Callable[[Snapshot], tuple[Any, ...]]
CORRUPT: dict[str, Corruption] = {
    "POOL-QUEUE": lambda s: (None, _pool(s, "cpu", free_queue=s.cpu.free_queue * 2), None, None),
    "POOL-MAP": lambda s: (
        None,
        _pool(s, "cpu", cached=((s.cpu.cached[0][0], (_free_keyed(s), 0)), *s.cpu.cached[1:])),
        None,
        None,
    ),
    "POOL-PRIMARY": lambda s: (
        None,
        _pool(
            s,
            "cpu",
            cached=tuple((k, ()) if _free_keyed(s) in ids else (k, ids) for k, ids in s.cpu.cached),
        ),
        None,
        None,
    ),
    "POOL-NULL": lambda s: (None, _block(s, "gpu", 0, primary=s.gpu.cached[0][0]), None, None),
    "POOL-FRESH": lambda s: (*_fresh_stamped(s), ("step", 8), None),
    "REF-GPU": lambda s: (
        None,
        _block(s, "gpu", s.store_events[0].gpu_block_ids[0], ref_cnt=9),
        None,
        None,
    ),
    "REF-CPU": lambda s: (
        None,
        _block(s, "cpu", s.store_events[0].cpu_block_ids[0], ref_cnt=9),
        None,
        None,
    ),
    # a step that sends again a store already in flight
    "SKIP": lambda s: (_unsent(s), s, ("step", 8), None),
    "UNREACHABLE": lambda s: (
        None,
        _pool(
            s,
            "cpu",
            cached=(
                (s.cpu.cached[0][0], (*s.cpu.cached[0][1], s.store_events[0].cpu_block_ids[0])),
                *s.cpu.cached[1:],
            ),
        ),
        None,
        None,
    ),
    "REGISTERED": lambda s: (*_registered_missing(s), ("store", s.store_events[0].event, 0), True),
    "PENDING": lambda s: (None, replace(s, has_pending_stores=False), None, None),
    "IN-FLIGHT": lambda s: (None, replace(s, in_flight_gpu_blocks=()), None, None),
    "RESET": lambda s: (None, s, ("reset_prefix_cache", True), True),
    "EVENTS": lambda s: (None, replace(s, store_event_counter=0), None, None),
    "FLUSH-COMPLETE": _flush_missing,
    # a step that sent a store while no scan advanced (the stale window block of 0.34.0)
    "POSITION": lambda s: (_unsent(s), s, ("step", 8), None),
    # an event whose tokens are another position's (vLLM 0.34.0's reused window block), and
    # one for a key the CPU does not hold
    "EVENT-STORED": lambda s: (
        None,
        s,
        None,
        None,
        (
            KVEvent(STORED, _held_key(s), None, (9, 9, 9, 9), 4),
            KVEvent(STORED, _held_key(s)._replace(num_tokens=999)),
        ),
    ),
    # a key dropped from the tier's events though the map keeps it
    "EVENT-STREAM": lambda s: (s, s, ("step", 8), None, (KVEvent(REMOVED, _held_key(s)),)),
    "LOAD-PINNED": lambda s: (
        None,
        _block(
            s,
            "cpu",
            s.loads[0].transfer.cpu_block_ids[0],
            primary=None,
            primary_tokens=None,
            secondary=(),
        ),
        None,
        None,
    ),
}


def test_every_form_has_a_corruption() -> None:
    assert set(CORRUPT) == set(OBSERVED)


@pytest.mark.parametrize("invariant", sorted(OBSERVED))
def test_a_corrupted_snapshot_breaks_the_form(invariant: str) -> None:
    snapshot, config = _busy()
    assert judge(Observation(config, snapshot, snapshot, ("stats",))) == []
    before, after, call, result, *events = CORRUPT[invariant](snapshot)
    config = replace(config, kv_events=True)
    found = {
        v.invariant
        for v in judge(Observation(config, after, before, call, frozenset(), result, *events))
    }
    assert invariant in found, found


@pytest.mark.parametrize(
    ("fault", "invariant"),
    [
        ("pin-dropped-early", "REF-GPU"),
        ("phantom-primary", "POOL-FRESH"),
        ("pending-ignores-flush", "PENDING"),
        ("no-final-flush", "FLUSH-COMPLETE"),
    ],
)
def test_a_fault_that_breaks_an_invariant_is_reported_as_breaking_it(
    fault: str, invariant: str
) -> None:
    """The verdict's class, kept through shrinking and reduction: the failure found, shrunk
    and saved still says the target breaks the invariant."""
    result = run_campaign(f"fault:{fault}", settings(profiles.get("ci"), max_examples=200))
    assert result.failure is not None
    found = result.failure["disagreement"]
    assert verdict_of(found) == BREAKS and target_broke(found) == invariant, found
    assert f"({invariant}: {REGISTRY[invariant].statement})" in found
    assert "It differs from the model: call " in found
    assert result.verdict_class == f"breaks {invariant}"
    assert report(result, "ci", None, 1)["class"] == f"breaks {invariant}"


def test_a_change_vllm_meant_is_a_difference_with_every_invariant_holding() -> None:
    """The implementation (the fixed model's behaviour) against a model of another intended
    behaviour: they differ, and nothing in the implementation's state breaks the spec."""
    # S25's counterexample: a GPU hit on a prefix the CPU holds too refreshes its CPU copy in
    # the CPU's LRU under 0.34.0's inclusive eager mode, and does not in the fixed model
    fields, program = COUNTEREXAMPLES["S25"]
    config = OffloadConfig(*fields)
    found = first_disagreement(config, program, variant="inclusive-cpu")
    assert found is not None and verdict_of(found) == DIFFERS, found
    assert "free queue" in found
