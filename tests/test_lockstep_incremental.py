"""The incremental lockstep comparison (the default of ``compare``) has the verdict of the
full one, call for call: the conformance machine drives two twin pairs of model and
implementation with the same program, one compared incrementally and one in full, and
the two verdicts must be the same string (or both None) after every call. Where the
incremental comparison kept the model's previous snapshot (``changes_nothing``), the model's
own snapshot must equal it: the table of calls that change nothing is held to the model."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from test_impl_conformance import FAULT_SCENARIO

import kvoffload.testing.stateful as stateful
from kvoffload.impl import OffloadImpl
from kvoffload.model import OffloadModel
from kvoffload.testing import lockstep
from kvoffload.testing.adapters import Target
from kvoffload.testing.lockstep import Call, compare

from scenarios import SCENARIOS

TWIN_MISMATCH = "incremental and full comparisons disagree"


class Twins:
    """For each program, a second model and implementation driven alike, compared in full."""

    def __init__(self, faults: list[str]) -> None:
        self.faults = faults
        self.twin: tuple[OffloadModel, OffloadModel, OffloadImpl] | None = None
        self.calls = 0
        self.kept = 0

    def compare(self, model: OffloadModel, target: Target, call: Call, n: int) -> str | None:
        if self.twin is None or self.twin[0] is not model:
            twin = OffloadModel(model.config, check=True)
            # Host memory, as the adapters' implementation: on CUDA a race the fault plants
            # shows or not by timing, and the twins would disagree by chance.
            impl = OffloadImpl(model.config, faults=self.faults, device="cpu", lockstep=True)
            self.twin = (model, twin, impl)
        _, twin_model, twin_impl = self.twin
        before = lockstep.agreement(model, target)
        found = compare(model, target, call, n)
        found_in_full = compare(twin_model, twin_impl, call, n, incremental=False)
        self.calls += 1
        assert found == found_in_full, f"{TWIN_MISMATCH} at call {n} {call}"
        after = lockstep.agreement(model, target)
        if (
            found is None  # after a difference the pair's last agreement stays as it was
            and before is not None
            and after is not None
            and after.model_snapshot is before.model_snapshot
        ):
            self.kept += 1  # the model's snapshot was kept: the model must agree
            assert model.snapshot() == after.model_snapshot, f"{call} changed the model"
        return found


@pytest.mark.parametrize(
    ("faults", "examples"),
    [
        ([], 60),
        (["store-skips-compute-wait"], 15),
        (["pin-dropped-early"], 15),
        (["integrity-spot-check"], 15),
        (["fit-counts-cpu-pool"], 15),
        (["abandoned-store-registers"], 15),
    ],
)
def test_incremental_and_full_comparisons_agree(
    faults: list[str], examples: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    twins = Twins(faults)
    monkeypatch.setattr(stateful, "compare", twins.compare)
    adapter = f"fault:{faults[0]}" if faults else "impl"
    machine = stateful.machine_for(adapter, loads=True)
    config = settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        deadline=None,
        stateful_step_count=30,
        suppress_health_check=list(HealthCheck),
    )
    try:
        run_state_machine_as_test(machine, settings=config)
    except AssertionError as error:
        # A fault is found (by both comparisons alike): that is the machine's verdict.
        assert TWIN_MISMATCH not in str(error) and "changed the model" not in str(error)
        assert faults, f"the implementation disagreed: {error}"
    assert twins.calls > 0
    if not faults:
        assert twins.kept > 0  # the incremental comparison did keep snapshots


def _verdict(fault: str, incremental: bool) -> str | None:
    config, program = SCENARIOS[FAULT_SCENARIO[fault]]
    model = OffloadModel(config, check=True)
    impl = OffloadImpl(config, faults=[fault], device="cpu", lockstep=True)
    for n, call in enumerate(program):
        found = compare(model, impl, call, n, incremental=incremental)
        if found:
            return found
    return None


@pytest.mark.parametrize("fault", sorted(FAULT_SCENARIO))
def test_incremental_and_full_verdicts_agree_on_each_fault_s_scenario(fault: str) -> None:
    """Every fault of the catalogue on the scenario that shows it, compared both ways: among
    them targets whose bug is a call that changes nothing they show while the model changes
    (a worker's partial completion dropped), which the drawn programs reach only by chance."""
    incremental = _verdict(fault, incremental=True)
    assert incremental is not None and incremental == _verdict(fault, incremental=False)
