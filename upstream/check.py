"""``kvoffload verify --target vllm==X | vllm@PATH | vllm``: the conformance machine on vLLM.

A target (:mod:`kvoffload.vllm_target.forms`) is held to the checks of its release-table row
(:mod:`kvoffload.vllm_target.releases`), or to those ``--expect`` names. A release or a tree runs
in the cache's interpreter, one process for all its checks (``python -m
kvoffload.upstream.check RESULT CHECKS PROFILE SECONDS SEED``), which reports back through a
result file; the vLLM of the current environment runs in this process. Each verdict is then
held against the one expected: a check expected to conform must conform; one expected to
disagree must find a disagreement (with the words it names), shrunk and printed.

With ``--coverage`` the process of the checks also measures how much of vLLM's offload code
they reach (:mod:`kvoffload.upstream.reach`), from before vLLM's import; the figures come back
through a second file (``KVOFFLOAD_COVERAGE``, and ``KVOFFLOAD_COVERAGE_HTML`` for the
annotated source) and are printed as a table per file.

Exit status: 0 when every check reaches its verdict, 1 when one does not, 3 (a
:class:`SetupError`) when the checks could not run at all.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvoffload.model.config import OffloadConfig
from kvoffload.model.errors import ConfigError, SetupError
from kvoffload.testing import isolation
from kvoffload.testing.failure import model_broke
from kvoffload.upstream.install import (
    Cache,
    default_cache,
    install,
    install_environment,
    run_variables,
    write_model,
)
from kvoffload.upstream.reach import (
    INSTALL,
    FileReach,
    Recorder,
    load,
    missed_lines,
    reachable_summary,
    table,
)
from kvoffload.vllm_target.forms import (
    TARGET_VARIABLE,
    VllmTarget,
    checks_for,
    describe,
    parse,
    running_identity,
)
from kvoffload.vllm_target.releases import Check

COVERAGE_FILE = "KVOFFLOAD_COVERAGE"  # where the process of the checks writes its figures
COVERAGE_HTML = "KVOFFLOAD_COVERAGE_HTML"  # where it writes the annotated source, if set


def check_release(
    target: str,
    profile_name: str | None,
    seconds: float | None,
    install_first: bool,
    expect: str | None = None,
    seed: int | None = None,
    json_path: str | None = None,
    coverage: bool = False,
    coverage_html: str | None = None,
) -> int:
    """Check a vLLM target; 0 when every check reaches the verdict expected of it. With
    ``coverage`` (or ``coverage_html``, a folder for the annotated source), also print how
    much of vLLM's offload code the checks reached."""
    parsed = parse(target)
    row, checks = checks_for(parsed, expect)
    print(f"{parsed.label}: {row.note}", flush=True)
    args = (checks, profile_name, seconds, seed)
    reaches: list[FileReach] | None = None
    with tempfile.TemporaryDirectory() as folder:
        measure = {}
        if coverage or coverage_html:
            measure[COVERAGE_FILE] = str(Path(folder) / "coverage.json")
            if coverage_html:
                measure[COVERAGE_HTML] = str(Path(coverage_html).absolute())
        if parsed.kind == "current":
            results = run_here(parsed, *args, measure=measure)
        else:
            results = run_in_cache(parsed, install_first, *args, measure=measure)
        if measure:
            reaches = load(Path(measure[COVERAGE_FILE]))
    if reaches is not None:
        print_reach(parsed.label, reaches, coverage_html)
    failed = broken = 0
    verdicts = []
    for check, result in zip(checks, results, strict=True):
        verdict = judge(check, result)
        failed += verdict is not None
        broken += (
            result["disagreement"] is not None and model_broke(result["disagreement"]) is not None
        )
        on = {"scheduler": " (vLLM's scheduler)", "worker": " (vLLM's worker)"}.get(
            check.machine, ""
        )
        print(f"{parsed.label}{on} vs {check.variant}: {verdict or 'as expected'} ({check.why})")
        verdicts.append(asdict(check) | {"judgement": verdict or "as expected"} | result)
    # A model that breaks its own invariant is no verdict on vLLM: a bug of the specification
    # (exit status 3), whatever the other checks say.
    status = 3 if broken else 1 if failed else 0
    if json_path:
        report = {
            "target": parsed.spec,
            "kind": parsed.kind,
            "version": parsed.version,
            "release_row": row.version,
            "exit_status": status,
            "checks": verdicts,
        }
        if reaches is not None:
            report["coverage"] = [r.as_json() for r in reaches]
        Path(json_path).write_text(json.dumps(report, indent=1) + "\n")
    return status


def run_in_cache(
    target: VllmTarget,
    install_first: bool,
    checks: tuple[Check, ...],
    profile_name: str | None,
    seconds: float | None,
    seed: int | None,
    measure: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The checks in the cache's interpreter, with the release or the tree on its path;
    ``measure``: the coverage variables for that process (none: no coverage)."""
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
    with isolation.own_folder() as folder:
        result_file = folder / "result.json"
        command = isolation.python_command(
            cache.python,
            "kvoffload.upstream.check",
            str(result_file),
            json.dumps([asdict(c) for c in checks]),
            profile_name or "",
            "" if seconds is None else str(seconds),
            "" if seed is None else str(seed),
        )
        env = cache.environment(version, target.path, target.identity()) | (measure or {})
        run = isolation.run(command, env, folder)
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
    measure: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """The checks in this process, on the vLLM it imports (measured as ``measure`` says:
    from here on, so vLLM's modules already imported show their top level as missed)."""
    if target.version is None:
        raise SetupError("no vLLM is installed in this environment (--target vllm)")
    cache = Cache(default_cache())
    write_model(cache)
    os.environ.update(
        run_variables(cache.model)
        | {
            "KVOFFLOAD_VLLM_VERSION": target.version,
            TARGET_VARIABLE: json.dumps(target.identity(), sort_keys=True),
        }
    )
    return measured_checks(measure or {}, target.version, checks, profile_name, seconds, seed)


def measured_checks(
    measure: dict[str, str],
    version: str,
    checks: tuple[Check, ...],
    profile_name: str | None,
    seconds: float | None,
    seed: int | None,
) -> list[dict[str, Any]]:
    """:func:`run_checks`, under coverage.py when ``measure`` names a figures file."""
    if COVERAGE_FILE not in measure:
        return run_checks(version, checks, profile_name, seconds, seed)
    try:
        recorder = Recorder()
    except ModuleNotFoundError as error:
        raise SetupError(
            f"--coverage needs coverage.py beside vLLM {version} ({error}): `kvoffload install "
            f"vllm=={version}` adds it to the cache's environment (`pip install {INSTALL}` "
            "for --target vllm)"
        ) from error
    recorder.start()
    try:
        results = run_checks(version, checks, profile_name, seconds, seed)
    finally:
        html = measure.get(COVERAGE_HTML)
        recorder.finish(Path(measure[COVERAGE_FILE]), Path(html) if html else None)
    return results


def print_reach(label: str, reaches: list[FileReach], html: str | None) -> None:
    """The coverage table, and the lines each file missed."""
    print(f"\n{label}: vLLM's offload code reached by the checks (coverage.py, branches on)")
    for line in table(reaches):
        print(line)
    for reach in reaches:
        if reach.missing_lines:
            print(f"{reach.path} missed lines: {missed_lines(reach)}")
    for reach in reaches:
        if reach.unreachable or reach.ran_unreachable or reach.unlocated:
            print(reachable_summary(reach))
    if html:
        print(f"annotated source: {Path(html) / 'index.html'}")


def judge(check: Check, result: dict[str, Any]) -> str | None:
    """What is wrong with ``result`` for ``check``, or None when it is as expected."""
    invariant = None if result["conforms"] else model_broke(result["disagreement"])
    if invariant is not None:
        return (
            f"the model broke {invariant} on the program saved: a bug of the specification, "
            "not a verdict on vLLM"
        )
    if check.expect == "conform":
        return None if result["conforms"] else "expected to conform, but it disagrees"
    if result["conforms"]:
        return "expected a disagreement, none found"
    # ``finds`` may name alternatives, ``a|b``: the ways the bug can show first.
    if check.finds and not any(w in result["disagreement"] for w in check.finds.split("|")):
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
    from kvoffload.testing.campaign import check_record, print_result, run_campaign

    try:
        import vllm  # noqa: F401
    except Exception as error:  # an environment that cannot even import vLLM
        raise SetupError(f"vLLM {version} does not import here: {error!r}") from error
    profile = profiles.load(profile_name)
    warm_up()
    results = []
    for check in checks:
        print(f"\n== vllm {version} vs the model variant {check.variant}: {check.why}")
        if check.machine in ("scheduler", "worker"):
            results.append(scheduler_check(check, profile, seconds, seed, version))
            continue
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
        print_result(outcome, where=f" (with {running_target(version)})")
        results.append(check_record(outcome, check.variant))
    return results


def scheduler_check(
    check: Check, profile: Any, seconds: float | None, seed: int | None, version: str
) -> dict[str, Any]:
    """``check`` on the machine over vLLM's own scheduler (with its workers, for the worker
    machine), its verdict printed."""
    from kvoffload.testing.scheduler_machine import run_scheduler_check

    workers = check.machine == "worker"
    result = run_scheduler_check(check.variant, profile, seconds, seed, workers=workers)
    verdict = "conforms" if result["conforms"] else f"disagrees: {result['disagreement']}"
    print(
        f"vLLM's {'worker' if workers else 'scheduler'} (with {running_target(version)}): "
        f"{verdict} "
        f"({result['programs']} programs, {result['driver_calls']} calls, "
        f"{result['seconds']} s)"
    )
    if result["reproducer"]:
        print(f"reproduce with:\n{result['reproducer']}")
    return result


def running_target(version: str) -> str:
    """The target this process runs, in words (``vllm@PATH (sources sha256:...)``)."""
    identity = running_identity()
    return describe(identity) if identity is not None else f"vllm {version}"


def warm_up() -> None:
    """Pay before any campaign's clock starts what its first program would pay inside it:
    vLLM's lazy imports and its model registry's inspection (a subprocess, seconds), and
    Hypothesis's scan of the modules loaded for constants. Seconds to the first failure
    are then the machine's alone (issue 13: import excluded)."""
    from hypothesis import Phase, given, settings
    from hypothesis import strategies as st

    from kvoffload.vllm_target.offload import VllmOffload

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
        results = measured_checks(
            {k: os.environ[k] for k in (COVERAGE_FILE, COVERAGE_HTML) if k in os.environ},
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
