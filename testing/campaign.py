"""Campaigns: ``kvoffload verify`` (conformance of the implementation and the mutation
matrix), ``kvoffload mutants`` (the matrix alone) and ``kvoffload replay`` (a saved failure
as a pytest regression file)."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from kvoffload.impl import FAULTS
from kvoffload.model.errors import ConfigError
from kvoffload.model.invariants import CHECKS
from kvoffload.testing import profiles
from kvoffload.testing.adapters import adapters, default_adapter
from kvoffload.testing.stateful import Recorder, machine_for, reproducer, save_failure

# Targets of the mutation matrix under the ``ci`` profile.
MAX_SHRUNK_STEPS = 8
MAX_MEDIAN_SECONDS = 10.0


@dataclass
class CampaignResult:
    adapter: str
    conforms: bool
    seconds: float
    first_failure: float | None
    recorder: Recorder
    failure: dict[str, Any] | None

    @property
    def shrunk_steps(self) -> int | None:
        """Rules in the shrunk counterexample (Hypothesis's steps)."""
        return None if self.failure is None else int(self.failure["rule_steps"])

    @property
    def shrunk_calls(self) -> int | None:
        """Driver calls in the shrunk counterexample (a rule may make several)."""
        return None if self.failure is None else len(self.failure["program"])


def run_campaign(
    adapter: str,
    profile: settings,
    seconds: float | None = None,
    progress: bool = False,
    variant: str | None = None,
    loads: bool = True,
) -> CampaignResult:
    """Run the conformance machine on ``adapter`` until it fails, for ``profile``'s examples,
    or (with ``seconds``) in batches until the time is spent. ``variant``: the model variant
    to compare with (default: the adapter's); ``loads``: with the ``evict`` rule."""
    recorder = Recorder()
    machine = machine_for(adapter, recorder, variant, loads)
    start = time.perf_counter()
    failure: dict[str, Any] | None = None
    batch = (
        settings(profile, max_examples=25, derandomize=False, database=None) if seconds else profile
    )
    while True:
        try:
            run_state_machine_as_test(machine, settings=batch)
        except (AssertionError, Flaky):
            failure = recorder.failure
            # The recorder holds the last example's disagreement; without one, what failed
            # is not a disagreement (a violated invariant of the model, an error of the
            # machine) and must not pass for conformance.
            if failure is None:
                raise
        elapsed = time.perf_counter() - start
        if progress:
            print(
                f"\r{adapter}: {recorder.programs} programs, {recorder.steps} steps, "
                f"{elapsed:.0f} s",
                end="",
                file=sys.stderr,
                flush=True,
            )
        if failure is not None or seconds is None or elapsed >= seconds:
            break
    if progress:
        print(file=sys.stderr)
    if failure is not None:
        save_failure(failure)
    return CampaignResult(
        adapter,
        failure is None,
        time.perf_counter() - start,
        recorder.first_failure,
        recorder,
        failure,
    )


def mutation_matrix(profile: settings, progress: bool = False) -> list[CampaignResult]:
    """Every fault of the catalogue, one campaign each. Under a derandomized profile (``ci``)
    the outcome is the same on every machine."""
    return [fault_campaign(name, profile, progress) for name in FAULTS]


def fault_campaign(name: str, profile: settings, progress: bool = False) -> CampaignResult:
    """The matrix's campaign for one fault: the machine without the ``evict`` rule, whose
    whole scenarios can hold the shrinker in longer counterexamples."""
    return run_campaign(f"fault:{name}", profile, progress=progress, loads=False)


def matrix_profile(profile_name: str | None) -> tuple[str, settings]:
    """The matrix runs ``ci`` (derandomized) unless ``nightly`` was asked for: a fault it
    misses must mean the machine regressed, not that a random run was unlucky."""
    name = "nightly" if profile_name == "nightly" else "ci"
    return name, profiles.get(name)


def mutation_table(results: list[CampaignResult]) -> str:
    lines = [
        "| fault | found | seconds to first failure | shrunk counterexample: rules (calls) |",
        "|---|---|---|---|",
    ]
    for r in results:
        found = not r.conforms
        first = f"{r.first_failure:.1f}" if r.first_failure is not None else "-"
        steps = f"{r.shrunk_steps} ({r.shrunk_calls})" if r.failure is not None else "-"
        name = r.adapter.removeprefix("fault:")
        lines.append(f"| {name} | {'yes' if found else 'NO'} | {first} | {steps} |")
    return "\n".join(lines)


def coverage(rec: Recorder) -> str:
    rules = ", ".join(f"{name} {n}" for name, n in sorted(rec.rules.items()))
    invariants = ", ".join(f"{name} {rec.invariants.get(name, 0)}" for name in CHECKS)
    return (
        f"{rec.programs} programs, {rec.rule_steps} steps ({rec.steps} driver calls)\n"
        f"rules: {rules}\n"
        f"invariants exercised (steps with something to check): {invariants}"
    )


def run_verify(
    profile_name: str | None,
    seconds: float | None,
    target: str | None,
    mutants: bool,
) -> int:
    profile = profiles.load(profile_name)
    adapter = target or default_adapter()
    known = adapters()
    if adapter not in known:
        raise ConfigError(f"unknown target {adapter!r}; known here: {sorted(known)}")
    result = run_campaign(adapter, profile, seconds=seconds, progress=True)
    print_result(result, f"conformance of {adapter}: ")
    ok = result.conforms
    if mutants:
        name, matrix_settings = matrix_profile(profile_name)
        matrix = mutation_matrix(matrix_settings, progress=True)
        print(f"\nmutation matrix ({name} profile):\n" + mutation_table(matrix))
        print(matrix_verdict(matrix))
        ok = ok and matrix_meets_targets(matrix)
    return 0 if ok else 1


def print_result(result: CampaignResult, label: str = "", where: str = "") -> None:
    """The verdict, the coverage, and a failure with its reproducer (to run ``where``)."""
    print(label + ("conforms" if result.conforms else "DISAGREES"))
    print(coverage(result.recorder))
    if result.failure is not None:
        print("\n" + result.failure["disagreement"])
        print(f"\nreproduce{where} with:\n" + reproducer(result.failure))


def matrix_meets_targets(matrix: list[CampaignResult]) -> bool:
    return all(r.shrunk_steps is not None and r.shrunk_steps <= MAX_SHRUNK_STEPS for r in matrix)


def matrix_verdict(matrix: list[CampaignResult]) -> str:
    found = [r for r in matrix if not r.conforms]
    firsts = sorted(r.first_failure for r in found if r.first_failure is not None)
    median = firsts[len(firsts) // 2] if firsts else float("nan")
    longest = max((r.shrunk_steps or 0 for r in found), default=0)
    return (
        f"{len(found)} of {len(matrix)} faults found; median {median:.1f} s to the first failure "
        f"(target {MAX_MEDIAN_SECONDS:.0f} s); longest shrunk counterexample {longest} rules "
        f"(target {MAX_SHRUNK_STEPS})"
    )


def run_mutants(profile_name: str | None, write: str | None) -> int:
    name, profile = matrix_profile(profile_name)
    matrix = mutation_matrix(profile, progress=True)
    print(mutation_table(matrix))
    print(matrix_verdict(matrix))
    if write:
        Path(write).write_text(bugs_page(matrix, name))
    return 0 if matrix_meets_targets(matrix) else 1


def bugs_page(matrix: list[CampaignResult], profile_name: str) -> str:
    parts = [
        "# The fault catalogue, as the conformance machine finds it",
        "",
        f"Generated by `kvoffload mutants --write docs/bugs.md` under the `{profile_name}` "
        f"profile on {time.strftime('%Y-%m-%d')}. For each fault of `kvoffload.impl.faults`: "
        "what it breaks (an invariant of `docs/spec.md`, or `KV-BYTES` when a block does not "
        "hold its key's KV), the time the machine took to its first failing program, and the "
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
            f"First difference: {r.failure['disagreement']}",
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


def run_replay(path: str, output: str | None) -> int:
    failure = json.loads(Path(path).read_text())
    name = failure["adapter"].replace(":", "_").replace("-", "_")
    body = reproducer(failure).replace("print(first_disagreement(", "found = first_disagreement(")
    body = body.rstrip().removesuffix(")")
    lines = ["    " + line if line else "" for line in body.splitlines()]
    imports = [line.strip() for line in lines[:2]]
    text = (
        f'"""Regression from a saved conformance failure of {failure["adapter"]}:\n'
        f'{failure["disagreement"]}"""\n\n'
        + "\n".join(imports)
        + f"\n\n\ndef test_regression_{name}() -> None:\n"
        + "\n".join(lines[3:])
        + "\n    assert found is None, found\n"
    )
    if output:
        Path(output).write_text(text)
    print(text)
    return 0
