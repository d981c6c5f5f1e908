"""CrossHair checks the contracts of the model's pure helpers, with a bounded time per
condition, and catches a helper that breaks its contract."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvoffload.model.arith

CROSSHAIR = Path(sys.executable).with_name("crosshair")


def crosshair(target: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CROSSHAIR), "check", "--analysis_kind=PEP316", "--per_condition_timeout=2", target],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


pytestmark = pytest.mark.skipif(
    not CROSSHAIR.exists() and shutil.which("crosshair") is None, reason="crosshair not installed"
)


@pytest.mark.parametrize("module", ["kvoffload.model.arith", "kvoffload.model.keys"])
def test_the_contracts_hold(module: str, tmp_path: Path) -> None:
    result = crosshair(module, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "error" not in result.stdout


def test_a_helper_that_breaks_its_contract_is_caught(tmp_path: Path) -> None:
    source = Path(kvoffload.model.arith.__file__).read_text()
    broken = source.replace(
        "                if taken >= num_free:\n                    return picks, advanced, True\n",
        "",
    )
    assert broken != source
    (tmp_path / "broken_arith.py").write_text(broken)
    result = crosshair("broken_arith.py", tmp_path)
    assert result.returncode != 0
    assert "plan_selection" in result.stdout
