"""A model that breaks one of its own invariants on a program is a verdict of its own (issue
35): not bad input (exit 2), not a difference from the target, but "the model broke
INVARIANT" (exit status 3), with the program shrunk, saved under a name of its own and
replayable like any failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import settings

from kvoffload.main import main
from kvoffload.testing import lockstep, stateful
from kvoffload.testing.campaign import run_campaign, run_verify
from kvoffload.testing.failure import MODEL_BROKE, load, model_broke
from kvoffload.testing.targets import TargetSpec, spec

from helpers import registered

# The model with the missing final flush of vLLM #53498 breaks its invariants by design; held
# to them as if it kept them, it is a broken specification the machine must report as such.
BROKEN = "no-final-flush"


@pytest.fixture
def broken_spec(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    for module in (stateful, lockstep):
        monkeypatch.setattr(module, "keeps_invariants", lambda variant: True)


PROFILE = settings(max_examples=200, stateful_step_count=20, deadline=None, database=None)


@pytest.mark.usefixtures("broken_spec")
def test_the_model_breaking_an_invariant_is_saved_shrunk_and_replayable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = run_campaign("impl", PROFILE, variant=BROKEN, seed=3)
    assert not result.conforms and result.failure is not None
    invariant = result.broken_invariant
    assert invariant is not None and invariant == model_broke(result.failure["disagreement"])
    assert result.failure["disagreement"].startswith(f"the model broke {invariant} at call ")
    assert result.saved is not None and result.saved.name.endswith("-model-broke.json")
    saved = load(result.saved)
    assert saved.verdict == MODEL_BROKE and json.loads(result.saved.read_text())["verdict"]
    assert len(saved.program) <= 6, saved.program  # shrunk: a prompt, its steps
    capsys.readouterr()
    assert main(["replay", "--run", str(result.saved)]) == 3
    out = capsys.readouterr().out
    assert f"the model still breaks {invariant} on the program of" in out


@pytest.mark.usefixtures("broken_spec")
def test_verify_says_the_model_broke_and_exits_3(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    report = tmp_path / "verdict.json"
    # a target compared with the broken specification, as a user registers one
    row = TargetSpec("impl-vs-broken", spec("impl").build, "impl held to BROKEN", lambda: BROKEN)
    with registered(row):
        status = run_verify("fast", None, row.name, False, seed=3, json_path=str(report))
    assert status == 3
    out = capsys.readouterr().out
    assert f"conformance of {row.name}: the model broke " in out
    assert "a bug of the specification" in out
    verdict = json.loads(report.read_text())
    assert verdict["exit_status"] == 3 and verdict["verdict"].startswith("the model broke ")
    assert verdict["failure"]["verdict"] == MODEL_BROKE


def test_a_difference_is_not_a_broken_model() -> None:
    assert model_broke("call 1 ('step', 8): snapshots differ in ['cpu']: ...") is None
    found = "the model broke FLUSH-COMPLETE at call 2 ('step', 8): block 3 was not stored"
    assert model_broke(found) == "FLUSH-COMPLETE"
    # a request id cannot make a difference read as a broken model
    assert model_broke("call 0 ('add', 'the model broke X: y', [1], 1): model returned") is None
