"""The vLLM release cache: target parsing, reuse of what is installed, the environment a
release runs in. (Installing itself needs the network: see ``kvoffload install``.)"""

from __future__ import annotations

from pathlib import Path

import pytest

import kvoffload
from kvoffload.model.errors import ConfigError
from kvoffload.upstream.install import Cache, environment_stamp, install
from kvoffload.vllm_target.forms import parse_target


def test_a_target_names_one_release() -> None:
    assert parse_target("vllm==0.29.0") == "0.29.0"
    for bad in ["vllm", "vllm>=0.29.0", "torch==2.13.0", "vllm==0.29", "vllm==latest"]:
        with pytest.raises(ConfigError, match=r"vllm==X\.Y\.Z"):
            parse_target(bad)


def _stamp(*folders: Path) -> None:
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        # the environment's stamp lists its packages; the others are empty
        (folder / ".ready").write_text(environment_stamp() if folder.name == "env" else "")


def test_an_installed_release_is_reused(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    assert not cache.installed("0.34.0")
    _stamp(cache.env, cache.model, cache.release("0.34.0"))
    assert cache.installed("0.34.0") and not cache.installed("0.29.0")
    # every part is stamped: nothing runs (no interpreter, no network is touched)
    assert install("0.34.0", cache, log=False) == cache


def test_an_environment_missing_a_dependency_is_installed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = Cache(tmp_path)
    _stamp(cache.env, cache.model, cache.release("0.21.0"))
    # stamped before gguf was a dependency (0.19.0 to 0.22.1 import it)
    older = environment_stamp().replace("\ngguf", "")
    (cache.env / ".ready").write_text(older)
    installed: list[tuple[str, ...]] = []
    monkeypatch.setattr(
        "kvoffload.upstream.install._pip",
        lambda python, what, *args, log=True: installed.append(args),
    )
    monkeypatch.setattr("kvoffload.testing.isolation.subprocess.run", lambda *a, **k: None)
    install("0.21.0", cache, log=False)
    assert len(installed) == 1 and "gguf" in installed[0]  # the list again, nothing else
    assert (cache.env / ".ready").read_text() == environment_stamp()


def test_an_unstamped_part_is_not_trusted(tmp_path: Path) -> None:
    cache = Cache(tmp_path)
    _stamp(cache.env, cache.model)
    cache.release("0.29.0").mkdir(parents=True)  # an interrupted install: no stamp
    assert not cache.installed("0.29.0")


def test_a_release_runs_with_itself_and_kvoffload_importable(tmp_path: Path) -> None:
    env = Cache(tmp_path).environment("0.29.0")
    paths = env["PYTHONPATH"].split(":")
    assert paths[0] == str(tmp_path / "releases" / "0.29.0")
    assert (Path(paths[1]) / "kvoffload").resolve() == Path(kvoffload.__file__).parent.resolve()
    assert env["HF_HUB_OFFLINE"] == "1"


def test_a_long_install_says_it_goes_on_and_a_failed_one_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """pip takes minutes for the shared environment: a line says what it installs, and a line
    every HEARTBEAT seconds that it still does; a pip that fails is a broken setup. (A stand-in
    interpreter that sleeps, then exits as told: nothing is installed.)"""
    from kvoffload.model.errors import SetupError
    from kvoffload.upstream import install as installing

    monkeypatch.setattr(installing, "HEARTBEAT", 0.05)
    for status in (0, 1):
        python = tmp_path / f"python-{status}"
        python.write_text(f"#!/bin/sh\nsleep 0.5\nexit {status}\n")
        python.chmod(0o755)
        if status == 0:
            installing._pip(python, "the packages", "x")
        else:
            with pytest.raises(SetupError, match="installing the packages failed"):
                installing._pip(python, "the packages", "x")
        lines = capsys.readouterr().err.splitlines()
        assert lines[0] == "  installing the packages"
        assert any(line.startswith("  still installing the packages (") for line in lines)
