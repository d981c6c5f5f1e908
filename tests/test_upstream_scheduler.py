"""vLLM 0.34.0's own ``Scheduler`` (with the SimpleCPUOffload connector its factory builds)
against the model, call by call: the tokens each step schedules, the connector metadata it
sends, and the snapshot of both pools, the offload manager and the live requests
(``kvoffload.vllm_target.scheduler``; docs/upstream.md). The programs run where vLLM 0.34.0 is
installed, in its release environment."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from test_scheduling import FULL_SEQUENCE, HOLDERS, PREEMPTED_LOAD, RESERVED, WEIGHT_UPDATE

from kvoffload.main import main
from kvoffload.model import OffloadConfig
from kvoffload.model.errors import InvalidArgumentError
from kvoffload.testing.failure import load
from kvoffload.testing.scheduler_lockstep import first_difference
from kvoffload.vllm_target.scheduler import VllmScheduler

from helpers import found_in_release

VARIANT = "inclusive-cpu+window-stale-ids+reset-gpu-only"  # 0.34.0's row

# A request decoding while a second one hits the first one's blocks on the GPU and a third
# is admitted beside them; every step agrees.
SHARED = [
    ("add", "a", [0, 1, 2, 3, 4, 5, 6, 0], 3),
    ("add", "b", [0, 1, 2, 3, 4, 5, 6, 0, 2, 2], 2),
    ("add", "c", [1, 1, 1, 1, 1], 2),
    *[("step", 5, True)] * 8,
]
# A prompt stored, the GPU pool then filled by another one, the prompt again: its hit comes
# from the CPU and loads; the load's report held back a step.
CPU_HIT = [
    ("add", "a", [0, 1, 2, 3, 4, 5, 6, 0, 1], 1),
    *[("step", 8, True)] * 3,
    ("add", "f", [3] * 19, 1),
    *[("step", 8, True)] * 4,
    ("add", "b", [0, 1, 2, 3, 4, 5, 6, 0, 1, 2], 1),
    ("step", 8, False),
    *[("step", 8, True)] * 3,
]
# (configuration, program, vLLM's whole-sequence admission, the model's, the difference
# expected: None where the model admits as vLLM does)
RESET_PREEMPTS_A_STORE = [
    ("add", "r0", [0, 1, 2, 3], 2),
    ("step", 32, True),
    ("step", 32, True),
    ("reset_prefix_cache", False),
    ("add", "r1", [0, 1, 2, 3], 1),
    ("step", 1, False),
    ("reset_prefix_cache", False, True),
    ("step", 32, True),
    ("step", 32, True),
]
ABORTED_LOADS = [
    ("add", "r0", [0, 1, 2, 3, 4, 5, 6, 1, 0], 2),
    ("add", "r1", [0, 1, 2, 3, 4, 5, 6, 0, 1], 1),
    ("step", 32, True),
    ("step", 32, True),
    ("step", 32, True),
    ("reset_prefix_cache", False),
    ("add", "r2", [0, 1, 2, 3, 4, 5, 6, 1, 0], 1),
    ("add", "r3", [0, 1, 2, 3, 4, 5, 6, 0, 1], 1),
    ("step", 8, False),
    ("abort", "r2"),
    ("abort", "r3"),
    ("step", 1, True),
]
CASES: list[tuple[str, list[tuple[Any, ...]], bool, bool, str | None]] = [
    ("OffloadConfig(16, 16, (4,), 4)", SHARED, True, True, None),
    ("OffloadConfig(6, 16, (4,), 4, 2)", CPU_HIT, True, True, None),
    ("OffloadConfig(6, 16, (4,), 4, 2, lazy=True)", CPU_HIT, True, True, None),
    # the connector's kv-cache events, compared at each step
    ("OffloadConfig(6, 16, (4,), 4, 2, kv_events=True)", CPU_HIT, True, True, None),
    # two groups: keys only up to the scheduler block of 8, the prompt tail a resend can hit
    ("OffloadConfig(16, 16, (4, 8), 4)", SHARED, True, True, None),
    ("OffloadConfig(12, 16, (4, 8), 4, kv_events=True)", CPU_HIT, True, True, None),
    ("OffloadConfig(8, 16, (4,), 4)", FULL_SEQUENCE, True, True, None),
    ("OffloadConfig(8, 16, (4,), 4)", FULL_SEQUENCE, False, False, None),
    # the model admitting on the first chunk where vLLM wants the whole sequence
    (
        "OffloadConfig(8, 16, (4,), 4)",
        FULL_SEQUENCE,
        True,
        False,
        "call 3 ('step', 15, True): the model returned ({'r0': 6, 'r1': 9}",
    ),
    ("OffloadConfig(5, 2, (4,), 4)", RESERVED, False, False, None),
    ("OffloadConfig(7, 12, (4,), 4)", HOLDERS, False, False, None),
    ("OffloadConfig(7, 2, (4,), 4, lazy=True)", PREEMPTED_LOAD, False, False, None),
    ("OffloadConfig(12, 16, (4,), 4, kv_events=True)", WEIGHT_UPDATE, True, True, None),
    # a reset preempting r1 while its store is in flight: the connector empties the store
    # state's table at the next step
    ("OffloadConfig(4, 2, (4,), 4)", RESET_PREEMPTS_A_STORE, True, True, None),
    # loads aborted while in flight, reported in one output with the stores
    ("OffloadConfig(4, 12, (8,), 8, lazy=True)", ABORTED_LOADS, False, False, None),
]


def test_vllm_schedules_as_the_model_does() -> None:
    """Each call's result and the snapshot agree where the model admits as vLLM does, and
    the first difference is named where it does not."""
    script = textwrap.dedent(
        f"""
        import json
        from kvoffload.model import OffloadConfig
        from kvoffload.testing.scheduler_lockstep import first_difference_between
        for config, program, theirs, ours, _ in {CASES!r}:
            found = first_difference_between(eval(config), program, {VARIANT!r}, theirs, ours)
            print(json.dumps({{"found": found}}))
        """
    )
    found = found_in_release("0.34.0", script)
    assert len(found) == len(CASES)
    for (*_, expected), got in zip(CASES, found, strict=True):
        if expected is None:
            assert got is None, got
        else:
            assert got is not None and got.startswith(expected), got


def test_the_machine_over_vllms_scheduler_conforms_and_finds_57727(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A short campaign conforms against 0.34.0's variant, and finds the prefix-cache reset
    of vLLM #57727 against the model's own rule (the check's disagreement is reachable);
    the failure is saved in the one format and replayed on the release it came from."""
    monkeypatch.setenv("KVOFFLOAD_FAILURES", str(tmp_path))
    script = textwrap.dedent(
        f"""
        import json
        from hypothesis import settings
        from kvoffload.testing import profiles
        from kvoffload.testing.scheduler_machine import run_scheduler_check
        profile = settings(profiles.get("ci"), max_examples=160)
        for variant in ({VARIANT!r}, "inclusive-cpu+window-stale-ids"):
            result = run_scheduler_check(variant, profile, None)
            print(json.dumps({{"found": result["disagreement"]}}))
        """
    )
    conforming, reset = found_in_release("0.34.0", script)
    assert conforming is None, conforming
    assert reset is not None and "reset_prefix_cache" in reset, reset
    (saved,) = tmp_path.glob("scheduler-vllm-0.34.0-*.json")
    failure = load(saved)
    assert failure.machine == "scheduler" and failure.disagreement == reset
    assert failure.target_identity == {"kind": "release", "version": "0.34.0"}
    capsys.readouterr()
    assert main(["replay", "--run", str(saved)]) == 1
    assert "still disagrees on vllm==0.34.0" in capsys.readouterr().out
    assert "replay_or_skip" in failure.regression_test()


def test_the_kv_events_vllms_scheduler_publishes_are_judged_on_its_own_state() -> None:
    """vLLM's scheduler publishes the connector's kv events once a step; a step's are read
    from its CPU map at the step before to its CPU map now (EVENT-STREAM). Evictions left
    unannounced break the invariant (a router would still route to the evicted key); an
    extra announcement withdrawn in the same step differs from the model with every
    invariant holding: a change to review. Unchanged, the program conforms."""
    script = textwrap.dedent(
        f"""
        import dataclasses, json
        from kvoffload.model import OffloadConfig
        from kvoffload.model.types import REMOVED, STORED
        from kvoffload.testing.scheduler_lockstep import first_difference
        from kvoffload.vllm_target.scheduler import VllmScheduler
        config = OffloadConfig(6, 2, (4,), 4, kv_events=True)  # 2 CPU blocks: evictions
        take = VllmScheduler.take_events

        def unannounced(self):
            return [e for e in take(self) if e.kind != REMOVED]

        def withdrawn(self):
            events = take(self)
            stored = [e for e in events if e.kind == STORED][-1:]
            return events + [dataclasses.replace(e, kind=REMOVED) for e in stored] + stored

        for published in (take, unannounced, withdrawn):
            VllmScheduler.take_events = published
            print(json.dumps({{"found": first_difference(config, {CPU_HIT!r}, {VARIANT!r})}}))
        """
    )
    unchanged, unannounced, withdrawn = found_in_release("0.34.0", script)
    assert unchanged is None, unchanged
    assert unannounced is not None and unannounced.startswith(
        "the target breaks EVENT-STREAM at call 6 ('step', 8, True): the kv events announce "
        "1 CPU blocks holding"
    ), unannounced
    assert "the model announces key" in unannounced and "removed from the CPU" in unannounced
    assert withdrawn is not None and withdrawn.startswith("call "), withdrawn
    assert "kv-cache events differ" in withdrawn and "breaks" not in withdrawn


def test_the_scheduler_target_refuses_what_it_does_not_drive_yet() -> None:
    # Refused before vLLM is imported: these run without it.
    with pytest.raises(InvalidArgumentError, match="takes calls"):
        first_difference(OffloadConfig(8, 8, (4,), 4), [("drain",)])
    with pytest.raises(InvalidArgumentError, match="full-attention groups only"):
        VllmScheduler(OffloadConfig(8, 8, (4, 4), 4, sliding_windows=(None, 3)))
    with pytest.raises(InvalidArgumentError, match="whole blocks only"):
        VllmScheduler(OffloadConfig(8, 8, (8,), 4))
