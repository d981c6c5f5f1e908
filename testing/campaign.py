"""Campaigns: ``kvoffload verify`` (conformance of the implementation and the mutation
matrix), ``kvoffload mutants`` (the matrix alone) and ``kvoffload replay`` (a saved failure
as a pytest regression file)."""

from __future__ import annotations

import json
import multiprocessing
import re
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis.database import ExampleDatabase

from kvoffload.impl import FAULTS
from kvoffload.model import OffloadModel
from kvoffload.model.config import OffloadConfig
from kvoffload.model.errors import ConfigError
from kvoffload.model.invariants import CHECKS
from kvoffload.testing import profiles, reduce
from kvoffload.testing.failure import OFFLOAD, Failure, validate
from kvoffload.testing.isolation import spawning_safely
from kvoffload.testing.lockstep import Call, disagreement, outcome
from kvoffload.testing.machine import CampaignResult, Recorder, run_machine_campaign
from kvoffload.testing.reduce import kind, replay
from kvoffload.testing.stateful import (
    SETTLE_MAX_BUDGET,
    SETTLE_MIN_BUDGET,
    ConformanceMachine,
    machine_for,
    settle_calls,
)
from kvoffload.testing.targets import default_target, spec
from kvoffload.testing.words import without_words, words_of

# Targets of the mutation matrix under the ``ci`` profile.
MAX_SHRUNK_STEPS = 8
MAX_MEDIAN_SECONDS = 10.0


def run_campaign(
    adapter: str,
    profile: settings,
    seconds: float | None = None,
    progress: bool = False,
    variant: str | None = None,
    loads: bool = True,
    seed: int | None = None,
    database: ExampleDatabase | None = None,
    stop: Callable[[], bool] | None = None,
) -> CampaignResult:
    """Run the conformance machine on ``adapter`` until it fails, for ``profile``'s examples,
    or (with ``seconds``) in batches until the time is spent or ``stop()`` says so.
    ``variant``: the model variant to compare with (default: the adapter's); ``loads``: with
    the ``evict`` rule; ``database``: the example database of the batches (each replays what
    it holds for this target first). A random profile runs batch ``k`` from seed ``seed + k``
    (``seed`` drawn when not given), so that a run is repeated by giving its seed; a
    derandomized profile (``ci``) needs none."""
    machine = machine_for(adapter, Recorder(), variant, loads)
    return run_machine_campaign(
        machine,
        adapter,
        campaign_batch(profile, seconds, database),
        lambda failure: reduced(machine, failure),
        seconds,
        seed,
        stop,
        progress,
    )


def check_record(result: CampaignResult, variant: str, machine: str = OFFLOAD) -> dict[str, Any]:
    """One check of a vLLM release as ``kvoffload verify --target vllm==X`` reports it (its
    JSON and the history's), whichever machine ran it."""
    failure, rec = result.failure, result.recorder
    return {
        "variant": variant,
        "machine": machine,
        "conforms": result.conforms,
        "class": result.verdict_class,
        "seconds": round(result.seconds, 1),
        "seed": result.seed,
        "programs": rec.programs,
        "rule_steps": rec.rule_steps,
        "driver_calls": rec.steps,
        "rules": dict(sorted(rec.rules.items())),
        # issue 34: measured on the offload machine's target (vLLM's scheduler: not measured)
        "efficiency": rec.efficiency.as_dict() if machine == OFFLOAD else None,
        "seconds_to_first_failure": result.first_failure,
        "programs_to_first_failure": rec.first_failing_program,
        "disagreement": None if failure is None else failure["disagreement"],
        "in_words": None if failure is None else words_of(failure["disagreement"]),
        "failure": failure,
        "reproducer": None if failure is None else validate(failure).reproducer(),
        "saved": None if result.saved is None else str(result.saved.absolute()),
    }


def campaign_batch(
    profile: settings, seconds: float | None, database: ExampleDatabase | None = None
) -> settings:
    """What one batch of a campaign runs: the profile's examples, or for a campaign of
    ``seconds``, batches of 25 random programs (each batch from its own seed), replaying
    what ``database`` holds first."""
    if not seconds:
        return profile
    return settings(profile, max_examples=25, derandomize=False, database=database)


def reduced(machine: type[ConformanceMachine], failure: Failure) -> Failure:
    """``failure`` reduced (:func:`kvoffload.testing.reduce.reduced`) on the machine's own
    target and model variant, runs of steps and drains made ``settle`` rules again
    (:func:`regrouped`)."""

    def disagrees(config: OffloadConfig) -> Callable[[list[Call]], str | None]:
        return lambda calls: disagreement(machine.adapter, machine.variant, config, calls)

    def regroup(
        config: OffloadConfig, program: list[Call], found: str
    ) -> tuple[list[Call], str, int]:
        return regrouped(machine, config, program, found, disagrees(config))

    return reduce.reduced(failure, disagrees, regroup)


# The calls after which a rule drains the stats, as part of that same rule.
_STATS_AFTER = ("store", "load", "drain", "reset", "reset_prefix_cache")
_SETTLING = ("step", "drain", "stats")


def rules_of(program: Sequence[Call], settles: int = 0) -> int:
    """The machine rules that make ``program``: a call each, but the stats drained after a
    completion, a drain or a reset (part of that rule); ``settles`` runs of it are one
    ``settle`` rule each, and counted as such."""
    calls = sum(
        1
        for i, call in enumerate(program)
        if not (i and call[0] == "stats" and program[i - 1][0] in _STATS_AFTER)
    )
    return calls + settles


def regrouped(
    machine: type[ConformanceMachine],
    config: OffloadConfig,
    program: list[Call],
    found: str,
    disagrees: Callable[[list[Call]], str | None],
) -> tuple[list[Call], str, int]:
    """A reduced program with runs of steps and drains made one ``settle`` rule where it
    still disagrees the same way, and its count of rules. Hypothesis shrinks choices and the
    call-level pass deletes calls: neither turns ``step, step, drain`` into the one rule that
    runs the engine until it is idle, so a counterexample drawn without ``settle`` keeps a
    rule per call (S21: 9 rules, of which a settle makes 3). Each candidate is the calls
    the rule makes from the model's state before the run (:func:`settle_calls`), with its
    largest budget, so that the program stays one the machine can make; the run is cut
    after the call that disagrees."""
    wanted = kind(found)
    settles: list[tuple[int, int]] = []  # [start, end) of the runs made settle rules
    start = 0
    while start < len(program):
        end = start
        while end < len(program) and program[end][0] in _SETTLING:
            end += 1
        run = program[start:end]
        budgets = [c[1] for c in run if c[0] == "step"]
        if budgets and rules_of(run) >= 2:
            model = OffloadModel(config, variant=machine.variant, check=False)
            for call in program[:start]:
                outcome(model, call)
            budget = min(max(max(budgets), SETTLE_MIN_BUDGET), SETTLE_MAX_BUDGET)
            settle = settle_calls(model, budget, machine.reports_stats)
            candidate = program[:start] + settle + program[end:]
            result = replay(disagrees, candidate)
            if settle and result is not None and kind(result) == wanted:
                at = _call_index(result)
                program = candidate[: at + 1] if at is not None else candidate
                found = result
                settles.append((start, min(start + len(settle), len(program))))
                start += len(settle)
                continue
        start = max(end, start + 1)
    loose = [c for i, c in enumerate(program) if not any(a <= i < b for a, b in settles)]
    return program, found, rules_of(loose, len(settles))


def _call_index(found: str) -> int | None:
    """The index of the call a difference names (``call N (...)``), if it names one."""
    match = re.match(r"(?:the (?:model broke|target breaks) \S+ at )?call (\d+) ", found)
    return int(match.group(1)) if match else None


def mutation_matrix(
    profile_name: str,
    progress: bool = False,
    jobs: int = 1,
    faults: Sequence[str] = tuple(FAULTS),
) -> list[CampaignResult]:
    """Every fault of the catalogue (or of ``faults``), one campaign each, under the profile
    registered as ``profile_name``, in that order. Under a derandomized profile (``ci``) the
    outcome is the same on every machine, and with any number of ``jobs``: the campaigns
    share nothing, so ``jobs > 1`` runs them in that many processes at once."""
    unknown = [name for name in faults if name not in FAULTS]
    if unknown:
        raise ConfigError(f"unknown faults {unknown}; the catalogue has {sorted(FAULTS)}")
    profile = profiles.get(profile_name)
    if jobs <= 1:
        return [fault_campaign(name, profile, progress) for name in faults]
    # Spawned, not forked: the implementation's copy streams run threads, and a fork
    # copies none of them (a child would wait on a stream nobody serves).
    context = multiprocessing.get_context("spawn")
    results: dict[str, CampaignResult] = {}
    with (
        spawning_safely(),
        ProcessPoolExecutor(min(jobs, len(faults)), mp_context=context) as pool,
    ):
        running = {pool.submit(_fault_campaign, name, profile_name): name for name in faults}
        for done in as_completed(running):
            result = done.result()
            results[running[done]] = result
            if progress:
                print(
                    f"{result.adapter}: {result.recorder.programs} programs, "
                    f"{result.recorder.steps} steps, {result.seconds:.0f} s "
                    f"({len(results)} of {len(faults)})",
                    file=sys.stderr,
                    flush=True,
                )
    return [results[name] for name in faults]


def _fault_campaign(name: str, profile_name: str) -> CampaignResult:
    """:func:`fault_campaign` in a worker process (a profile travels by its name)."""
    return fault_campaign(name, profiles.get(profile_name))


def fault_campaign(name: str, profile: settings, progress: bool = False) -> CampaignResult:
    """The matrix's campaign for one fault: the machine without the ``evict`` rule, whose
    whole scenarios can hold the shrinker in longer counterexamples."""
    return run_campaign(f"fault:{name}", profile, progress=progress, loads=False)


def matrix_profile(profile_name: str | None) -> str:
    """The matrix runs ``ci`` (derandomized) unless ``nightly`` was asked for: a fault it
    misses must mean the machine regressed, not that a random run was unlucky."""
    return "nightly" if profile_name == "nightly" else "ci"


def mutation_table(results: list[CampaignResult]) -> str:
    """The matrix as a markdown table; a random profile's seeds in a last column."""
    seeded = any(r.seed is not None for r in results)
    lines = [
        "| fault | found | seconds to first failure | first failing program "
        "| shrunk counterexample: rules (calls) |" + (" seed |" if seeded else ""),
        "|---|---|---|---|---|" + ("---|" if seeded else ""),
    ]
    for r in results:
        found = not r.conforms
        first = f"{r.first_failure:.1f}" if r.first_failure is not None else "-"
        program = r.recorder.first_failing_program
        steps = f"{r.shrunk_steps} ({r.shrunk_calls})" if r.failure is not None else "-"
        name = r.adapter.removeprefix("fault:")
        row = f"| {name} | {'yes' if found else 'NO'} | {first} | {program or '-'} | {steps} |"
        lines.append(row + (f" {r.seed} |" if seeded else ""))
    return "\n".join(lines)


def coverage(rec: Recorder) -> str:
    rules = ", ".join(f"{name} {n}" for name, n in sorted(rec.rules.items()))
    invariants = ", ".join(f"{name} {rec.invariants.get(name, 0)}" for name in CHECKS)
    speeds = ", ".join(
        f"{layout} {programs:.1f} ({calls:.0f} calls/s, {rec.layout_programs[layout]} programs)"
        for layout, (programs, calls) in rec.speeds().items()
    )
    return (
        f"{rec.programs} programs, {rec.rule_steps} steps ({rec.steps} driver calls)\n"
        f"rules: {rules}\n"
        f"invariants exercised (steps with something to check): {invariants}\n"
        f"efficiency (measured on the target, never a verdict): {rec.efficiency.line()}\n"
        f"programs per second by layout: {speeds or '-'}"
    )


def run_verify(
    profile_name: str | None,
    seconds: float | None,
    target: str | None,
    mutants: bool,
    seed: int | None = None,
    json_path: str | None = None,
    jobs: int = 1,
) -> int:
    """``kvoffload verify``: a campaign on ``target`` (default: the implementation), then the
    mutation matrix (in ``jobs`` processes). Exit status 0 when it conforms and every fault
    is found within the targets, 1 otherwise; ``json_path`` receives the same as a report
    (:func:`report`)."""
    profile = profiles.load(profile_name)
    adapter = target or default_target()
    why = spec(adapter).unavailable()
    if why is not None:
        raise ConfigError(f"the target {adapter} cannot run here: {why}")
    result = run_campaign(adapter, profile, seconds=seconds, progress=True, seed=seed)
    print_result(result, f"conformance of {adapter}: ")
    ok = result.conforms
    broken = result.broken_invariant
    matrix = None
    if mutants:
        name = matrix_profile(profile_name)
        matrix = mutation_matrix(name, progress=True, jobs=jobs)
        print(f"\nmutation matrix ({name} profile):\n" + mutation_table(matrix))
        print(matrix_verdict(matrix))
        ok = ok and matrix_meets_targets(matrix)
    # The model breaking its own invariant is no verdict on the target: exit status 3.
    status = 3 if broken else 0 if ok else 1
    if json_path:
        document = report(result, profile_name or profiles.chosen(), matrix, status)
        Path(json_path).write_text(json.dumps(document, indent=1) + "\n")
    return status


def report(
    result: CampaignResult,
    profile_name: str,
    matrix: list[CampaignResult] | None,
    status: int,
) -> dict[str, Any]:
    """A campaign as JSON (``kvoffload verify --json``): the verdict, the seed, what was
    exercised, and a failure with its reproducer; the mutation matrix when it ran."""
    rec = result.recorder
    failure = None if result.failure is None else validate(result.failure)
    return {
        "target": result.adapter,
        "profile": profile_name,
        "verdict": "conforms"
        if result.conforms
        else "disagrees"
        if result.broken_invariant is None
        else f"the model broke {result.broken_invariant}",
        # issue 34: a bug (the target's own state breaks an invariant) or a change to review
        "class": result.verdict_class,
        "exit_status": status,
        "seconds": round(result.seconds, 3),
        "seed": result.seed,
        "programs": rec.programs,
        "rule_steps": rec.rule_steps,
        "driver_calls": rec.steps,
        "rules": dict(sorted(rec.rules.items())),
        "invariants": {name: rec.invariants.get(name, 0) for name in CHECKS},
        # issue 34: what the target's cache cost in hits and copies, beside the verdict
        "efficiency": rec.efficiency.as_dict(),
        "seconds_to_first_failure": result.first_failure,
        # issue 34: the first difference as a reviewer reads it (testing/words.py)
        "in_words": None if failure is None else words_of(failure.disagreement),
        "failure": None if failure is None else failure.to_dict(),
        "reproducer": None if failure is None else failure.reproducer(),
        "saved": None if result.saved is None else str(result.saved),
        "mutation_matrix": None if matrix is None else matrix_report(matrix),
    }


def matrix_report(matrix: list[CampaignResult]) -> list[dict[str, Any]]:
    """The mutation matrix as JSON: per fault, whether it was found, how soon, how short."""
    return [
        {
            "fault": r.adapter.removeprefix("fault:"),
            "found": not r.conforms,
            "class": r.verdict_class,
            "seconds_to_first_failure": r.first_failure,
            "first_failing_program": r.recorder.first_failing_program,
            "shrunk_rules": r.shrunk_steps,
            "shrunk_calls": r.shrunk_calls,
            "first_difference": None if r.failure is None else r.failure["disagreement"],
            "saved": None if r.saved is None else str(r.saved),
        }
        for r in matrix
    ]


def print_result(result: CampaignResult, label: str = "", where: str = "") -> None:
    """The verdict, the coverage, the seed, and a failure with its reproducer (to run
    ``where``) and the file it was saved to."""
    if result.broken_invariant is not None:
        verdict = (
            f"the model broke {result.broken_invariant}: a bug of the specification, not a "
            "verdict on the target (exit status 3)"
        )
    elif result.conforms:
        verdict = "conforms"
    elif result.verdict_class == "differs":
        verdict = (
            "DISAGREES: differs from the model, every invariant holding on the target's own "
            "state (a change of behaviour to review, or a bug no invariant states)"
        )
    else:
        verdict = (
            f"DISAGREES: {result.verdict_class} (a bug: the target's own state violates the spec)"
        )
    print(label + verdict)
    print(coverage(result.recorder))
    print(seed_line(result))
    if result.failure is not None:
        failure = validate(result.failure)
        words = words_of(failure.disagreement)
        if words is not None:
            # what a reviewer reads first: the difference in words, then exactly
            print(f"\nin words: {words}")
        print("\n" + without_words(failure.disagreement))
        print(f"\nreproduce{where} with:\n" + failure.reproducer())
        if result.saved is not None:
            print(
                f"saved to {result.saved}: `kvoffload replay --run {result.saved}` runs it "
                f"again, `kvoffload replay {result.saved} --output FILE` writes a pytest file"
            )


def seed_line(result: CampaignResult) -> str:
    if result.seed is None:
        return "seed: none (a derandomized profile: the same programs on every run)"
    return f"seed: {result.seed} (`--seed {result.seed}` runs these programs again)"


def matrix_meets_targets(matrix: list[CampaignResult]) -> bool:
    return all(r.shrunk_steps is not None and r.shrunk_steps <= MAX_SHRUNK_STEPS for r in matrix)


def matrix_verdict(matrix: list[CampaignResult]) -> str:
    found = [r for r in matrix if not r.conforms]
    firsts = sorted(r.first_failure for r in found if r.first_failure is not None)
    median = firsts[len(firsts) // 2] if firsts else float("nan")
    longest = max((r.shrunk_steps or 0 for r in found), default=0)
    # How far into its stream the latest find came: a fault found only near the end of the
    # profile's programs is one small change of the stream away from being missed.
    latest = max((r.recorder.first_failing_program or 0 for r in found), default=0)
    return (
        f"{len(found)} of {len(matrix)} faults found; median {median:.1f} s to the first failure "
        f"(target {MAX_MEDIAN_SECONDS:.0f} s); longest shrunk counterexample {longest} rules "
        f"(target {MAX_SHRUNK_STEPS}); the latest first failure in program {latest}"
    )


def run_mutants(
    profile_name: str | None, write: str | None, jobs: int = 1, json_path: str | None = None
) -> int:
    """``kvoffload mutants``: 0 when every fault is found within the targets, else 1; the
    table printed, the catalogue page written to ``write``, the matrix as JSON to
    ``json_path``."""
    name = matrix_profile(profile_name)
    matrix = mutation_matrix(name, progress=True, jobs=jobs)
    print(mutation_table(matrix))
    print(matrix_verdict(matrix))
    if write:
        Path(write).write_text(bugs_page(matrix, name))
    status = 0 if matrix_meets_targets(matrix) else 1
    if json_path:
        document = {
            "profile": name,
            "exit_status": status,
            "verdict": matrix_verdict(matrix),
            "faults": matrix_report(matrix),
        }
        Path(json_path).write_text(json.dumps(document, indent=1) + "\n")
    return status


def _first_difference(found: str) -> list[str]:
    """A page's paragraphs for a difference: in words where it has them, then exactly."""
    words = words_of(found)
    if words is None:
        return [f"First difference: {found}"]
    return [f"First difference, in words: {words}", "", f"Exactly: {without_words(found)}"]


def bugs_page(matrix: list[CampaignResult], profile_name: str) -> str:
    parts = [
        "# The fault catalogue, as the conformance machine finds it",
        "",
        f"Generated by `kvoffload mutants --write docs/bugs.md` under the `{profile_name}` "
        f"profile on {time.strftime('%Y-%m-%d')}. For each fault of `kvoffload.impl.faults`: "
        "what it breaks (an invariant of `docs/spec.md`, or `KV-BYTES` when a block does not "
        "hold its key's KV), the time the machine took to its first failing program and which "
        "program of its stream that was, and the "
        "counterexample Hypothesis shrank it to, as driver calls, with what differed from the "
        "model first. A rule of the machine may make several calls (`step` up to three, "
        "`settle` a step and a drain per round until the engine is idle).",
        "",
        mutation_table(matrix),
        "",
        matrix_verdict(matrix),
        "",
    ]
    for r in matrix:
        name = r.adapter.removeprefix("fault:")
        fault = FAULTS[name]
        parts += [f"## {name}", "", fault.summary, "", f"Breaks: {fault.breaks}.", ""]
        if r.failure is None:
            parts += ["Not found in this run.", ""]
            continue
        calls = "\n".join(f"{n:2}. {describe(c)}" for n, c in enumerate(r.failure["program"]))
        config = r.failure["config"]
        parts += [
            f"Configuration: {config['gpu_blocks']} GPU blocks, {config['cpu_blocks']} CPU blocks, "
            f"groups of {config['group_block_sizes']} tokens, hash blocks of "
            f"{config['hash_block_size']}, {config['world_size']} worker(s). "
            f"{r.shrunk_steps} rules, {r.shrunk_calls} calls:",
            "",
            "```",
            calls,
            "```",
            "",
            *_first_difference(r.failure["disagreement"]),
            "",
        ]
    return "\n".join(parts)


def describe(call: list[Any]) -> str:
    name, *args = call
    if name == "add":
        return f"add_request({args[0]!r}, {len(args[1])} tokens {args[1]}, max_tokens={args[2]})"
    if name in ("store", "load"):
        return f"complete_{name}(event={args[0]}, worker={args[1]})"
    if name == "lookup":
        return f"lookup({args[0]})"
    return f"{name}({', '.join(map(repr, args))})"
