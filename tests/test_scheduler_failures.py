"""The scheduler machine's failures are the one failure format (issue 37): recorded with the
machine that found them, reduced, saved, validated like any failure file, and replayed by
``kvoffload replay`` (``--run``, and the pytest file it writes). Without vLLM, the machine's
model alone held to a broken specification shows it; with vLLM 0.34.0, its own scheduler
(tests/test_upstream_scheduler.py)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from kvoffload.main import main
from kvoffload.testing import profiles, scheduler_machine
from kvoffload.testing.failure import (
    MODEL_ALONE,
    MODEL_BROKE,
    SCHEDULER,
    FailureFileError,
    load,
    validate,
)

# The model without #53498's final flush breaks its invariants by design; the scheduler
# machine's model alone, held to them as if it kept them, must report it as the model broke.
BROKEN = "no-final-flush"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scheduler machine's failure on the broken specification, as a campaign saved it."""
    folder = tmp_path_factory.mktemp("failures")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVOFFLOAD_FAILURES", str(folder))
        patch.setattr(scheduler_machine, "keeps_invariants", lambda variant: True)
        profile = settings(profiles.get("ci"), max_examples=400)
        result = scheduler_machine.run_scheduler_check(BROKEN, profile, None, vllm=False)
    assert not result["conforms"] and result["saved"] is not None
    # the check's record says the verdict's class, as verify --json reports it
    assert result["class"] == f"the model broke {result['disagreement'].split()[3]}"
    assert result["class"].startswith("the model broke ")
    return Path(result["saved"])


def test_a_scheduler_failure_is_reduced_and_saved_in_the_one_format(saved: Path) -> None:
    data = json.loads(saved.read_text())
    assert data["format"] == 2 and data["machine"] == SCHEDULER
    assert data["adapter"] == MODEL_ALONE and data["verdict"] == MODEL_BROKE
    assert isinstance(data["whole_sequence_admission"], bool)
    assert saved.name.startswith("scheduler-model-") and saved.name.endswith("-model-broke.json")
    failure = load(saved)
    assert validate(failure.to_dict()) == failure
    # reduced by the call-level pass: a prompt and the steps that finish it, a rule a call
    assert len(failure.program) <= 6, failure.program
    assert failure.rule_steps <= len(failure.program)
    assert all(
        call[0] in ("add", "step", "abort", "reset_prefix_cache") for call in failure.program
    )


def test_a_scheduler_failures_reproducer_is_literals_that_reproduce_it(saved: Path) -> None:
    failure = load(saved)
    text = failure.reproducer()
    assert "from kvoffload.testing.scheduler_lockstep import first_difference" in text
    assert "repr(" not in text and "eval(" not in text
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        exec(compile(text, "reproducer", "exec"), {})
    assert shown.getvalue().strip() == failure.disagreement


def test_replay_round_trips_a_scheduler_failure(
    saved: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["replay", "--run", str(saved)]) == 3
    assert "the model still breaks " in capsys.readouterr().out
    written = tmp_path / "test_regression.py"
    assert main(["replay", str(saved), "--output", str(written)]) == 0
    namespace: dict[str, Any] = {}
    exec(compile(written.read_text(), str(written), "exec"), namespace)
    tests = [v for k, v in namespace.items() if k.startswith("test_regression_scheduler_")]
    assert len(tests) == 1
    with pytest.raises(AssertionError, match="the model broke "):
        tests[0]()
    # the offload machine's page is not drawn for it, and another target is refused
    assert main(["replay", str(saved), "--html", str(tmp_path / "page.html")]) == 2
    assert main(["replay", "--run", str(saved), "--target", "impl"]) == 2
    assert "replays on a vLLM target or on 'model'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"machine": "mine"}, "machine must be one of"),
        ({"format": 1}, "machine must be one of"),
        ({"format": 3}, "format 3 is not one of 1, 2"),
        ({"whole_sequence_admission": None}, "whole_sequence_admission must be a bool"),
        ({"adapter": "impl"}, "the scheduler machine drives model, vllm, not 'impl'"),
        ({"program": [["drain"]]}, "unknown call 'drain'"),
        ({"program": [["step", 8]]}, "'step' takes 2 to 3 arguments, got 1"),
        ({"machine": "offload"}, "whole_sequence_admission must be a bool for the scheduler"),
    ],
)
def test_a_scheduler_failure_file_is_validated_in_full(
    saved: Path, change: dict[str, Any], problem: str
) -> None:
    data = json.loads(saved.read_text()) | change
    with pytest.raises(FailureFileError, match=problem):
        validate(data)
