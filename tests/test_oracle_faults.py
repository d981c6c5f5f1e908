"""The checker checked (issue 34): each fault planted in the oracle (testing/oracle_faults.py)
makes a named test of the project fail. A weakened comparison, byte check, event comparison,
verdict or invariant check that passed the project's own tests would go unseen in every
verdict after it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import test_impl_conformance as conformance
import test_invariants as invariants
import test_lockstep_incremental as incremental
import test_observed as observed

from kvoffload.model.invariants import CHECKS
from kvoffload.testing import lockstep
from kvoffload.testing.oracle_faults import ORACLE_FAULTS, planted

fault_class = conformance.test_each_fault_changes_observable_behaviour_with_its_verdict_class

# The test of the project that finds each oracle fault: it passes in the suite, and fails
# while the fault is planted.
DETECTORS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    # a worker's partial completion changes the model's counts and nothing the target shows:
    # the incremental comparison must not take the unchanged target for agreement
    "unchanged-trusts-target": lambda mp: (
        incremental.test_incremental_and_full_verdicts_agree_on_each_fault_s_scenario(
            "partial-completions-dropped"
        )
    ),
    # the model's snapshot kept after a finish must be the model's state
    "finish-changes-nothing": lambda mp: incremental.test_incremental_and_full_comparisons_agree(
        [], 60, mp
    ),
    # a store copied before the compute that writes its block: only the bytes differ
    "bytes-unchecked": lambda mp: fault_class("store-skips-compute-wait"),
    # a store's secondary keys unannounced: only the events differ
    "events-uncompared": lambda mp: fault_class("secondary-keys-unannounced"),
    "verdict-blind": lambda mp: fault_class("window-stale-ids"),
    "verdict-always-breaks": lambda mp: (
        observed.test_a_change_vllm_meant_is_a_difference_with_every_invariant_holding()
    ),
    "position-form-holds": lambda mp: observed.test_a_corrupted_snapshot_breaks_the_form(
        "POSITION"
    ),
    "registered-check-holds": lambda mp: (
        invariants.test_breaking_an_invariant_is_reported_under_its_id("REGISTERED")
    ),
}


def test_every_oracle_fault_has_a_detector() -> None:
    assert set(DETECTORS) == set(ORACLE_FAULTS)


@pytest.mark.parametrize("name", sorted(ORACLE_FAULTS))
def test_the_project_s_tests_find_each_oracle_fault(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with planted(name), pytest.raises(AssertionError):
        DETECTORS[name](monkeypatch)


def test_a_planted_fault_is_undone_on_exit_even_after_an_error() -> None:
    original_seam, original_check = lockstep.unchanged_since, CHECKS["REGISTERED"]
    with pytest.raises(RuntimeError), planted("unchanged-trusts-target"):
        assert lockstep.unchanged_since is not original_seam
        raise RuntimeError("inside")
    with planted("registered-check-holds"):
        assert CHECKS["REGISTERED"] is not original_check
    assert lockstep.unchanged_since is original_seam and CHECKS["REGISTERED"] is original_check


def test_an_unknown_oracle_fault_is_refused_and_nothing_changes() -> None:
    original = lockstep.compare_events
    with pytest.raises(ValueError, match="no oracle fault named 'nope'; known: "), planted("nope"):
        pass
    assert lockstep.compare_events is original


def test_the_conformance_page_lists_every_oracle_fault() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "conformance.md").read_text()
    section = text.split("## The checker checked", 1)[1].split("\n## ", 1)[0]
    for fault in ORACLE_FAULTS.values():
        assert f"| `{fault.name}` |" in section and fault.summary in section, fault.name
