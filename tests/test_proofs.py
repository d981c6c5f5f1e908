"""The z3 obligations hold, and each can fail: every transition, broken on purpose, yields a
concrete counterexample; the registration lemma depends on guard 1."""

from __future__ import annotations

import pytest

from kvoffload.main import main
from kvoffload.proofs import all_obligations, check
from kvoffload.proofs.obligation import Obligation
from kvoffload.proofs.registration import _stamp_then_insert
from kvoffload.proofs.transitions import OFFLOAD_STEPS, POOL_STEPS, step_obligation

STEPS = [("pool", name) for name in POOL_STEPS] + [("offload", name) for name in OFFLOAD_STEPS]


@pytest.mark.parametrize("obligation", all_obligations(), ids=lambda o: o.name)
def test_every_obligation_holds(obligation: Obligation) -> None:
    outcome = check(obligation)
    assert outcome.ok, f"{outcome.status}: {outcome.model}"


@pytest.mark.parametrize(("system", "name"), STEPS)
def test_a_broken_transition_has_a_counterexample(system: str, name: str) -> None:
    outcome = check(step_obligation(system, name, broken=True, bound=3))
    assert outcome.status == "counterexample"


@pytest.mark.parametrize(("system", "name"), STEPS)
def test_the_fixed_transition_holds_in_the_bounded_world_too(system: str, name: str) -> None:
    # The bounded check that finds the counterexamples above is not vacuous.
    assert check(step_obligation(system, name, bound=3)).status == "proved"


def test_without_guard_one_stamping_is_harmless() -> None:
    """The phantom primary of vLLM #53498 is guard 1's doing: without it, no witness."""

    outcome = check(
        Obligation(
            "stamp without guard 1",
            "",
            lambda solver: _stamp_then_insert(solver, guard_one=False),
            expect="sat",
        )
    )
    assert outcome.status == "no witness"


def test_kvoffload_prove_reports_every_obligation(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["prove"]) == 0
    out = capsys.readouterr().out
    assert f"{len(all_obligations())} of {len(all_obligations())} obligations hold" in out
    assert "P_mapped = False" in out  # the witness of the phantom primary is shown
