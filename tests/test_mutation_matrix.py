"""The mutation matrix: the conformance machine, run by itself on every fault of the
catalogue, finds each one and shrinks it to a short counterexample.

Each fault runs under the ``ci`` profile (derandomized, no example database), whatever the
profile of the run: a fault the matrix misses must be a regression of the machine, never bad
luck, and a fresh clone must see what CI sees."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvoffload.impl import FAULTS
from kvoffload.model.errors import ConfigError
from kvoffload.model.invariants import CHECKS
from kvoffload.testing import profiles
from kvoffload.testing.campaign import (
    MAX_SHRUNK_STEPS,
    fault_campaign,
    matrix_verdict,
    mutation_matrix,
    mutation_table,
)


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_machine_finds_the_fault(
    fault: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the saved failure goes under this test's folder
    result = fault_campaign(fault, profiles.get("ci"))
    assert not result.conforms, f"the conformance machine did not find {fault}"
    assert result.failure is not None and result.shrunk_steps is not None
    assert result.shrunk_steps <= MAX_SHRUNK_STEPS, result.failure["program"]
    saved = tmp_path / ".hypothesis" / "kvoffload-failures" / f"fault-{fault}-fixed.json"
    assert saved.exists()


def test_each_fault_names_what_it_breaks() -> None:
    # KV-BYTES: a block does not hold its key's KV; INPUT: the driver contract on bad input
    known = {*CHECKS, "KV-BYTES", "INPUT"}
    for name, fault in FAULTS.items():
        assert fault.breaks in known, f"{name} breaks unknown {fault.breaks!r}"


def test_the_table_says_which_program_of_the_stream_first_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    result = fault_campaign("no-final-flush", profiles.get("ci"))
    program = result.recorder.first_failing_program
    assert program is not None and program >= 1
    table = mutation_table([result]).splitlines()
    row = next(line for line in table if line.startswith("| no-final-flush |"))
    assert row.split(" | ")[3] == str(program)
    assert matrix_verdict([result]).endswith(f"the latest first failure in program {program}")


def test_the_matrix_in_several_processes_is_the_matrix_in_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # kvoffload verify and mutants run the campaigns one per core: under the derandomized
    # profile the same faults must be found with the same shrunk programs, in catalogue order.
    monkeypatch.chdir(tmp_path)
    faults = ["pin-dropped-early", "phantom-primary"]
    alone = mutation_matrix("ci", faults=faults)
    together = mutation_matrix("ci", jobs=2, faults=faults)
    assert [r.adapter for r in together] == [f"fault:{name}" for name in faults]
    for one, other in zip(alone, together, strict=True):
        assert not one.conforms and not other.conforms
        assert one.failure is not None and other.failure is not None
        assert one.failure["program"] == other.failure["program"]
        assert one.recorder.programs == other.recorder.programs


def test_the_matrix_refuses_a_fault_it_does_not_know() -> None:
    with pytest.raises(ConfigError, match="unknown faults \\['no-such-fault'\\]"):
        mutation_matrix("ci", jobs=2, faults=["phantom-primary", "no-such-fault"])


def test_mutants_writes_the_matrix_as_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from kvoffload.main import main
    from kvoffload.testing import campaign

    monkeypatch.chdir(tmp_path)
    whole = campaign.mutation_matrix
    # two faults of the catalogue stand for all of it: what is tested is the report
    monkeypatch.setattr(
        campaign,
        "mutation_matrix",
        lambda name, progress, jobs: whole(
            name, progress, jobs, ["no-final-flush", "phantom-primary"]
        ),
    )
    out = tmp_path / "matrix.json"
    assert main(["mutants", "--jobs", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["profile"] == "ci" and report["exit_status"] == 0
    assert report["verdict"].startswith("2 of 2 faults found")
    faults = {row["fault"]: row for row in report["faults"]}
    assert set(faults) == {"no-final-flush", "phantom-primary"}
    for row in faults.values():
        assert row["found"] and 0 < row["shrunk_rules"] <= campaign.MAX_SHRUNK_STEPS
        difference = row["first_difference"]
        assert re.match(r"(the target breaks \S+ at )?call ", difference), difference
        assert Path(row["saved"]).exists()
    capsys.readouterr()
