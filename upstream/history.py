"""``kvoffload history``: the real bugs of vLLM's SimpleCPUOffload connector, found again.

For each bug of :data:`kvoffload.upstream.bugs.BUGS` in the model's reach, two checks run on
vLLM's own code, each release in its own process (:mod:`kvoffload.upstream.check`):

1. the last release with the bug against its ``isolation`` model (the first fixed release's
   model with the release's other bugs modelled): the machine must disagree by itself, and
   its first difference must name the bug (``finds``);
2. the first release with the fix against its own model: it must conform.

With ``--releases`` every release of the table (:mod:`kvoffload.vllm_target.releases`, 0.19.0 to
0.34.0) is also held to its own row's checks. The bug table, the totals (the median seconds to
the first failure among the bugs found, vLLM's import excluded) and the release table are
printed; ``--write`` renders them as ``docs/history.md``.

Invariants: a bug counts as found only when its buggy release disagreed with the words it
must name and its fixed release conformed, in the same run; every figure written comes from
the run that writes it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.model.errors import ConfigError
from kvoffload.testing.words import without_words
from kvoffload.upstream.bugs import HistoricalBug, select
from kvoffload.upstream.check import judge, run_in_cache
from kvoffload.upstream.install import Cache, default_cache
from kvoffload.vllm_target.forms import parse
from kvoffload.vllm_target.releases import RELEASES, Check, release_numbers

DEFAULT_PROFILE = "ci"  # derandomized: the same programs, so the same figures, on every run
TARGET_MEDIAN_SECONDS = 10.0

Outcomes = dict[tuple[str, Check], dict[str, Any]]


@dataclass
class BugResult:
    bug: HistoricalBug
    found: bool
    fixed_conforms: bool
    seconds_to_first_failure: float | None
    programs_to_first_failure: int | None
    shrunk_rules: int | None
    shrunk_calls: int | None
    first_difference: str | None
    problem: str | None  # why the bug does not count as found

    @property
    def counted(self) -> bool:
        return self.found and self.fixed_conforms


@dataclass
class ReleaseResult:
    version: str
    check: Check
    problem: str | None  # None: the verdict expected
    outcome: dict[str, Any]


def checks_by_release(bugs: list[HistoricalBug], releases: bool = False) -> dict[str, list[Check]]:
    """Each release's checks, once each, so that a release runs in one process; with
    ``releases``, every release of the table with its own row's checks too. In release
    order."""
    plan: dict[str, list[Check]] = {}

    def add(version: str, check: Check) -> None:
        if check not in plan.setdefault(version, []):
            plan[version].append(check)

    for bug in bugs:
        if bug.in_scope:
            add(bug.buggy, bug.buggy_check())
            add(bug.fixed, bug.fixed_check())
    if releases:
        for version, row in RELEASES.items():
            for check in row.checks:
                add(version, check)
    return dict(sorted(plan.items(), key=lambda item: release_numbers(item[0]) or ()))


def run_history(
    only: str | None,
    profile_name: str | None,
    seconds: float | None,
    install_first: bool,
    write: str | None,
    releases: bool = False,
    json_path: str | None = None,
) -> int:
    """``kvoffload history``: 0 when every bug in reach is found and its fix conforms (and,
    with ``releases``, every release reaches its row's verdicts); 1 otherwise. With
    ``json_path``, the same as JSON (:func:`report`)."""
    bugs = select(only)
    plan = checks_by_release(bugs, releases)
    profile_name = profile_name or DEFAULT_PROFILE
    cache = Cache(default_cache())
    missing = [v for v in plan if not cache.installed(v)]
    if missing and not install_first:
        raise ConfigError(
            f"releases {', '.join(missing)} are not installed; add --install, or run "
            "`kvoffload install vllm==X.Y.Z` for each"
        )
    started = time.perf_counter()
    outcomes: Outcomes = {}
    for n, (version, checks) in enumerate(plan.items(), 1):
        print(
            f"\n=== vllm=={version}: {len(checks)} checks (release {n} of {len(plan)}, "
            f"{time.perf_counter() - started:.0f} s so far)",
            flush=True,
        )
        target = parse(f"vllm=={version}")
        ran = run_in_cache(target, install_first, tuple(checks), profile_name, seconds, None)
        outcomes.update(((version, c), r) for c, r in zip(checks, ran, strict=True))
    results = [summarize(bug, outcomes) for bug in bugs]
    release_results = release_verdicts(outcomes) if releases else []
    print("\n" + table(results))
    print(totals(results))
    if release_results:
        print("\n" + release_table(release_results))
        print(release_totals(release_results))
    if write:
        elapsed = time.perf_counter() - started
        Path(write).write_text(
            page(results, release_results, command(only, profile_name, seconds, releases), elapsed)
        )
        print(f"written to {write}")
    ok = all(r.counted for r in results if r.bug.in_scope)
    status = 0 if ok and all(r.problem is None for r in release_results) else 1
    if json_path:
        document = report(results, release_results, profile_name, status)
        Path(json_path).write_text(json.dumps(document, indent=1) + "\n")
    return status


def report(
    results: list[BugResult], releases: list[ReleaseResult], profile_name: str, status: int
) -> dict[str, Any]:
    """The run as JSON (``kvoffload history --json``): every bug (found, its fix conforming,
    the figures, the first difference or why it does not count), every release's verdicts."""
    return {
        "profile": profile_name,
        "exit_status": status,
        "bugs_found": sum(r.counted for r in results),
        "bugs_in_reach": sum(r.bug.in_scope for r in results),
        "median_seconds_to_first_failure": median_seconds(results),
        "bugs": [
            {
                "id": r.bug.id,
                "reference": r.bug.ref,
                "title": r.bug.title,
                "last_buggy": r.bug.buggy,
                "fixed_in": r.bug.fixed,
                "in_reach": r.bug.in_scope,
                "found": r.found,
                "fixed_conforms": r.fixed_conforms,
                "counted": r.counted,
                "seconds_to_first_failure": r.seconds_to_first_failure,
                "programs_to_first_failure": r.programs_to_first_failure,
                "shrunk_rules": r.shrunk_rules,
                "shrunk_calls": r.shrunk_calls,
                "first_difference": r.first_difference,
                "problem": r.problem if r.bug.in_scope else r.bug.out_of_reach,
            }
            for r in results
        ],
        "releases": [
            {
                "release": r.version,
                "variant": r.check.variant,
                "expect": r.check.expect,
                "why": r.check.why,
                "as_expected": r.problem is None,
                "problem": r.problem,
                "disagreement": r.outcome.get("disagreement"),
            }
            for r in releases
        ],
    }


def summarize(bug: HistoricalBug, outcomes: Outcomes) -> BugResult:
    if not bug.in_scope:
        return BugResult(bug, False, False, None, None, None, None, None, bug.out_of_reach)
    buggy = outcomes[(bug.buggy, bug.buggy_check())]
    fixed = outcomes[(bug.fixed, bug.fixed_check())]
    problem = judge(bug.buggy_check(), buggy)
    fixed_problem = judge(bug.fixed_check(), fixed)
    failure = buggy.get("failure")
    return BugResult(
        bug,
        problem is None,
        fixed_problem is None,
        buggy.get("seconds_to_first_failure"),
        buggy.get("programs_to_first_failure"),
        None if failure is None else failure["rule_steps"],
        None if failure is None else len(failure["program"]),
        buggy.get("disagreement"),
        problem or (None if fixed_problem is None else f"vllm=={bug.fixed}: {fixed_problem}"),
    )


def release_verdicts(outcomes: Outcomes) -> list[ReleaseResult]:
    """Every release of the table, judged on its own row's checks."""
    return [
        ReleaseResult(version, check, judge(check, outcomes[(version, check)]), outcomes[key])
        for version, row in RELEASES.items()
        for check in row.checks
        if (key := (version, check)) in outcomes
    ]


def table(results: list[BugResult]) -> str:
    lines = [
        "| bug | reference | last with the bug → fixed in | found | seconds to first failure "
        "| programs to first failure | shrunk: rules (calls) | the fixed release conforms "
        "| first difference, or why not |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        b = r.bug
        if not b.in_scope:
            lines.append(
                f"| {b.id} | {b.ref} | {b.buggy} → {b.fixed} | not yet reachable | - | - | - | - "
                f"| needs {b.out_of_reach} |"
            )
            continue
        first = "-" if r.seconds_to_first_failure is None else f"{r.seconds_to_first_failure:.1f}"
        programs = "-" if r.programs_to_first_failure is None else str(r.programs_to_first_failure)
        shrunk = "-" if r.shrunk_rules is None else f"{r.shrunk_rules} ({r.shrunk_calls})"
        what = r.problem or _short(r.first_difference or "")
        lines.append(
            f"| {b.id} | {b.ref} | {b.buggy} → {b.fixed} | {'yes' if r.found else 'NO'} "
            f"| {first} | {programs} | {shrunk} | {'yes' if r.fixed_conforms else 'NO'} "
            f"| {what} |"
        )
    return "\n".join(lines)


def _short(difference: str, limit: int = 160) -> str:
    """A difference in one table cell. Where a result and the state both differ, the call
    and the state's fields come first: they name the cause, the result its effect."""
    text = without_words(difference).replace("|", "/").replace("\n", " ")
    call, sep, state = text.partition("; snapshots differ in ")
    if sep:
        text = (
            f"{call.partition(': model returned')[0]}: results differ; snapshots differ in {state}"
        )
    return text if len(text) <= limit else text[: limit - 1] + "…"


def median_seconds(results: list[BugResult]) -> float | None:
    """The median seconds to the first failure among the bugs found (fix conforming)."""
    times = [
        r.seconds_to_first_failure
        for r in results
        if r.counted and r.seconds_to_first_failure is not None
    ]
    return statistics.median(times) if times else None


def totals(results: list[BugResult]) -> str:
    scope = [r for r in results if r.bug.in_scope]
    found = [r for r in scope if r.counted]
    median = median_seconds(results)
    shown = "-" if median is None else f"{median:.1f} s"
    met = median is not None and median <= TARGET_MEDIAN_SECONDS
    verdict = "" if median is None else (" (met)" if met else " (MISSED)")
    return (
        f"{len(found)} of {len(scope)} bugs in reach found, each fix conforming; "
        f"{len(results) - len(scope)} of {len(results)} not yet reachable; median seconds to "
        f"the first failure {shown}, target {TARGET_MEDIAN_SECONDS:.0f} s{verdict} (vLLM's "
        "import excluded)"
    )


def release_table(results: list[ReleaseResult]) -> str:
    lines = [
        "| release | compared with | expected | verdict | programs | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        got = "conforms" if r.outcome["conforms"] else "disagrees"
        verdict = f"{got}, as expected" if r.problem is None else f"{got}: {r.problem}"
        lines.append(
            f"| {r.version} | `{r.check.variant}` | {r.check.expect} | {verdict} "
            f"| {r.outcome['programs']} | {r.outcome['seconds']:.0f} |"
        )
    return "\n".join(lines)


def release_totals(results: list[ReleaseResult]) -> str:
    versions = dict.fromkeys(r.version for r in results)
    failed = dict.fromkeys(r.version for r in results if r.problem is not None)
    return (
        f"{len(versions) - len(failed)} of {len(versions)} releases reach every verdict "
        f"expected of them" + (f"; not: {', '.join(failed)}" if failed else "")
    )


def command(only: str | None, profile_name: str, seconds: float | None, releases: bool) -> str:
    """The command line that reproduces a run (written into the page)."""
    parts = ["kvoffload history"]
    if only:
        parts.append(f"--only {only}")
    if releases:
        parts.append("--releases")
    parts.append(f"--profile {profile_name}")
    if seconds:
        parts.append(f"--seconds {seconds:g}")
    return " ".join(parts) + " --write docs/history.md"


def page(
    results: list[BugResult], release_results: list[ReleaseResult], how: str, elapsed: float
) -> str:
    methods = "\n".join(
        f"- **{r.bug.id}** ({r.bug.title}): vllm=={r.bug.buggy} against `{r.bug.isolation}` "
        f"({r.bug.method}); the first difference must name "
        f"{' or '.join(f'`{w}`' for w in (r.bug.finds or '').split('|'))}; "
        f"vllm=={r.bug.fixed} against `{r.bug.fixed_variant}`."
        for r in results
        if r.bug.in_scope
    )
    needs: dict[str, list[str]] = {}
    for r in results:
        if not r.bug.in_scope:
            needs.setdefault(str(r.bug.out_of_reach), []).append(r.bug.id)
    releases = ""
    if release_results:
        releases = f"""
## Every release, against its own model

Each release of the table (`kvoffload/vllm_target/releases.py`) held to its row's checks, in its
own environment of the cache:

{release_table(release_results)}

{release_totals(release_results)}
"""
    return (
        f"""# The bug history: vLLM's SimpleCPUOffload bugs, found again

Generated on {time.strftime("%Y-%m-%d")} by `{how}` ({elapsed / 60:.0f} minutes on a
machine with {os.cpu_count()} cores, no GPU). The history (`kvoffload/upstream/bugs.py`) is
the list of the 29 bugs fixed upstream in vLLM's SimpleCPUOffload connector between 0.19.0
and 0.34.0, each with the last release that has it and the first with its fix, as read from
the shipped wheels. For each bug in the model's reach the conformance machine drives the
last release with the bug against the model of the first release with the fix in which the
release's other bugs are modelled, so that the first difference can only be this bug, and
must disagree by itself, the first difference naming the bug; and the release with the fix
must conform to its own model. Seconds are from the start of the campaign to the first
failing program, vLLM's import and first configuration excluded (the campaign warms them up
first); programs are those run up to and including the first failing one; rules and calls
are those of the shrunk, reduced counterexample.

{table(results)}

{totals(results)}

## How each bug is isolated

{methods}

The model variants are in `kvoffload/model/variants.py` (`docs/spec.md` lists them); `A+B`
composes two.

## What makes finding fast

- Each release's process builds one configuration of vLLM's objects and runs one Hypothesis
  example before the campaign's clock starts: vLLM's lazy imports, its model registry's
  inspection and Hypothesis's scan of the loaded modules are paid once, outside the figures.
- The `evict` rule (`docs/conformance.md`) reaches in one rule the states most of these bugs
  need: an earlier prompt's blocks on the CPU and not on the GPU; with its filler held, a CPU
  hit pinned while its allocation fails (S1), then a reset while the pin is held (S21).
- Hypothesis chooses the rules of each program by swarm testing: every program draws which
  rules are enabled, so that some programs are made of a few kinds of rule only.
- Under a random profile (`--profile fast` or `nightly`) the example database replays the
  failures each check found before, for the same release and model variant, first. The
  figures above are from the derandomized `ci` profile, which has no database: every bug is
  found from scratch.
{releases}
## Not yet reachable

"""
        + "\n".join(f"- needs {need}: {', '.join(ids)}" for need, ids in needs.items())
        + "\n"
    )
