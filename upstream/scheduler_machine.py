"""The conformance machine over vLLM's own scheduler (:mod:`kvoffload.upstream.scheduler`):
random programs of requests, steps, aborts and resets drive vLLM's ``Scheduler`` with its
SimpleCPUOffload connector and the model in lockstep, compared after every call.

Draws as the conformance machine's (:mod:`kvoffload.testing.stateful`), so that shrinking
works and the rare paths happen: prompts from three stems and earlier prompts again (GPU and
CPU hits), tiny pools (eviction, failed allocation, preemption, the CPU pool full), small
budgets (chunked prefill), one full-attention group or two, up to three workers, lazy mode
and kv-cache events one program in three each, requests that skip reading the prefix cache,
vLLM's whole-sequence admission on or off, resets that preempt the running requests. Each
step reports the stores and loads sent so far complete, or (one step in four) holds them back
to a later step's output. The model is the release's variant with vLLM 0.34.0's scheduling
(:data:`~kvoffload.model.engine.VLLM_SCHEDULING`).

A check of the release table names this machine with ``machine="scheduler"``
(:mod:`kvoffload.upstream.releases`); ``kvoffload verify --target vllm==X`` runs it beside the
offload target, in the same measured process.

Without vLLM (``vllm=False``) the same programs drive the model alone, every invariant checked
after every call: the scheduling vLLM's scheduler taught the model (its admission gates,
resets that preempt, worker outputs processed as vLLM does) held to the model's own
invariants, which a release's variant that breaks them cannot be (its check is off there).
"""

from __future__ import annotations

import itertools
import random
import time
from typing import Any, ClassVar

from hypothesis import seed as hypothesis_seed
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.errors import Flaky
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvoffload.model import InvariantViolation, OffloadConfig, OffloadModel, SetupError
from kvoffload.model.types import KVEvent
from kvoffload.model.variants import keeps_invariants
from kvoffload.testing.lockstep import Call, as_outcome
from kvoffload.testing.stateful import PROMPTS, SKIP_READING, TAILS, Recorder
from kvoffload.upstream.scheduler import VllmScheduler, compare_call, model_call, scheduling

# Full-attention groups: one of blocks of 4 or 8 (vLLM's one-group coordinator hashes whole
# blocks only), or two of 4 and 8 tokens hashed in blocks of 4 (the hybrid coordinator: keys
# only up to the scheduler block of 8, secondary keys on the group of 8).
LAYOUTS = [((4,), 4), ((8,), 8), ((4, 8), 4)]
BUDGETS = st.integers(1, 24)
SETTLE_ROUNDS = 12
# Stores and loads reported in the step's own output three steps in four.
REPORTS = st.integers(0, 3).map(lambda n: n != 3)
# Longer decodes than the offload machine's: running requests that grow preempt others.
MAX_TOKENS = st.one_of(st.just(1), st.integers(1, 12))


class SchedulerMachine(RuleBasedStateMachine):
    """Subclass with ``variant`` and ``recorder`` set, or use :func:`scheduler_machine`."""

    variant: ClassVar[str]
    recorder: ClassVar[Recorder]
    vllm: ClassVar[bool] = True  # False: the model alone, every invariant checked

    @initialize(
        layout=st.sampled_from(LAYOUTS),
        gpu_blocks=st.integers(4, 10),
        cpu_blocks=st.one_of(st.integers(2, 4), st.integers(12, 32)),
        world_size=st.integers(1, 3),
        lazy=st.integers(0, 2).map(lambda n: n == 2),
        kv_events=st.integers(0, 2).map(lambda n: n == 2),
        whole=st.booleans(),
        first=PROMPTS,
    )
    def setup(
        self,
        layout: tuple[tuple[int, ...], int],
        gpu_blocks: int,
        cpu_blocks: int,
        world_size: int,
        lazy: bool,
        kv_events: bool,
        whole: bool,
        first: list[int],
    ) -> None:
        self.started = time.perf_counter()
        sizes, hbs = layout
        gpu_blocks *= len(sizes)  # a block per group and position
        self.config = OffloadConfig(
            gpu_blocks, cpu_blocks, sizes, hbs, world_size, lazy, kv_events=kv_events
        )
        self.whole = whole
        variant = type(self).variant
        self.model = OffloadModel(
            self.config,
            variant=variant,
            check=keeps_invariants(variant),
            scheduling=scheduling(whole),
        )
        self.target: VllmScheduler | None = None
        try:
            if type(self).vllm:
                self.target = VllmScheduler(self.config, whole)
        except Exception as error:
            raise SetupError(
                f"vLLM's scheduler cannot be built for {self.config}: {as_outcome(error)}"
            ) from error
        self.program: list[Call] = []
        self.model_events: list[KVEvent] = []
        self.prompts: list[list[int]] = []
        self.next_id = 0
        self.rule_steps = 0
        type(self).recorder.programs += 1
        type(self).recorder.failure = None
        self.admit(first, 2, False, "add_request", continued=False)

    def run(self, call: Call, rule_name: str, continued: bool = False) -> None:
        rec = type(self).recorder
        rec.steps += 1
        self.program.append(call)
        if not continued:
            rec.count(rec.rules, rule_name)
            self.rule_steps += 1
            rec.rule_steps += 1
        n = len(self.program) - 1
        if self.target is None:
            found = invariant_broken(self.model, call, n)
        else:
            found = compare_call(self.model, self.target, call, n, self.model_events)
        if found:
            if rec.first_failure is None:
                rec.first_failure = time.perf_counter() - rec.started
                rec.first_failing_program = rec.programs
            rec.failure = {
                "disagreement": found,
                "config": repr(self.config),
                "whole_sequence_admission": self.whole,
                "variant": type(self).variant,
                "vllm": self.target is not None,
                "program": list(self.program),
                "rules": self.rule_steps,
            }
            raise AssertionError(f"{found}\n\nreproduce with:\n{reproducer(rec.failure)}")

    def teardown(self) -> None:
        if hasattr(self, "program"):
            type(self).recorder.timed(
                "scheduler", len(self.program), time.perf_counter() - self.started
            )

    def admit(
        self, tokens: list[int], max_tokens: int, skip: bool, rule_name: str, continued: bool
    ) -> None:
        # Three live requests at most, each able to run alone (blocks for its prompt and
        # outputs, the null block aside), so that preemption ends.
        need = sum(-(-(len(tokens) + max_tokens) // size) for size in self.config.group_block_sizes)
        if len(self.model.live_requests()) >= 3 or need >= self.config.gpu_blocks:
            return
        call: Call = ("add", f"r{self.next_id}", tokens, max_tokens)
        self.run((*call, True) if skip else call, rule_name, continued)
        self.prompts.append(tokens)
        self.next_id += 1

    @rule(tokens=PROMPTS, max_tokens=MAX_TOKENS, skip=SKIP_READING)
    def add_request(self, tokens: list[int], max_tokens: int, skip: bool) -> None:
        self.admit(tokens, max_tokens, skip, "add_request", continued=False)

    # An earlier prompt again, as it was or with a new tail: GPU and CPU hits.
    @precondition(lambda self: bool(self.prompts))
    @rule(data=st.data(), tail=TAILS, max_tokens=MAX_TOKENS, skip=SKIP_READING)
    def repeat_request(
        self, data: st.DataObject, tail: list[int], max_tokens: int, skip: bool
    ) -> None:
        earlier = data.draw(st.sampled_from(self.prompts))
        self.admit(earlier + tail, max_tokens, skip, "repeat_request", continued=False)

    @rule(budget=BUDGETS, steps=st.integers(1, 3), report=REPORTS)
    def step(self, budget: int, steps: int, report: bool) -> None:
        for n in range(steps):
            self.run(("step", budget, report), "step", continued=n > 0)

    # Steps with every report until no request is live: a prompt computed, stored and out
    # of the GPU's way in one rule, so that repeats find it on the CPU.
    @rule(budget=st.integers(8, 32))
    def settle(self, budget: int) -> None:
        self.settle_steps(budget, "settle", first=True)

    def settle_steps(self, budget: int, rule_name: str, first: bool) -> None:
        for n in range(SETTLE_ROUNDS):
            if not self.model.live_requests() and not self.model.has_pending_stores():
                return
            self.run(("step", budget, True), rule_name, continued=not (first and n == 0))

    # Earlier prompts loaded back from the CPU: the engine runs idle, the GPU's prefix cache
    # is reset (the CPU's kept), and one or two earlier prompts come again, then a step of a
    # small budget whose loads are not yet reported. Two loads in flight, or one beside a
    # chunked prefill, meet vLLM's reservations for asynchronous loads.
    @precondition(lambda self: bool(self.prompts))
    @rule(
        data=st.data(),
        count=st.integers(1, 2),
        tail=TAILS,
        max_tokens=MAX_TOKENS,
        budget=st.integers(1, 12),
    )
    def reload(
        self, data: st.DataObject, count: int, tail: list[int], max_tokens: int, budget: int
    ) -> None:
        rule_steps = self.rule_steps
        self.settle_steps(32, "reload", first=True)
        self.run(("reset_prefix_cache", False), "reload", continued=self.rule_steps > rule_steps)
        for _ in range(count):
            earlier = data.draw(st.sampled_from(self.prompts))
            self.admit(earlier + tail, max_tokens, False, "reload", continued=True)
        self.run(("step", budget, False), "reload", continued=True)

    @precondition(lambda self: bool(self.model.live_requests()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.run(("abort", data.draw(st.sampled_from(self.model.live_requests()))), "abort")

    # A weight update in the middle of generation preempts every running request first, one
    # reset in three; drawn only where that frees every GPU block (vLLM raises otherwise,
    # once it has preempted).
    @rule(reset_connector=st.booleans(), running=st.integers(0, 2).map(lambda n: n == 2))
    def reset_prefix_cache(self, reset_connector: bool, running: bool) -> None:
        if running and not self.model.engine.blocks_kept_from_reset():
            self.run(("reset_prefix_cache", reset_connector, True), "reset_prefix_cache")
        else:
            self.run(("reset_prefix_cache", reset_connector), "reset_prefix_cache")


def invariant_broken(model: OffloadModel, call: Call, n: int) -> str | None:
    """Call ``n`` on the model alone: the invariant it breaks, or None."""
    try:
        model_call(model, call)
    except InvariantViolation as error:
        return f"call {n} {call!r}: {error}"
    return None


def scheduler_machine(
    variant: str, recorder: Recorder, vllm: bool = True
) -> type[SchedulerMachine]:
    if not vllm and not keeps_invariants(variant):
        raise ValueError(f"the model alone is checked by its invariants, which {variant} breaks")
    return type(
        "VllmSchedulerMachine" if vllm else "SchedulingMachine",
        (SchedulerMachine,),
        {"variant": variant, "recorder": recorder, "vllm": vllm},
    )


def reproducer(failure: dict[str, Any]) -> str:
    """A runnable program that replays ``failure``: a ``first_difference`` call, or without
    vLLM, the model with every invariant checked."""
    if not failure.get("vllm", True):
        return (
            "from kvoffload.model import OffloadConfig, OffloadModel\n"
            "from kvoffload.upstream.scheduler import model_call, scheduling\n\n"
            f"program = {failure['program']!r}\n"
            f"model = OffloadModel({failure['config']}, {failure['variant']!r}, check=True, "
            f"scheduling=scheduling({failure['whole_sequence_admission']}))\n"
            "for call in program:\n"
            "    print(call, model_call(model, call))\n"
        )
    return (
        "from kvoffload.model import OffloadConfig\n"
        "from kvoffload.upstream.scheduler import first_difference\n\n"
        f"program = {failure['program']!r}\n"
        f"print(first_difference({failure['config']}, program, {failure['variant']!r}, "
        f"whole_sequence_admission={failure['whole_sequence_admission']}))\n"
    )


def run_scheduler_check(
    variant: str,
    profile: settings,
    seconds: float | None,
    seed: int | None = None,
    vllm: bool = True,
) -> dict[str, Any]:
    """The machine over vLLM's scheduler against ``variant`` of the model, for ``profile``'s
    examples (a quarter of them: a program here costs about four of the offload target's),
    or in batches for ``seconds``; the result as :func:`kvoffload.upstream.check.run_checks`
    reports one. A random profile runs batch ``k`` from seed ``seed + k`` (``seed`` drawn
    when not given), as the offload machine's campaign does. ``vllm=False``: the model
    alone, held to its invariants."""
    recorder = Recorder()
    machine = scheduler_machine(variant, recorder, vllm)
    examples = max(1, profile.max_examples // 4)
    batch = settings(profile, max_examples=25 if seconds else examples)
    if seed is None and not batch.derandomize:
        seed = random.getrandbits(32)
    start = time.perf_counter()
    failure: dict[str, Any] | None = None
    for n in itertools.count():
        if seed is not None:
            hypothesis_seed(seed + n)(machine)
        try:
            run_state_machine_as_test(machine, settings=batch)
        except (AssertionError, Flaky):
            failure = recorder.failure
            if failure is None:
                raise
        elapsed = time.perf_counter() - start
        if failure is not None or not seconds or elapsed >= seconds:
            break
    return {
        "variant": variant,
        "machine": "scheduler",
        "conforms": failure is None,
        "seconds": round(elapsed, 1),
        "seed": seed,
        "programs": recorder.programs,
        "rule_steps": recorder.rule_steps,
        "driver_calls": recorder.steps,
        "rules": dict(sorted(recorder.rules.items())),
        "seconds_to_first_failure": recorder.first_failure,
        "programs_to_first_failure": recorder.first_failing_program,
        "disagreement": None if failure is None else failure["disagreement"],
        "failure": failure,
        "reproducer": None if failure is None else reproducer(failure),
        "saved": None,
    }
