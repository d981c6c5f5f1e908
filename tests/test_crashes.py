"""A crash is reported as what it is (issue 16): an exception raised inside the target under
test is its answer to the call, a disagreement shrunk like any other; a target that cannot
be built is a broken setup (exit status 3), never a verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import settings

from kvoffload.impl import OffloadImpl
from kvoffload.main import main
from kvoffload.model import FinishResult, OffloadConfig, SetupError
from kvoffload.model.snapshot import Snapshot
from kvoffload.testing import campaign
from kvoffload.testing.adapters import Adapter
from kvoffload.testing.failure import validate
from kvoffload.testing.lockstep import compare
from kvoffload.testing.targets import TargetSpec

from helpers import make, registered


class CrashesOnFinish(OffloadImpl):
    """The implementation with a crash where vLLM's own code has had them: an index out of
    range inside the finish hook."""

    def finish(self, request_id: str) -> FinishResult:
        raise IndexError("list index out of range")


class SnapshotCrashes(OffloadImpl):
    def snapshot(self) -> Snapshot:
        if self.live_requests():
            raise KeyError("no key for this hash")
        return super().snapshot()


def test_an_exception_inside_the_target_is_a_disagreement() -> None:
    model = make(gpu_blocks=8, cpu_blocks=4, group_block_sizes=(4,), hash_block_size=4)
    target = CrashesOnFinish(model.config)
    calls: list[tuple[object, ...]] = [("add", "r0", [0, 1, 2], 2), ("finish", "r0")]
    assert compare(model, target, calls[0], 0) is None
    found = compare(model, target, calls[1], 1)
    assert found is not None and found.startswith(
        "call 1 ('finish', 'r0'): model returned FinishResult(request_id='r0', "
        "flush_gpu_blocks=(), flush_cpu_blocks=()), implementation "
        "'IndexError: list index out of range'; snapshots differ in ['requests']: "
    )
    # what the state says too: the crash left the request unfinished
    assert "status='finished'" in found and "status='waiting'" in found


def test_a_snapshot_that_raises_is_a_disagreement() -> None:
    model = make(gpu_blocks=8, cpu_blocks=4, group_block_sizes=(4,), hash_block_size=4)
    found = compare(model, SnapshotCrashes(model.config), ("add", "r0", [0, 1], 1), 0)
    assert found == (
        "call 0 ('add', 'r0', [0, 1], 1): the implementation's snapshot raised "
        "KeyError: 'no key for this hash'"
    )


def _target(name: str, factory: Adapter) -> TargetSpec:
    """``factory`` as a target of the registry, as a user registers one."""
    return TargetSpec(name, factory, f"the test's target {name}")


def test_a_campaign_shrinks_a_crash_and_saves_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    small = settings(max_examples=200, stateful_step_count=20, deadline=None, database=None)
    with registered(_target("crashes-on-finish", CrashesOnFinish)):
        result = campaign.run_campaign("crashes-on-finish", small, seed=1)
        assert not result.conforms and result.failure is not None
        failure = validate(result.failure)  # (a failure file names a registered target)
    assert "IndexError: list index out of range" in failure.disagreement
    assert failure.program[-1][0] == "finish" and len(failure.program) <= 3
    assert result.saved is not None and result.saved.exists()


def _cannot_build(config: OffloadConfig) -> OffloadImpl:
    raise KeyError("KVOFFLOAD_VLLM_MODEL")


def test_a_target_that_cannot_be_built_is_a_broken_setup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    small = settings(max_examples=5, deadline=None, database=None)
    with registered(_target("cannot-build", _cannot_build)):
        with pytest.raises(SetupError, match="KeyError: 'KVOFFLOAD_VLLM_MODEL'"):
            campaign.run_campaign("cannot-build", small, seed=1)
        verify = ["verify", "--target", "cannot-build", "--seconds", "1", "--no-mutants"]
        assert main(verify) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "kvoffload verify: broken setup: the target cannot-build cannot be built"
    )


def test_verify_prints_the_seed_and_where_it_saved_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    report = tmp_path / "verdict.json"
    target = "fault:no-final-flush"
    args = ["verify", "--target", target, "--profile", "fast", "--seconds", "60"]
    assert main([*args, "--no-mutants", "--seed", "3", "--json", str(report)]) == 1
    out = capsys.readouterr().out
    saved = Path(".hypothesis/kvoffload-failures/fault-no-final-flush-fixed.json")
    assert f"saved to {saved}" in out and saved.exists()
    assert "seed: 3 (`--seed 3` runs these programs again)" in out
    verdict = json.loads(report.read_text())
    assert verdict["verdict"] == "disagrees" and verdict["exit_status"] == 1
    assert verdict["seed"] == 3 and verdict["target"] == target
    assert verdict["failure"]["adapter"] == target and verdict["saved"] == str(saved)
    assert "first_disagreement(config, program, faults=['no-final-flush']" in verdict["reproducer"]
