"""The pytest plugin: ``pytest --kvoffload-target=...`` runs the campaign as tests, with
pytest's reporting (here JUnit XML), and is inert without that option. A bad option value is
a usage error (exit status 4, one line, nothing run); a target that cannot run here is an
ERROR (of setup, or of a campaign that broke), never a FAILED test, which is a verdict."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest
import torch


def _pytest(
    folder: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(
        command,
        cwd=folder,
        capture_output=True,
        text=True,
        check=False,
        env=None if env is None else os.environ | env,
    )


def _summary(run: subprocess.CompletedProcess[str]) -> str:
    """The last line of pytest's output: ``=== 1 error in 0.70s ===``."""
    return run.stdout.strip().splitlines()[-1]


def _usage_error(run: subprocess.CompletedProcess[str]) -> str:
    """The one line of a usage error, asserting there is exactly one and nothing else."""
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert run.returncode == 4, run.stdout + run.stderr
    assert len(lines) == 1 and lines[0].startswith("ERROR: "), lines
    return lines[0].removeprefix("ERROR: ")


def test_campaigns_run_as_tests_with_a_junit_report(tmp_path: Path) -> None:
    # A test file of the project under review: --kvoffload-only leaves it uncollected.
    (tmp_path / "test_theirs.py").write_text("def test_theirs() -> None:\n    raise SystemExit\n")
    run = _pytest(
        tmp_path,
        "--kvoffload-target=fault:no-final-flush",
        "--kvoffload-target=impl",
        "--kvoffload-seconds=5",
        "--kvoffload-seed=11",
        "--kvoffload-only",
        "--junitxml=report.xml",
    )
    assert run.returncode == 1, run.stdout + run.stderr
    cases = {
        case.get("name"): case
        for case in ElementTree.parse(tmp_path / "report.xml").getroot().iter("testcase")
    }
    assert set(cases) == {"kvoffload[fault:no-final-flush]", "kvoffload[impl]"}
    assert cases["kvoffload[impl]"].find("failure") is None
    failure = cases["kvoffload[fault:no-final-flush]"].find("failure")
    assert failure is not None and failure.text is not None
    assert "conformance of fault:no-final-flush: DISAGREES" in failure.text
    assert "faults=['no-final-flush']" in failure.text and "saved to " in failure.text
    assert "seed: 11" in failure.text
    # the verdict's class, as a property of each case
    verdicts = {
        name: {p.get("name"): p.get("value") for p in case.iter("property")}
        for name, case in cases.items()
    }
    assert verdicts["kvoffload[impl]"] == {"kvoffload-verdict": "conforms"}
    broken = verdicts["kvoffload[fault:no-final-flush]"]["kvoffload-verdict"]
    assert broken is not None and broken.startswith("breaks ")
    assert f"DISAGREES: {broken}" in failure.text


def test_the_plugin_is_inert_without_a_target(tmp_path: Path) -> None:
    (tmp_path / "test_theirs.py").write_text("def test_theirs() -> None:\n    pass\n")
    run = _pytest(tmp_path, "-q")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout and "kvoffload" not in run.stdout


MARKER = "def test_theirs() -> None:\n    open('ran', 'w').close()\n"


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            "--kvoffload-seconds=nan",
            "--kvoffload-seconds: seconds must be finite, > 0 and at most 604800 (a week), "
            "got 'nan'",
        ),
        ("--kvoffload-seconds=inf", "--kvoffload-seconds: seconds must be finite"),
        ("--kvoffload-seconds=-1", "--kvoffload-seconds: seconds must be finite"),
        ("--kvoffload-seconds=0", "--kvoffload-seconds: seconds must be finite"),
        ("--kvoffload-seconds=1e308", "--kvoffload-seconds: seconds must be finite"),
        ("--kvoffload-seconds=soon", "--kvoffload-seconds: 'soon' is not a number of seconds"),
        (
            "--kvoffload-seed=-1",
            "--kvoffload-seed: the seed must be from 0 to 18446744073709551615, got '-1'",
        ),
        (
            f"--kvoffload-seed={2**64}",
            "--kvoffload-seed: the seed must be from 0 to 18446744073709551615",
        ),
        ("--kvoffload-seed=1.5", "--kvoffload-seed: '1.5' is not a whole number"),
        (
            "--kvoffload-seed=" + "9" * 50,
            "--kvoffload-seed: '" + "9" * 50 + "' is longer than any number taken here",
        ),
        (
            "--kvoffload-target=fault:no-such-fault",
            "--kvoffload-target: 'fault:no-such-fault' names no fault of the catalogue; known: ",
        ),
        (
            "--kvoffload-target=vllm==0.34",
            "--kvoffload-target: target 'vllm==0.34' is not of the form vllm==X.Y.Z",
        ),
        (
            "--kvoffload-target=vllm@.",
            "--kvoffload-target: . is not a vLLM source tree: it has no vllm/v1/",
        ),
        ("--kvoffload-target=vllm-0.34.0", "--kvoffload-target: unknown target 'vllm-0.34.0'"),
    ],
)
def test_a_bad_option_value_is_a_usage_error_and_runs_nothing(
    tmp_path: Path, option: str, message: str
) -> None:
    # A test file that would run if anything did (no --kvoffload-only).
    (tmp_path / "test_theirs.py").write_text(MARKER)
    run = _pytest(tmp_path, option)
    line = _usage_error(run)
    assert line.startswith(message), line
    assert not (tmp_path / "ran").exists()


def test_a_bad_fault_lists_the_catalogue(tmp_path: Path) -> None:
    from kvoffload.impl.faults import FAULTS

    line = _usage_error(_pytest(tmp_path, "--kvoffload-target=fault:nope", "--kvoffload-only"))
    assert line.endswith("known: " + ", ".join(sorted(FAULTS)))


def test_a_target_given_twice_is_a_usage_error(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "--kvoffload-target=impl", "--kvoffload-target=impl")
    assert _usage_error(run) == "--kvoffload-target: 'impl' is given twice"


def test_an_unknown_target_is_a_usage_error_naming_the_targets(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "--kvoffload-target=nope", "--kvoffload-only", "-q")
    line = _usage_error(run)
    assert line.startswith("--kvoffload-target: unknown target 'nope'; the targets: impl ")
    assert "fault:NAME" in line and "vllm==X.Y.Z" in line


def _errors_at_setup(run: subprocess.CompletedProcess[str], target: str) -> str:
    """The one line saying why ``target`` could not run, asserting that pytest reports an
    ERROR at setup (exit status 1, "1 error", nothing failed)."""
    assert run.returncode == 1, run.stdout + run.stderr
    summary = _summary(run)
    assert "1 error" in summary and "failed" not in summary and "passed" not in summary, summary
    lines = run.stdout.splitlines()
    at = next(
        n for n, line in enumerate(lines) if f"ERROR at setup of conformance of {target}" in line
    )
    return lines[at + 1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here: impl-cuda runs")
def test_impl_cuda_without_cuda_is_an_error_at_setup(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "--kvoffload-target=impl-cuda", "--kvoffload-only")
    line = _errors_at_setup(run, "impl-cuda")
    assert line.startswith("broken setup: impl-cuda needs CUDA, and "), line
    assert line.endswith("or run --kvoffload-target=impl"), line


def test_a_release_not_installed_is_an_error_at_setup_naming_the_install(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    run = _pytest(
        tmp_path,
        "--kvoffload-target=vllm==0.19.0",
        "--kvoffload-only",
        "--junitxml=report.xml",
        env={"KVOFFLOAD_VLLM_CACHE": str(cache)},
    )
    line = _errors_at_setup(run, "vllm==0.19.0")
    assert line == (
        f"broken setup: vllm==0.19.0 is not installed in {cache}: run "
        "`kvoffload install vllm==0.19.0`"
    )
    (case,) = ElementTree.parse(tmp_path / "report.xml").getroot().iter("testcase")
    error = case.find("error")
    assert case.find("failure") is None and error is not None
    assert "kvoffload install vllm==0.19.0" in (error.get("message") or "")


def test_a_tree_without_the_shared_environment_is_an_error_at_setup(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "vllm" / "v1" / "simple_kv_offload").mkdir(parents=True)
    (tree / "vllm" / "v1" / "simple_kv_offload" / "manager.py").write_text("")
    (tmp_path / "cache").mkdir()
    run = _pytest(
        tmp_path,
        f"--kvoffload-target=vllm@{tree}",
        "--kvoffload-only",
        env={"KVOFFLOAD_VLLM_CACHE": str(tmp_path / "cache")},
    )
    line = _errors_at_setup(run, f"vllm@{tree}")
    assert line.startswith("broken setup: a vLLM tree runs in the shared environment of "), line
    assert "run `kvoffload install vllm==X.Y.Z` (any release)" in line


def test_a_target_that_cannot_be_built_is_an_error_at_setup(tmp_path: Path) -> None:
    # This run's conftest registers a target whose construction fails, as a user registers
    # their own.
    (tmp_path / "conftest.py").write_text(
        "from kvoffload.testing.targets import TargetSpec, register\n"
        "def _broken(config):\n"
        "    raise RuntimeError('no memory for the pools')\n"
        "register(TargetSpec('broken', _broken, 'a target that cannot be built'))\n"
    )
    run = _pytest(tmp_path, "--kvoffload-target=broken", "--kvoffload-only")
    line = _errors_at_setup(run, "broken")
    assert line.startswith("broken setup: broken cannot be built here, even on OffloadConfig("), (
        line
    )
    assert line.endswith("RuntimeError('no memory for the pools')"), line


def test_a_campaign_that_breaks_is_an_error_never_a_disagreement(tmp_path: Path) -> None:
    # This run's conftest makes the campaign itself raise a SetupError, past the setup.
    (tmp_path / "conftest.py").write_text(
        "from kvoffload.model.errors import SetupError\n"
        "from kvoffload.testing import campaign\n"
        "def _breaks(*args, **kwargs):\n"
        "    raise SetupError('the copy engine stopped')\n"
        "campaign.run_campaign = _breaks\n"
    )
    run = _pytest(tmp_path, "--kvoffload-target=impl", "--kvoffload-only")
    assert run.returncode == 1, run.stdout + run.stderr
    summary = _summary(run)
    assert "1 error" in summary and "failed" not in summary, summary
    lines = run.stdout.splitlines()
    at = lines.index(next(line for line in lines if "ERROR at call of conformance of impl" in line))
    assert lines[at + 1] == "broken setup: the copy engine stopped"
    assert "DISAGREES" not in run.stdout
