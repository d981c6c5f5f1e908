"""``kvoffload verify --target vllm==X``: the conformance machine on a vLLM release.

The checks of a release (:mod:`kvoffload.upstream.releases`) run in one process, in the
cache's interpreter with the release on its path (``python -m kvoffload.upstream.check``,
which reads the release from ``KVOFFLOAD_VLLM_VERSION``), and report back through a result
file. Each verdict is then held against the one expected: a check expected to conform must
conform; one expected to disagree must find a disagreement (with the words it names), and
its shrunk counterexample is printed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvoffload.model.errors import ConfigError
from kvoffload.upstream.install import Cache, default_cache, install, parse_target
from kvoffload.upstream.releases import Check, release


def check_release(
    target: str, profile_name: str | None, seconds: float | None, install_first: bool
) -> int:
    """Check ``vllm==X``; 0 when every check reaches the verdict expected of it."""
    version = parse_target(target)
    cache = Cache(default_cache())
    if install_first:
        install(version, cache)
    elif not cache.installed(version):
        raise ConfigError(
            f"vllm=={version} is not installed in {cache.root}; run `kvoffload install "
            f"vllm=={version}` or add --install"
        )
    row = release(version)
    print(f"vllm=={version}: {row.note}", flush=True)
    with tempfile.TemporaryDirectory() as folder:
        result_file = Path(folder) / "result.json"
        command = [str(cache.python), "-m", "kvoffload.upstream.check", str(result_file)]
        command += [profile_name or "", "" if seconds is None else str(seconds)]
        run = subprocess.run(command, env=cache.environment(version), check=False)
        if not result_file.exists():
            print(f"vllm=={version}: the checks did not finish (exit {run.returncode})")
            return run.returncode or 1
        results = json.loads(result_file.read_text())
    failed = 0
    for check, result in zip(row.checks, results, strict=True):
        verdict = judge(check, result)
        failed += verdict is not None
        print(f"vllm=={version} vs {check.variant}: {verdict or 'as expected'} ({check.why})")
    return 1 if failed else 0


def judge(check: Check, result: dict[str, Any]) -> str | None:
    """What is wrong with ``result`` for ``check``, or None when it is as expected."""
    if check.expect == "conform":
        return None if result["conforms"] else "expected to conform, but it disagrees"
    if result["conforms"]:
        return "expected a disagreement, none found"
    if check.finds and check.finds not in result["disagreement"]:
        return f"expected a disagreement in {check.finds!r}, found another"
    return None


def run_checks(version: str, profile_name: str | None, seconds: float | None) -> list[Any]:
    """Every check of ``version``, in this process (vLLM must import here)."""
    from kvoffload.testing import profiles
    from kvoffload.testing.campaign import print_result, run_campaign

    profile = profiles.load(profile_name)
    results = []
    for check in release(version).checks:
        print(f"\n== vllm=={version} vs the model variant {check.variant}: {check.why}")
        outcome = run_campaign("vllm", profile, seconds, progress=True, variant=check.variant)
        print_result(outcome, where=f" (in the environment of vllm=={version})")
        failure = outcome.failure
        results.append(
            {
                "variant": check.variant,
                "conforms": outcome.conforms,
                "seconds": round(outcome.seconds, 1),
                "disagreement": None if failure is None else failure["disagreement"],
                "failure": failure,
            }
        )
    return results


def main(argv: list[str]) -> int:
    result_file, profile_name, seconds = argv
    results = run_checks(
        os.environ["KVOFFLOAD_VLLM_VERSION"], profile_name or None, float(seconds or 0) or None
    )
    Path(result_file).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
