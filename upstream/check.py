"""``kvoffload verify --target vllm==X | vllm@PATH | vllm``: the conformance machine on vLLM.

A target (:mod:`kvoffload.upstream.targets`) is held to the checks of its release-table row
(:mod:`kvoffload.upstream.releases`), or to those ``--expect`` names. A release or a tree runs
in the cache's interpreter, one process for all its checks (``python -m
kvoffload.upstream.check RESULT CHECKS PROFILE SECONDS SEED``), which reports back through a
result file; the vLLM of the current environment runs in this process. Each verdict is then
held against the one expected: a check expected to conform must conform; one expected to
disagree must find a disagreement (with the words it names), shrunk and printed.

Exit status: 0 when every check reaches its verdict, 1 when one does not, 3 (a
:class:`SetupError`) when the checks could not run at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvoffload.model.config import OffloadConfig
from kvoffload.model.errors import ConfigError, SetupError
from kvoffload.upstream.install import (
    Cache,
    default_cache,
    install,
    install_environment,
    run_variables,
    write_model,
)
from kvoffload.upstream.releases import Check
from kvoffload.upstream.targets import VllmTarget, checks_for, parse


def check_release(
    target: str,
    profile_name: str | None,
    seconds: float | None,
    install_first: bool,
    expect: str | None = None,
    seed: int | None = None,
    json_path: str | None = None,
) -> int:
    """Check a vLLM target; 0 when every check reaches the verdict expected of it."""
    parsed = parse(target)
    row, checks = checks_for(parsed, expect)
    print(f"{parsed.label}: {row.note}", flush=True)
    args = (checks, profile_name, seconds, seed)
    if parsed.kind == "current":
        results = run_here(parsed, *args)
    else:
        results = run_in_cache(parsed, install_first, *args)
    failed = 0
    verdicts = []
    for check, result in zip(checks, results, strict=True):
        verdict = judge(check, result)
        failed += verdict is not None
        print(f"{parsed.label} vs {check.variant}: {verdict or 'as expected'} ({check.why})")
        verdicts.append(asdict(check) | {"judgement": verdict or "as expected"} | result)
    status = 1 if failed else 0
    if json_path:
        report = {
            "target": parsed.spec,
            "kind": parsed.kind,
            "version": parsed.version,
            "release_row": row.version,
            "exit_status": status,
            "checks": verdicts,
        }
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
    return status


def run_in_cache(
    target: VllmTarget,
    install_first: bool,
    checks: tuple[Check, ...],
    profile_name: str | None,
    seconds: float | None,
    seed: int | None,
) -> list[dict[str, Any]]:
    """The checks in the cache's interpreter, with the release or the tree on its path."""
    cache = Cache(default_cache())
    version = target.version or "unknown"
    if target.kind == "release":
        if install_first:
            install(version, cache)
        elif not cache.installed(version):
            raise ConfigError(
                f"{target.spec} is not installed in {cache.root}; run `kvoffload install "
                f"{target.spec}` or add --install"
            )
    elif install_first:
        install_environment(cache)
    elif not cache.ready():
        raise ConfigError(
            f"the shared environment of {cache.root} is not there; run `kvoffload install "
            "vllm==X.Y.Z` (any release) or add --install"
        )
    with tempfile.TemporaryDirectory() as folder:
        result_file = Path(folder) / "result.json"
        command = [str(cache.python), "-m", "kvoffload.upstream.check", str(result_file)]
        command += [json.dumps([asdict(c) for c in checks]), profile_name or ""]
        command += ["" if seconds is None else str(seconds), "" if seed is None else str(seed)]
        run = subprocess.run(command, env=cache.environment(version, target.path), check=False)
        if not result_file.exists():
            raise SetupError(
                f"the checks of {target.label} did not finish (exit {run.returncode}): its "
                "environment failed before any verdict, see the output above"
            )
        results: list[dict[str, Any]] = json.loads(result_file.read_text())
    return results


def run_here(
    target: VllmTarget,
    checks: tuple[Check, ...],
    profile_name: str | None,
    seconds: float | None,
    seed: int | None,
) -> list[dict[str, Any]]:
    """The checks in this process, on the vLLM it imports."""
    if target.version is None:
        raise SetupError("no vLLM is installed in this environment (--target vllm)")
    cache = Cache(default_cache())
    write_model(cache)
    os.environ.update(run_variables(cache.model) | {"KVOFFLOAD_VLLM_VERSION": target.version})
    return run_checks(target.version, checks, profile_name, seconds, seed)


def judge(check: Check, result: dict[str, Any]) -> str | None:
    """What is wrong with ``result`` for ``check``, or None when it is as expected."""
    if check.expect == "conform":
        return None if result["conforms"] else "expected to conform, but it disagrees"
    if result["conforms"]:
        return "expected a disagreement, none found"
    if check.finds and check.finds not in result["disagreement"]:
        return f"expected a disagreement in {check.finds!r}, found another"
    return None


def run_checks(
    version: str,
    checks: tuple[Check, ...],
    profile_name: str | None,
    seconds: float | None,
    seed: int | None = None,
) -> list[dict[str, Any]]:
    """Every check, in this process (vLLM must import here)."""
    from kvoffload.testing import profiles
    from kvoffload.testing.campaign import print_result, run_campaign
    from kvoffload.testing.failure import validate

    try:
        import vllm  # noqa: F401
    except Exception as error:  # an environment that cannot even import vLLM
        raise SetupError(f"vLLM {version} does not import here: {error!r}") from error
    profile = profiles.load(profile_name)
    warm_up()
    results = []
    for check in checks:
        print(f"\n== vllm {version} vs the model variant {check.variant}: {check.why}")
        # A random profile's example database (none under ci) replays this check's
        # earlier failures first, also when the campaign runs for --seconds.
        outcome = run_campaign(
            "vllm",
            profile,
            seconds,
            progress=True,
            variant=check.variant,
            seed=seed,
            database=profile.database,
        )
        print_result(outcome, where=f" (in the environment of vllm {version})")
        failure = outcome.failure
        rec = outcome.recorder
        results.append(
            {
                "variant": check.variant,
                "conforms": outcome.conforms,
                "seconds": round(outcome.seconds, 1),
                "seed": outcome.seed,
                "programs": rec.programs,
                "rule_steps": rec.rule_steps,
                "driver_calls": rec.steps,
                "seconds_to_first_failure": outcome.first_failure,
                "programs_to_first_failure": rec.first_failing_program,
                "disagreement": None if failure is None else failure["disagreement"],
                "failure": failure,
                "reproducer": None if failure is None else validate(failure).reproducer(),
                "saved": None if outcome.saved is None else str(outcome.saved.absolute()),
            }
        )
    return results


def warm_up() -> None:
    """Pay before any campaign's clock starts what its first program would pay inside it:
    vLLM's lazy imports and its model registry's inspection (a subprocess, seconds), and
    Hypothesis's scan of the modules loaded for constants. Seconds to the first failure
    are then the machine's alone (issue 13: import excluded)."""
    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st

    from kvoffload.upstream.target import VllmOffload

    try:
        VllmOffload(OffloadConfig(4, 2, (4,), 4, 1))
    except Exception as error:
        raise SetupError(f"vLLM's offload scheduler cannot be built here: {error!r}") from error

    @settings(max_examples=1, database=None, phases=[Phase.generate])
    @given(st.integers())
    def draw_once(_: int) -> None:
        pass

    draw_once()


def main(argv: list[str]) -> int:
    """The release's process: its checks' results into ``RESULT``; exit status 3 and one
    line, without a result, when the environment cannot run them."""
    result_file, checks, profile_name, seconds, seed = argv
    try:
        results = run_checks(
            os.environ["KVOFFLOAD_VLLM_VERSION"],
            tuple(Check(**c) for c in json.loads(checks)),
            profile_name or None,
            float(seconds or 0) or None,
            int(seed) if seed else None,
        )
    except SetupError as error:
        print(f"broken setup: {error}", file=sys.stderr)
        return 3
    Path(result_file).write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
