"""The pytest plugin: ``pytest --kvoffload-target=...`` runs the campaign as tests, with
pytest's reporting (here JUnit XML), and is inert without that option."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def _pytest(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args]
    return subprocess.run(command, cwd=folder, capture_output=True, text=True, check=False)


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


def test_the_plugin_is_inert_without_a_target(tmp_path: Path) -> None:
    (tmp_path / "test_theirs.py").write_text("def test_theirs() -> None:\n    pass\n")
    run = _pytest(tmp_path, "-q")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout and "kvoffload" not in run.stdout


def test_an_unknown_target_fails_naming_the_problem(tmp_path: Path) -> None:
    run = _pytest(tmp_path, "--kvoffload-target=nope", "--kvoffload-only", "-q")
    assert run.returncode == 1
    assert "SetupError: unknown target 'nope'" in run.stdout
