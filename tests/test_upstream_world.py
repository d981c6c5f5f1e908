"""vLLM's own offload objects built from a configuration, in each installed release.
Skipped (with the command that installs it) where a release is not in the cache."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvoffload.upstream.install import Cache, default_cache

RELEASES = ["0.29.0", "0.30.0", "0.34.0"]


@pytest.mark.parametrize("version", RELEASES)
def test_vllm_builds_the_pools_the_configuration_asks_for(version: str) -> None:
    cache = Cache(default_cache())
    if not cache.installed(version):
        pytest.skip(f"vllm=={version} is not installed: kvoffload install vllm=={version}")
    run = subprocess.run(
        [str(cache.python), "-m", "kvoffload.vllm_target.probe"],
        env=cache.environment(version),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    # vLLM logs to standard output too: keep the probe's lines
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [line["config"] for line in lines] == [[8, 4], [10, 6], [8, 5], [8, 5]]
    for line in lines[:3]:
        assert line["version"] == version
        assert (line["gpu_blocks"], line["cpu_blocks"]) == tuple(line["config"])
    assert lines[1]["cpu_groups"] == 2
    assert "single KV group" in lines[3]["unsupported"]
