"""Nothing kvoffload starts runs code from the folder it was started in, or from the caller's
``PYTHON*`` variables (issue 35, kvoffload.testing.isolation): a failure file unpacked from a CI
artifact beside a planted ``kvoffload/`` package, a ``json.py`` or a ``multiprocessing.py``
is replayed, verified and fuzzed with none of them imported; a release's process imports
its own environment's packages and nothing of the caller's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.testing import isolation
from kvoffload.upstream.install import Cache, default_cache

KVOFFLOAD = str(Path(sys.executable).parent / "kvoffload")
# A one-block prompt finished by its first output, replayed on a fault without the final
# flush (vLLM #53498): it disagrees. On vLLM 0.29.0, the stamp of #53498 against the fixed
# model (docs/upstream.md): it disagrees too.
FLUSH = [["add", "r0", [0, 1, 2, 3], 1], ["step", 8], ["step", 8]]
STAMP = [["add", "r0", [0, 1, 2, 3], 2], ["step", 2], ["step", 2], ["step", 2]]
SMALL = {"gpu_blocks": 4, "cpu_blocks": 2, "group_block_sizes": [4], "hash_block_size": 4}
PLANTED = ("kvoffload/__init__.py", "json.py", "multiprocessing.py", "hypothesis.py", "pip.py")


def _plant(folder: Path) -> Path:
    """A folder holding modules that leave a mark in ``folder/marks`` when imported."""
    marks = folder / "marks"
    marks.mkdir(parents=True)
    for name in PLANTED:
        module = folder / name
        module.parent.mkdir(parents=True, exist_ok=True)
        mark = marks / name.replace("/", "-")
        module.write_text(f"import pathlib\npathlib.Path({str(mark)!r}).write_text('ran')\n")
    return marks


def _failure(folder: Path, adapter: str, program: list[list[object]], **more: object) -> Path:
    data = {
        "adapter": adapter,
        "config": SMALL | {"world_size": 1},
        "program": program,
        "disagreement": "call 2 ('step', 8): something differed",
        **more,
    }
    path = folder / "failure.json"
    path.write_text(json.dumps(data))
    return path


def _run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)


def test_a_replay_in_a_planted_folder_runs_none_of_it(tmp_path: Path) -> None:
    marks = _plant(tmp_path)
    failure = _failure(tmp_path, "fault:no-final-flush", FLUSH)
    run = _run([KVOFFLOAD, "replay", "--run", "failure.json"], tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "still disagrees on fault:no-final-flush" in run.stdout
    assert not list(marks.iterdir()), [p.name for p in marks.iterdir()]
    assert failure.exists()


def test_a_vllm_replay_in_a_planted_folder_runs_none_of_it(tmp_path: Path) -> None:
    if not Cache(default_cache()).installed("0.29.0"):
        pytest.skip("vllm==0.29.0 is not installed: kvoffload install vllm==0.29.0")
    marks = _plant(tmp_path)
    _failure(tmp_path, "vllm", STAMP, release="0.29.0", variant="fixed")
    run = _run([KVOFFLOAD, "replay", "--run", "failure.json"], tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "still disagrees on vllm==0.29.0" in run.stdout
    assert "call 3 ('step', 2): snapshots differ in ['cpu']" in run.stdout
    assert not list(marks.iterdir()), [p.name for p in marks.iterdir()]


def test_the_matrix_workers_spawned_in_a_planted_folder_run_none_of_it(tmp_path: Path) -> None:
    marks = _plant(tmp_path)
    # The caller puts nothing of the folder on its own path (the console script does not);
    # what is tested is the spawned workers, which multiprocessing starts with `-c`.
    code = (
        "import sys; sys.path.remove('')\n"
        "from kvoffload.testing.campaign import mutation_matrix\n"
        "results = mutation_matrix('fast', jobs=2, faults=['no-final-flush', 'phantom-primary'])\n"
        "print([r.conforms for r in results])\n"
    )
    run = _run([sys.executable, "-c", code], tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[False, False]"
    assert not list(marks.iterdir()), [p.name for p in marks.iterdir()]


def test_a_release_process_imports_its_own_environment_only(tmp_path: Path) -> None:
    cache = Cache(default_cache())
    if not cache.installed("0.34.0"):
        pytest.skip("vllm==0.34.0 is not installed: kvoffload install vllm==0.34.0")
    marks = _plant(tmp_path)
    code = (
        "import sys, json, torch, hypothesis, kvoffload, vllm\n"
        "print(json.dumps({'path': sys.path, 'torch': torch.__file__, "
        "'hypothesis': hypothesis.__file__, 'kvoffload': kvoffload.__file__, "
        "'vllm': vllm.__file__}))\n"
    )
    env = os.environ | {"PYTHONPATH": str(tmp_path), "PYTHONUSERBASE": str(tmp_path)}
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        isolated = cache.environment("0.34.0")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    with isolation.own_folder() as folder:
        command = [str(cache.python), *isolation.FLAGS, "-c", code]
        run = isolation.run(command, isolated, folder, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    env_root = str(cache.env.resolve())
    assert str(tmp_path) not in json.dumps(seen["path"]) and "" not in seen["path"]
    assert Path(seen["torch"]).resolve().is_relative_to(env_root)
    assert Path(seen["hypothesis"]).resolve().is_relative_to(env_root)
    assert Path(seen["vllm"]).is_relative_to(cache.release("0.34.0"))
    assert Path(seen["kvoffload"]).is_relative_to(cache.package_link())
    assert not list(marks.iterdir())


def test_an_isolated_environment_keeps_none_of_the_callers_python_variables(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PYTHONSTARTUP", "startup.py")
    monkeypatch.setenv("PYTHONPATH", "their-packages")
    monkeypatch.setenv("PYTHONINSPECT", "1")
    monkeypatch.setenv("CI", "true")
    monkeypatch.chdir(tmp_path)
    theirs = isolation.environment()
    assert theirs["PYTHONPATH"] == "their-packages"  # their own environment: how it was found
    other = isolation.environment([Path("release")], {"X": "1"})
    assert other["PYTHONPATH"] == str(tmp_path / "release")
    assert other["PYTHONNOUSERSITE"] == "1" and other["X"] == "1" and other["CI"] == "true"
    for env in (theirs, other):
        assert "PYTHONSTARTUP" not in env and "PYTHONINSPECT" not in env
        assert env["PYTHONSAFEPATH"] == "1"
        # what the subprocess saves lands in the caller's folder, named absolute
        assert env[isolation.FAILURES_VARIABLE] == str(tmp_path / isolation.FAILURES)
        assert env[isolation.DATABASE_VARIABLE] == str(tmp_path / isolation.DATABASE)
