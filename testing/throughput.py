"""Lockstep throughput: steps per second of the conformance machine against a trivial
Hypothesis machine with the same rules and draws whose bodies only count, run in the same
process with the same settings. The ratio is the share of Hypothesis's own speed that
comparing the model and an implementation after every call leaves.

A third machine bounds that ratio from above: the conformance machine on the same programs
with every call applied to both sides and nothing checked (no comparison, no invariant, no
bytes). The checks can cost no less than nothing, so no work on them lifts the ratio above
this machine's; only the model's and the implementation's own calls, and the rules around
them, can."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvoffload.testing.machine import Recorder
from kvoffload.testing.stateful import (
    BUDGETS,
    INTERLEAVE_BUDGETS,
    INTERLEAVE_STEPS,
    KIND_ORDERS,
    MAX_TOKENS,
    ORDERS,
    PROMPTS,
    SETTLE_BUDGETS,
    SETUP,
    SKIP_READING,
    TAILS,
    machine_for,
)

TARGET_RATIO = 0.6


class TrivialMachine(RuleBasedStateMachine):
    """The conformance machine's rules and draws, with bodies that only count the rules run
    (Hypothesis's steps; the conformance machine counts them the same way, however many
    driver calls a rule makes)."""

    steps = 0

    @SETUP
    def setup(self, first: list[int], **config: object) -> None:
        self.prompts = [first]
        self.live = [0]
        self.count()

    def count(self) -> None:
        type(self).steps += 1

    @rule(tokens=PROMPTS, max_tokens=MAX_TOKENS, skip=SKIP_READING)
    def add_request(self, tokens: list[int], max_tokens: int, skip: bool) -> None:
        self.prompts.append(tokens)
        self.live.append(max_tokens)
        self.count()

    @rule(data=st.data(), tail=TAILS, max_tokens=MAX_TOKENS, skip=SKIP_READING)
    def repeat_request(
        self, data: st.DataObject, tail: list[int], max_tokens: int, skip: bool
    ) -> None:
        self.add_request(data.draw(st.sampled_from(self.prompts)) + tail, max_tokens, skip)

    @rule(budget=BUDGETS, steps=st.integers(1, 3))
    def step(self, budget: int, steps: int) -> None:
        self.count()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.live.remove(data.draw(st.sampled_from(self.live)))
        self.count()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        data.draw(st.sampled_from(self.live))
        self.count()

    @rule(budget=SETTLE_BUDGETS)
    def settle(self, budget: int) -> None:
        self.count()

    @rule()
    def drain(self) -> None:
        self.count()

    @rule(data=st.data(), tokens=PROMPTS)
    def lookup(self, data: st.DataObject, tokens: list[int]) -> None:
        if data.draw(st.booleans()):
            data.draw(st.sampled_from(self.prompts))
        self.count()

    @rule()
    def reset(self) -> None:
        self.count()

    @rule(reset_connector=st.booleans())
    def reset_prefix_cache(self, reset_connector: bool) -> None:
        self.count()

    @precondition(lambda self: bool(self.live))
    @rule(budget=SETTLE_BUDGETS)
    def weight_update(self, budget: int) -> None:
        self.live.clear()
        self.count()

    @rule(data=st.data(), budget=INTERLEAVE_BUDGETS, steps=INTERLEAVE_STEPS, order=ORDERS)
    def interleave(self, data: st.DataObject, budget: int, steps: int, order: str) -> None:
        if order == "drawn":
            data.draw(st.permutations(self.live))
        self.count()

    @rule(data=st.data(), budget=SETTLE_BUDGETS, fresh=PROMPTS, order=KIND_ORDERS)
    def reload_interleaved(
        self, data: st.DataObject, budget: int, fresh: list[int], order: str
    ) -> None:
        self.prompts.append(fresh)
        for _ in range(3):
            data.draw(st.sampled_from(self.prompts))
        self.live.clear()
        self.count()

    @rule(data=st.data(), budget=SETTLE_BUDGETS)
    def reload(self, data: st.DataObject, budget: int) -> None:
        data.draw(st.sampled_from(self.prompts))
        data.draw(st.integers(0, 2))
        self.live.clear()
        self.count()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def fail_store(self, data: st.DataObject) -> None:
        data.draw(st.sampled_from(self.live))
        self.count()

    @rule(data=st.data(), aimed=st.booleans())
    def corrupt(self, data: st.DataObject, aimed: bool) -> None:
        if aimed:
            data.draw(st.sampled_from(self.prompts))
        data.draw(st.sampled_from(self.prompts))
        data.draw(st.integers(0, 3))
        self.count()

    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        data.draw(st.sampled_from(self.prompts))
        self.count()


@dataclass
class Throughput:
    examples: int
    lockstep_steps: int
    lockstep_s: float
    trivial_steps: int
    trivial_s: float
    lockstep_calls: int
    # the same rules and calls with nothing checked (``machine_for(checks=False)``)
    unchecked_steps: int = 0
    unchecked_s: float = 0.0
    unchecked_calls: int = 0
    # the conformance machine's programs by kind of layout: programs, driver calls, seconds
    layouts: dict[str, tuple[int, int, float]] = field(default_factory=dict)

    @property
    def lockstep_rate(self) -> float:
        return self.lockstep_steps / self.lockstep_s

    @property
    def trivial_rate(self) -> float:
        return self.trivial_steps / self.trivial_s

    @property
    def ratio(self) -> float:
        return self.lockstep_rate / self.trivial_rate

    @property
    def unchecked_rate(self) -> float:
        return self.unchecked_steps / self.unchecked_s if self.unchecked_s else 0.0

    @property
    def floor_ratio(self) -> float:
        """The unchecked machine's rate over the trivial one's: the most the conformance
        machine's ratio can reach while its rules make the calls they make."""
        return self.unchecked_rate / self.trivial_rate


def measure(examples: int = 100, adapter: str = "impl", rounds: int = 2) -> Throughput:
    """The three machines on the same derandomized settings, one after the other in each of
    ``rounds`` rounds; the round with the best ratio."""
    config = settings(
        max_examples=examples,
        stateful_step_count=30,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    best: Throughput | None = None
    for _ in range(rounds):
        recorder = Recorder()
        start = time.perf_counter()
        # The core rules, those the trivial machine has (not the campaigns' ``evict``).
        run_state_machine_as_test(machine_for(adapter, recorder, loads=False), settings=config)
        lockstep_s = time.perf_counter() - start
        TrivialMachine.steps = 0
        start = time.perf_counter()
        run_state_machine_as_test(TrivialMachine, settings=config)
        trivial_s = time.perf_counter() - start
        unchecked = Recorder()
        start = time.perf_counter()
        run_state_machine_as_test(
            machine_for(adapter, unchecked, loads=False, checks=False), settings=config
        )
        unchecked_s = time.perf_counter() - start
        run = Throughput(
            examples,
            recorder.rule_steps,
            lockstep_s,
            TrivialMachine.steps,
            trivial_s,
            recorder.steps,
            unchecked.rule_steps,
            unchecked_s,
            unchecked.steps,
            {
                layout: (n, recorder.layout_calls[layout], recorder.layout_seconds[layout])
                for layout, n in sorted(recorder.layout_programs.items())
            },
        )
        if best is None or run.ratio > best.ratio:
            best = run
    assert best is not None
    return best


def report(result: Throughput, adapter: str = "impl") -> tuple[list[str], list[str]]:
    """The summary line and the section of ``kvoffload bench`` on lockstep throughput."""
    met = "met" if result.ratio >= TARGET_RATIO else "NOT met"
    summary = [
        f"- Lockstep conformance machine: {result.lockstep_rate:.0f} steps/s against "
        f"{result.trivial_rate:.0f} for a trivial machine, ratio {result.ratio:.2f}; target at "
        f"least {TARGET_RATIO}: {met}. The same rules with nothing checked: ratio "
        f"{result.floor_ratio:.2f}, the ceiling of any work on the checks."
    ]
    section = [
        "## Lockstep throughput",
        "",
        f"The conformance machine on `{adapter}` (lockstep mode: each step's copies complete "
        "before it returns; the model with every invariant checked, both snapshots compared "
        "and the KV bytes checked after every call, incrementally) against a trivial machine "
        "with the same rules and draws whose bodies only count, in the same process: "
        f"{result.examples} derandomized programs of up to 30 rules, best of two rounds.",
        "",
        "Steps are Hypothesis's: rules run, however many driver calls a rule makes.",
        "",
        "| machine | steps | seconds | steps/s |",
        "|---|---|---|---|",
        f"| conformance | {result.lockstep_steps} | {result.lockstep_s:.2f} "
        f"| {result.lockstep_rate:.0f} |",
        f"| unchecked | {result.unchecked_steps} | {result.unchecked_s:.2f} "
        f"| {result.unchecked_rate:.0f} |",
        f"| trivial | {result.trivial_steps} | {result.trivial_s:.2f} "
        f"| {result.trivial_rate:.0f} |",
        "",
        "`unchecked` is the conformance machine on the very same programs "
        f"({result.unchecked_calls} driver calls) with every call applied to both sides and "
        "nothing compared or checked: the model's and the implementation's calls, the rules "
        "around them and Hypothesis. Its ratio to the trivial machine, "
        f"{result.floor_ratio:.2f}, bounds the conformance machine's from above; per step, "
        f"the checks take {1 - result.lockstep_rate / result.unchecked_rate:.0%} of the "
        "conformance machine's time.",
        "",
        f"The conformance machine made {result.lockstep_calls} driver calls, "
        f"{result.lockstep_calls / result.lockstep_steps:.1f} per rule (`step` and `settle` "
        "make several).",
        "",
        "Its programs by kind of layout (full-attention groups only, or a sliding-window, "
        "chunked local or Mamba group beside a full-attention one), each timed from its setup "
        "to its teardown:",
        "",
        "| layout | programs | driver calls | seconds | programs/s | calls/s |",
        "|---|---|---|---|---|---|",
        *(
            f"| {layout} | {n} | {calls} | {seconds:.2f} | {n / seconds:.1f} "
            f"| {calls / seconds:.0f} |"
            for layout, (n, calls, seconds) in result.layouts.items()
            if seconds > 0
        ),
        "",
    ]
    return summary, section


def as_json(result: Throughput) -> dict[str, Any]:
    return asdict(result) | {
        "lockstep_rate": result.lockstep_rate,
        "trivial_rate": result.trivial_rate,
        "ratio": result.ratio,
        "unchecked_rate": result.unchecked_rate,
        "floor_ratio": result.floor_ratio,
        "target": {"ratio": TARGET_RATIO, "met": result.ratio >= TARGET_RATIO},
    }


def bench_section(quick: bool) -> tuple[list[str], list[str], dict[str, Any]]:
    """What ``kvoffload bench`` reports on lockstep throughput: summary lines, its section,
    and the figures as JSON."""
    result = measure(examples=30 if quick else 100)
    summary, section = report(result)
    return summary, section, as_json(result)
