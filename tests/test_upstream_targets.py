"""vLLM targets beyond PyPI releases: a source tree or checkout (``vllm@PATH``, what a
reviewer of a pull request points kvoffload at) and the vLLM of the current environment
(``vllm``), each held to the release-table row its version says, or to ``--expect``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.main import main
from kvoffload.model.errors import ConfigError
from kvoffload.upstream.install import Cache, default_cache
from kvoffload.vllm_target.forms import (
    checks_for,
    is_vllm_target,
    parse,
    tree_digest,
    tree_version,
)
from kvoffload.vllm_target.releases import Check, governing_release

MANAGER = Path("vllm") / "v1" / "simple_kv_offload" / "manager.py"


def _tree(root: Path, version_file: str | None = None) -> Path:
    (root / MANAGER).parent.mkdir(parents=True)
    (root / MANAGER).write_text("# the manager\n")
    if version_file is not None:
        (root / "vllm" / "_version.py").write_text(version_file)
    return root


def test_the_target_forms(tmp_path: Path) -> None:
    assert parse("vllm==0.34.0").kind == "release" and parse("vllm==0.34.0").version == "0.34.0"
    root = _tree(tmp_path / "t", "__version__ = version = '0.34.1.dev3'\n")
    tree = parse(f"vllm@{root}")
    assert tree.kind == "tree" and tree.version == "0.34.1.dev3" and tree.path is not None
    assert parse("vllm").kind == "current"
    assert all(map(is_vllm_target, ["vllm", "vllm==0.1.0", "vllm@."]))
    assert not any(map(is_vllm_target, ["impl", "vllmx", "fault:vllm"]))
    with pytest.raises(ConfigError, match="is not a vLLM source tree"):
        parse(f"vllm@{tmp_path / 'nothing'}")
    with pytest.raises(ConfigError, match=r"not of the form vllm==X\.Y\.Z"):
        parse("vllm==latest")


def test_a_checkout_says_its_version_by_its_tag(tmp_path: Path) -> None:
    root = _tree(tmp_path / "checkout")
    assert tree_version(root) is None  # no _version.py, not a git checkout
    git = ["git", "-C", str(root), "-c", "user.email=k@o", "-c", "user.name=k"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "tree"], check=True)
    subprocess.run([*git, "tag", "v0.29.0"], check=True)
    assert tree_version(root) == "0.29.0"


def test_a_version_is_held_to_its_row_or_the_newest_release_before_it() -> None:
    assert (
        governing_release("0.34.0").model_variant == "inclusive-cpu+window-stale-ids+reset-gpu-only"
    )
    assert governing_release("0.34.1.dev3+g1a2b").version == "0.34.0"
    assert governing_release("0.34.0+g1a2b").version == "0.34.0"
    assert governing_release("0.34.0rc1").version == "0.33.0"  # before 0.34.0
    assert (
        governing_release("0.35.0").model_variant == "inclusive-cpu+window-stale-ids+reset-gpu-only"
    )
    assert governing_release("0.29.7").model_variant == "vllm-0.29"
    assert governing_release(None).model_variant == "fixed"


def test_expect_overrides_the_checks() -> None:
    target = parse("vllm==0.29.0")
    assert len(checks_for(target, None)[1]) == 3
    assert checks_for(target, "conform")[1] == (
        Check(
            "vllm-0.29",
            "conform",
            "both bugs of #53498 and the CPU hits of requests that skip reading modelled",
        ),
    )
    assert checks_for(target, "fixed")[1] == (Check("fixed", "conform", "--expect fixed"),)
    with pytest.raises(ConfigError, match="neither 'conform' nor a model variant"):
        checks_for(target, "nope")


def test_expect_is_for_vllm_targets_only(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--target", "impl", "--expect", "fixed", "--no-mutants"]) == 2
    assert "--expect applies to vLLM targets only" in capsys.readouterr().err


def _copy_of_0_34(root: Path) -> Path:
    """vLLM 0.34.0's sources as a tree of their own (hard links: fast, and the original is
    never written: a planted file is replaced, not edited)."""
    cache = Cache(default_cache())
    if not cache.installed("0.34.0"):
        pytest.skip("vllm==0.34.0 is not installed: kvoffload install vllm==0.34.0")
    shutil.copytree(cache.release("0.34.0") / "vllm", root / "vllm", copy_function=os.link)
    return root


def _verify(target: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvoffload", "verify", "--target", target]
    # the conforming check alone: the row's other check looks for a live bug (a timed
    # campaign cannot promise to meet it)
    command += ["--profile", "fast", "--seconds", "20", "--seed", "1", "--expect", "conform"]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)


def test_a_bug_planted_in_a_copy_of_vllm_is_found(tmp_path: Path) -> None:
    tree = _copy_of_0_34(tmp_path / "tree")
    clean = _verify(f"vllm@{tree}", tmp_path)
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    assert (
        f"vllm@{tree} (0.34.0) vs inclusive-cpu+window-stale-ids+reset-gpu-only: as expected"
        in clean.stdout
    )
    manager = tree / MANAGER
    source = manager.read_text()
    call = "        self._queue_finished_eager_store(request, block_ids)\n"
    assert source.count(call) == 1
    manager.unlink()  # a hard link to the release's file: replace it, never write through
    manager.write_text(source.replace(call, "        pass  # planted: no final flush\n"))
    planted = _verify(f"vllm@{tree}", tmp_path)
    assert planted.returncode == 1, planted.stdout[-3000:] + planted.stderr[-3000:]
    assert (
        "vs inclusive-cpu+window-stale-ids+reset-gpu-only: expected to conform, but it disagrees"
        in (planted.stdout)
    )
    assert "flush" in planted.stdout and "first_disagreement(config, program" in planted.stdout
    release = Cache(default_cache()).release("0.34.0") / MANAGER
    assert call in release.read_text()  # the installed release is untouched
    _replay_on_the_tree(tree, tmp_path, manager)


def test_a_behaviour_change_planted_in_a_copy_of_vllm_is_a_change_to_review(
    tmp_path: Path,
) -> None:
    """Issue 34: a pull request that changes behaviour on purpose is told from one that breaks
    the cache. Another LRU tie-break (a completed store's CPU blocks freed tail first, so that
    a prompt's later blocks are evicted before its first) differs from the model, and the
    verdict says every invariant holds on vLLM's own state."""
    tree = _copy_of_0_34(tmp_path / "tree")
    manager = tree / MANAGER
    source = manager.read_text()
    call = "        self.cpu_block_pool.free_blocks(cpu_blocks)\n        self._gpu_block_pool"
    assert source.count(call) == 1
    manager.unlink()  # a hard link to the release's file: replace it, never write through
    manager.write_text(
        source.replace(
            call,
            "        self.cpu_block_pool.free_blocks(reversed(cpu_blocks))  # planted\n"
            "        self._gpu_block_pool",
        )
    )
    changed = _verify(f"vllm@{tree}", tmp_path)
    assert changed.returncode == 1, changed.stdout[-3000:] + changed.stderr[-3000:]
    assert "DISAGREES: differs from the model, every invariant holding" in changed.stdout
    assert "free queue" in changed.stdout  # the difference: the CPU's eviction order


def _replay_on_the_tree(tree: Path, cwd: Path, manager: Path) -> None:
    """The planted tree's failure names the tree, not the release it says it is: its own file
    (the release's is never overwritten), replayed on the tree while its sources are those
    that failed ("still disagrees", exit 1), on the release only when asked (``--target``),
    refused once the tree has changed (exit 2); the pytest file ``replay`` writes reproduces
    it from this plain environment."""
    saved = sorted((cwd / ".hypothesis" / "kvoffload-failures").glob("vllm-*.json"))
    names = [p.name for p in saved]
    assert [n for n in names if n.startswith("vllm-tree-")] == names, names
    failure = json.loads(saved[0].read_text())
    assert failure["target"]["kind"] == "tree" and failure["target"]["path"] == str(tree)
    assert failure["target"]["digest"] == tree_digest(tree)
    replay = [sys.executable, "-m", "kvoffload", "replay", "--run", str(saved[0])]
    again = subprocess.run(replay, cwd=cwd, capture_output=True, text=True, check=False)
    assert again.returncode == 1, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"still disagrees on vllm@{tree} (sources {tree_digest(tree)[:19]})" in again.stdout
    on_release = [*replay, "--target", "vllm==0.34.0"]
    fixed = subprocess.run(on_release, cwd=cwd, capture_output=True, text=True, check=False)
    assert fixed.returncode == 0, fixed.stdout[-2000:] + fixed.stderr[-2000:]
    assert "no longer disagrees on vllm==0.34.0" in fixed.stdout
    test_file = cwd / "test_regression_tree.py"
    assert main(["replay", str(saved[0]), "--output", str(test_file)]) == 0
    pytest_run = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test_file)]
    reproduced = subprocess.run(pytest_run, cwd=cwd, capture_output=True, text=True, check=False)
    assert reproduced.returncode == 1, reproduced.stdout[-3000:]
    assert "1 failed" in reproduced.stdout and "pending_flushes" in reproduced.stdout
    source = manager.read_text()
    manager.unlink()
    manager.write_text(source + "# the tree moves on\n")
    changed = subprocess.run(replay, cwd=cwd, capture_output=True, text=True, check=False)
    assert changed.returncode == 2, changed.stdout[-2000:] + changed.stderr[-2000:]
    assert "the tree has changed since" in changed.stderr
    assert f"--target vllm@{tree}" in changed.stderr
    skipped = subprocess.run(pytest_run, cwd=cwd, capture_output=True, text=True, check=False)
    assert "1 skipped" in skipped.stdout, skipped.stdout[-2000:]


def test_a_tree_whose_vllm_does_not_import_is_a_broken_setup(tmp_path: Path) -> None:
    if not Cache(default_cache()).ready():
        pytest.skip("no shared environment: kvoffload install vllm==0.34.0")
    root = _tree(tmp_path / "broken", "__version__ = '0.34.0'\n")
    (root / "vllm" / "__init__.py").write_text("raise ImportError('planted: no vllm here')\n")
    run = _verify(f"vllm@{root}", tmp_path)
    assert run.returncode == 3, run.stdout[-2000:] + run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert "Traceback" not in run.stderr
    assert "vLLM 0.34.0 does not import here" in lines[-2] and "planted" in lines[-2]
    assert lines[-1].startswith("kvoffload verify: broken setup: the checks of vllm@")
