"""``kvoffload history``: the real bugs of vLLM's SimpleCPUOffload connector, found again.

The history (``BUGS``) is the list of the 29 bugs fixed upstream between vLLM 0.19.0 and
0.34.0, with the last release that has each and the first with its fix, read from the
shipped wheels. For each bug in the model's reach, two checks run on vLLM's own code:

1. the last release with the bug, against the model of the first release with the fix in
   which the release's *other* bugs are modelled (``isolation``, a composed model variant):
   the machine must disagree by itself, and its first difference must be that bug
   (``finds``: words the difference names);
2. the first release with the fix, against its own model variant: it must conform.

A bug out of reach says why (a feature the model does not have yet: hybrid groups, lazy
mode, preemption; or the worker's side, which needs a GPU). ``--write`` renders the table
as ``docs/history.md``.

Invariant: a bug counts as found only when the buggy release disagreed with the words it
must name and the fixed release conformed, in the same run.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.model.errors import ConfigError
from kvoffload.upstream.check import judge, run_in_cache
from kvoffload.upstream.install import Cache, default_cache
from kvoffload.upstream.releases import Check
from kvoffload.upstream.targets import parse


@dataclass(frozen=True)
class HistoricalBug:
    id: str
    ref: str
    title: str
    buggy: str  # the last release with the bug
    fixed: str  # the first release with its fix
    isolation: str | None = None  # the model the buggy release is compared with
    fixed_variant: str | None = None  # the model the fixed release conforms to
    finds: str | None = None  # what the first difference must name
    method: str = ""  # how the bug is isolated from the buggy release's other bugs
    out_of_reach: str | None = None  # why the machine cannot reach it yet

    @property
    def in_scope(self) -> bool:
        return self.out_of_reach is None


# vLLM 0.29.0's other bugs and its selection loop, which the fixed model of 0.30.0 has not.
_S10 = "bug-53498-primary-only"
_S9 = "bug-53498-no-final-flush"
BUGS: list[HistoricalBug] = [
    HistoricalBug(
        "S1",
        "#39702, PR #42289",
        "CPU hits not pinned between lookup and allocation (TOCTOU)",
        "0.21.0",
        "0.22.0",
        "vllm-0.23+step-dedup",
        "vllm-0.23",
        "pending_hits",
        "0.21.0's other bug (S2) modelled",
    ),
    HistoricalBug(
        "S2",
        "PR #41289",
        "in-flight stores deduplicated within a step only: a block stored twice",
        "0.21.0",
        "0.22.0",
        "vllm-0.23+no-hit-pins",
        "vllm-0.23",
        "in_flight_gpu_blocks",
        "0.21.0's other bug (S1) modelled",
    ),
    HistoricalBug(
        "S3",
        "PR #42296",
        "scheduler vs hash block size; masked sliding-window blocks",
        "0.21.0",
        "0.22.0",
        out_of_reach="sliding-window groups of another block size",
    ),
    HistoricalBug(
        "S4",
        "#45704, PR #46278",
        "store copy not fenced after the step's compute",
        "0.23.0",
        "0.24.0",
        out_of_reach="the worker's copy streams (a GPU target); the implementation has it "
        "as the fault store-skips-compute-wait",
    ),
    HistoricalBug(
        "S5",
        "PR ?",
        "load_event_to_reqs handed to the metadata by reference",
        "0.23.0",
        "0.24.0",
        out_of_reach="a worker reading the metadata after the scheduler changed it (the "
        "adapter reads it when it is built)",
    ),
    HistoricalBug(
        "S6",
        "PR #46394",
        "DCP/PCP global-token conversions",
        "0.24.0",
        "0.25.0",
        out_of_reach="DCP/PCP block-size scaling",
    ),
    HistoricalBug(
        "S7",
        "PR ?",
        "PCP no longer scales block sizes",
        "0.25.1",
        "0.26.0",
        out_of_reach="DCP/PCP block-size scaling",
    ),
    HistoricalBug(
        "S8",
        "PR #49071",
        "EAGLE mode not propagated to the CPU lookup",
        "0.26.0",
        "0.27.0",
        out_of_reach="speculative decoding",
    ),
    HistoricalBug(
        "S9",
        "#53498 (bug 2), PR #53532",
        "no final flush at request finish",
        "0.29.0",
        "0.30.0",
        f"{_S10}+selection-0.29",
        "fixed",
        "pending_flushes",
        "0.29.0's registration (S10) and selection loop modelled",
    ),
    HistoricalBug(
        "S10",
        "#53498 (bug 1), PR #53532",
        "stores registered without _insert_block_hash: stamped primary, no secondary keys",
        "0.29.0",
        "0.30.0",
        f"{_S9}+selection-0.29",
        "fixed",
        "snapshots differ in ['cpu']",
        "0.29.0's missing final flush (S9) and selection loop modelled",
    ),
    HistoricalBug(
        "S11",
        "PR #54325",
        "BlockStored events of the CPU tier",
        "0.29.0",
        "0.30.0",
        out_of_reach="kv-cache events",
    ),
    HistoricalBug(
        "S12",
        "PR #54998",
        "skip_reading_prefix_cache not respected",
        "0.29.0",
        "0.30.0",
        out_of_reach="request flags (prompt logprobs)",
    ),
    HistoricalBug(
        "S13",
        "PR #54736",
        "fine-grained hybrid hits, FA partial tail at finish",
        "0.29.0",
        "0.30.0",
        out_of_reach="Mamba groups and fine-grained partial hits",
    ),
    HistoricalBug(
        "S14",
        "PR ?",
        "sliding-window retained tail nulled in the block table",
        "0.29.0",
        "0.30.0",
        out_of_reach="sliding-window groups",
    ),
    HistoricalBug(
        "S15",
        "PR ?",
        "DCP scales only full-attention groups",
        "0.29.0",
        "0.30.0",
        out_of_reach="DCP/PCP with hybrid groups",
    ),
    HistoricalBug(
        "S16",
        "PR #56621",
        "CPU stores on steps without a forward pass",
        "0.29.0",
        "0.30.0",
        out_of_reach="the worker's no-forward steps (a GPU target)",
    ),
    HistoricalBug(
        "S17",
        "PR ?",
        "per-tensor block regions for mixed page sizes",
        "0.29.0",
        "0.30.0",
        out_of_reach="the worker's KV layouts (a GPU target)",
    ),
    HistoricalBug(
        "S18",
        "PR ?",
        "disk backend DMA events",
        "0.29.0",
        "0.30.0",
        out_of_reach="the disk backend (a GPU target)",
    ),
    HistoricalBug(
        "S19",
        "PR #55033",
        "non-prefix-cacheable groups skipped",
        "0.30.0",
        "0.31.0",
        out_of_reach="special hybrid groups and lazy mode",
    ),
    HistoricalBug(
        "S20",
        "PR #57816",
        "eager-store placement reset on preemption (MRV2)",
        "0.31.0",
        "0.32.0",
        out_of_reach="preemption",
    ),
    HistoricalBug(
        "S21",
        "PR ?",
        "reset() keeps the pins of CPU hits not yet allocated",
        "0.31.0",
        "0.32.0",
        "reset-releases-hits",
        "reset-releases-hits",
        "pending_hits",
        "no other bug of 0.31.0 in reach",
    ),
    HistoricalBug(
        "S22",
        "PR ?",
        "cacheable prefix from the coordinator",
        "0.31.0",
        "0.32.0",
        out_of_reach="hybrid retention intervals and hash lookahead",
    ),
    HistoricalBug(
        "S23",
        "#50821, PR #52921",
        "CPU pool size across PP and draft workers",
        "0.32.0",
        "0.33.0",
        out_of_reach="workers with different KV layouts (a GPU target)",
    ),
    HistoricalBug(
        "S24",
        "PR ?",
        "chunked-local hits start on a chunk boundary",
        "0.32.0",
        "0.33.0",
        out_of_reach="chunked-local attention groups",
    ),
    HistoricalBug(
        "S25",
        "#39972",
        "CPU copy of a GPU-hot prefix never refreshed in the CPU LRU",
        "0.33.0",
        "0.34.0",
        "inclusive-cpu",
        "inclusive-cpu",
        "cpu: free queue",
        "no other bug of 0.33.0 in reach",
    ),
    HistoricalBug(
        "S26",
        "#40332",
        "lazy mode returns offloaded blocks to the MRU end",
        "0.33.0",
        "0.34.0",
        out_of_reach="lazy mode",
    ),
    HistoricalBug(
        "S27",
        "PR ?",
        "lazy mode's stale scan cursor",
        "0.33.0",
        "0.34.0",
        out_of_reach="lazy mode",
    ),
    HistoricalBug(
        "S28",
        "PR ?",
        "FA partial tail covers the last prompt token",
        "0.33.0",
        "0.34.0",
        out_of_reach="fine-grained partial hits and speculative decoding",
    ),
    HistoricalBug(
        "S29",
        "PR ?",
        "host buffer pinned in bounded chunks",
        "0.33.0",
        "0.34.0",
        out_of_reach="the worker's host buffers (a GPU target)",
    ),
]


@dataclass
class BugResult:
    bug: HistoricalBug
    found: bool
    fixed_conforms: bool
    seconds_to_first_failure: float | None
    shrunk_rules: int | None
    first_difference: str | None
    problem: str | None  # why the bug does not count as found


def select(only: str | None) -> list[HistoricalBug]:
    """The bugs ``only`` names (``S1,S9``), every one when None."""
    if not only:
        return BUGS
    wanted = [part.strip() for part in only.split(",") if part.strip()]
    known = {b.id: b for b in BUGS}
    unknown = [w for w in wanted if w not in known]
    if unknown:
        raise ConfigError(f"unknown bugs {unknown}; known: {list(known)}")
    return [known[w] for w in wanted]


def buggy_check(bug: HistoricalBug) -> Check:
    assert bug.isolation is not None
    return Check(bug.isolation, "disagree", f"{bug.id} by itself", bug.finds)


def fixed_check(bug: HistoricalBug) -> Check:
    assert bug.fixed_variant is not None
    return Check(bug.fixed_variant, "conform", f"{bug.fixed} conforms")


def checks_by_release(bugs: list[HistoricalBug]) -> dict[str, list[Check]]:
    """Each release's checks, once each, so that a release runs in one process."""
    plan: dict[str, list[Check]] = {}
    for bug in bugs:
        if bug.in_scope:
            for version, check in ((bug.buggy, buggy_check(bug)), (bug.fixed, fixed_check(bug))):
                if check not in plan.setdefault(version, []):
                    plan[version].append(check)
    return plan


def run_history(
    only: str | None,
    profile_name: str | None,
    seconds: float | None,
    install_first: bool,
    write: str | None,
) -> int:
    """``kvoffload history``: 0 when every bug in scope is found and its fix conforms."""
    bugs = select(only)
    plan = checks_by_release(bugs)
    cache = Cache(default_cache())
    missing = [v for v in plan if not cache.installed(v)]
    if missing and not install_first:
        raise ConfigError(
            f"releases {missing} are not installed; add --install, or run `kvoffload install "
            "vllm==X` for each"
        )
    outcomes: dict[tuple[str, Check], dict[str, Any]] = {}
    for version, checks in plan.items():
        print(f"\n=== vllm=={version}: {len(checks)} checks", flush=True)
        target = parse(f"vllm=={version}")
        ran = run_in_cache(target, install_first, tuple(checks), profile_name, seconds, None)
        outcomes.update(((version, c), r) for c, r in zip(checks, ran, strict=True))
    results = [summarize(bug, outcomes) for bug in bugs]
    print("\n" + table(results))
    print(totals(results))
    if write:
        Path(write).write_text(page(results, profile_name, seconds))
        print(f"written to {write}")
    return 0 if all(r.found and r.fixed_conforms for r in results if r.bug.in_scope) else 1


def summarize(bug: HistoricalBug, outcomes: dict[tuple[str, Check], dict[str, Any]]) -> BugResult:
    if not bug.in_scope:
        return BugResult(bug, False, False, None, None, None, bug.out_of_reach)
    buggy = outcomes[(bug.buggy, buggy_check(bug))]
    fixed = outcomes[(bug.fixed, fixed_check(bug))]
    problem = judge(buggy_check(bug), buggy)
    fixed_problem = judge(fixed_check(bug), fixed)
    failure = buggy.get("failure")
    return BugResult(
        bug,
        problem is None,
        fixed_problem is None,
        buggy.get("seconds_to_first_failure"),
        None if failure is None else failure["rule_steps"],
        buggy.get("disagreement"),
        problem or (None if fixed_problem is None else f"vllm=={bug.fixed}: {fixed_problem}"),
    )


def table(results: list[BugResult]) -> str:
    lines = [
        "| bug | reference | last with the bug → fixed in | found | seconds to first failure "
        "| shrunk rules | the fixed release conforms | first difference, or why not |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        b = r.bug
        if not b.in_scope:
            lines.append(
                f"| {b.id} | {b.ref} | {b.buggy} → {b.fixed} | not yet reachable | - | - | - "
                f"| needs {b.out_of_reach} |"
            )
            continue
        first = "-" if r.seconds_to_first_failure is None else f"{r.seconds_to_first_failure:.1f}"
        rules = "-" if r.shrunk_rules is None else str(r.shrunk_rules)
        what = r.problem or _short(r.first_difference or "")
        lines.append(
            f"| {b.id} | {b.ref} | {b.buggy} → {b.fixed} | {'yes' if r.found else 'NO'} | {first} "
            f"| {rules} | {'yes' if r.fixed_conforms else 'NO'} | {what} |"
        )
    return "\n".join(lines)


def _short(difference: str, limit: int = 160) -> str:
    text = difference.replace("|", "/").replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def totals(results: list[BugResult]) -> str:
    scope = [r for r in results if r.bug.in_scope]
    found = [r for r in scope if r.found and r.fixed_conforms]
    times = [r.seconds_to_first_failure for r in found if r.seconds_to_first_failure is not None]
    median = f"{statistics.median(times):.1f} s" if times else "-"
    return (
        f"{len(found)} of {len(scope)} bugs in reach found, each fix conforming; "
        f"{len(results) - len(scope)} of {len(results)} not yet reachable; median seconds to "
        f"the first failure {median} (target 10 s, import excluded)"
    )


def page(results: list[BugResult], profile_name: str | None, seconds: float | None) -> str:
    how = f"--profile {profile_name}" if profile_name else "the default profile"
    if seconds:
        how += f" --seconds {seconds:g}"
    methods = "\n".join(
        f"- **{r.bug.id}** ({r.bug.title}): vllm=={r.bug.buggy} against `{r.bug.isolation}` "
        f"({r.bug.method}); the first difference must name `{r.bug.finds}`; vllm=={r.bug.fixed} "
        f"against `{r.bug.fixed_variant}`."
        for r in results
        if r.bug.in_scope
    )
    return f"""# The bug history: vLLM's SimpleCPUOffload bugs, found again

Generated by `kvoffload history --write docs/history.md` ({how}) on {time.strftime("%Y-%m-%d")}.
The history is the list of the 29 bugs fixed upstream in vLLM's SimpleCPUOffload connector
between 0.19.0 and 0.34.0, each with the last release that has it and the first with its fix,
as read from the shipped wheels. For each bug in the model's reach the conformance machine
drives the last release with the bug against the model of the first release with the fix, in
which the release's other bugs are modelled (so that the first difference can only be this
bug), and must disagree by itself, its first difference naming the bug; and the release with
the fix must conform. Seconds are from the start of the campaign to the first failing program
(vLLM's import excluded); rules are those of the shrunk, reduced counterexample.

{table(results)}

{totals(results)}

## How each bug is isolated

{methods}

The model variants are in `kvoffload/model/variants.py`; `A+B` composes two. Every bug out of
reach names what the model lacks: hybrid groups, lazy mode and preemption are the model's next
steps; the worker's bugs (copies, streams, host buffers) need a GPU target.
"""
