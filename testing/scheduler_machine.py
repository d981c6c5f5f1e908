"""The conformance machine over vLLM's own scheduler (:mod:`kvoffload.vllm_target.scheduler`):
random programs of requests, steps, aborts and resets drive vLLM's ``Scheduler`` with its
SimpleCPUOffload connector and the model in lockstep, compared after every call.

Draws as the conformance machine's (:mod:`kvoffload.testing.stateful`), so that shrinking
works and the rare paths happen: prompts from three stems and earlier prompts again (GPU and
CPU hits), tiny pools (eviction, failed allocation, preemption, the CPU pool full), small
budgets (chunked prefill), one full-attention group or two, up to three workers, lazy mode
and kv-cache events one program in three each, requests that skip reading the prefix cache,
vLLM's whole-sequence admission on or off, resets that preempt the running requests. Each
step reports the stores and loads sent so far complete, or (one step in four) holds them back
to a later step's output; the ``report_some`` rule's steps report some of those owed, in any
interleaving of events and workers, and the ``interleave`` and ``reload_interleaved`` rules
hold every report for a few steps, then report them latest first or in a drawn order (every
class of :mod:`kvoffload.testing.interleavings` in one program in twenty). The model is the
release's variant with vLLM 0.34.0's scheduling (:data:`~kvoffload.model.engine.VLLM_SCHEDULING`).

A check of the release table names this machine with ``machine="scheduler"``
(:mod:`kvoffload.vllm_target.releases`); ``kvoffload verify --target vllm==X`` runs it beside the
offload target, in the same measured process.

Without vLLM (``vllm=False``) the same programs drive the model alone, every invariant checked
after every call: the scheduling vLLM's scheduler taught the model (its admission gates,
resets that preempt, worker outputs processed as vLLM does) held to the model's own
invariants, which a release's variant that breaks them cannot be (its check is off there).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvoffload.model import OffloadConfig, OffloadModel, SetupError
from kvoffload.model.errors import ConfigError
from kvoffload.model.types import KVEvent
from kvoffload.model.variants import keeps_invariants
from kvoffload.testing import reduce
from kvoffload.testing.campaign import campaign_batch, check_record
from kvoffload.testing.failure import MODEL_ALONE, SCHEDULER, WORKER, Failure
from kvoffload.testing.lockstep import Call, as_outcome
from kvoffload.testing.machine import LockstepMachine, Recorder, run_machine_campaign
from kvoffload.testing.scheduler_lockstep import (
    compare_call,
    first_difference,
    invariant_broken,
    scheduling,
)
from kvoffload.testing.stateful import KIND_ORDERS, ORDERS, PROMPTS, SKIP_READING, TAILS
from kvoffload.testing.targets import TargetSpec, spec
from kvoffload.vllm_target.worker import LAYOUTS as LAYOUT_NAMES
from kvoffload.vllm_target.worker import WorkerLayout, layouts_for

# Full-attention groups: one of blocks of 4 or 8 (vLLM's one-group coordinator hashes whole
# blocks only), or two of 4 and 8 tokens hashed in blocks of 4 (the hybrid coordinator: keys
# only up to the scheduler block of 8, secondary keys on the group of 8).
LAYOUTS = [((4,), 4), ((8,), 8), ((4, 8), 4)]
BUDGETS = st.integers(1, 24)
SETTLE_ROUNDS = 12
# Stores and loads reported in the step's own output three steps in four.
REPORTS = st.integers(0, 3).map(lambda n: n != 3)
# Which of the reports owed a step's output makes (kvoffload.vllm_target.scheduler.picked).
PICKS = st.lists(st.integers(0, 5), max_size=3)
# Longer decodes than the offload machine's: running requests that grow preempt others.
MAX_TOKENS = st.one_of(st.just(1), st.integers(1, 12))
# The interleaving rules' held steps before their reports, and the most steps that report
HELD_STEPS, INTERLEAVE_BUDGETS = st.integers(2, 3), st.integers(4, 16)
REPORTING_STEPS = 6


def setup_rule(
    **extra: st.SearchStrategy[Any],
) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """The rule that draws the configuration at the start of a program (the worker machine
    adds its layout, drawn after the rest: the scheduler machine's stream stays)."""
    # (``extra`` cannot name initialize's own ``target``: mypy cannot tell)
    rule: Callable[[Callable[..., None]], Callable[..., None]] = initialize(  # type: ignore[call-overload]
        layout=st.sampled_from(LAYOUTS),
        gpu_blocks=st.integers(4, 10),
        cpu_blocks=st.one_of(st.integers(2, 4), st.integers(12, 32)),
        world_size=st.integers(1, 3),
        lazy=st.integers(0, 2).map(lambda n: n == 2),
        kv_events=st.integers(0, 2).map(lambda n: n == 2),
        whole=st.booleans(),
        first=PROMPTS,
        **extra,
    )
    return rule


# The layouts of the workers' KV caches: one to three layers a group, one or two heads, any
# physical layout (mapped to one vLLM's planner takes for the groups drawn), pinned host
# memory or the disk backend.
WORKER_LAYOUTS = st.builds(
    WorkerLayout,
    layers=st.integers(1, 3),
    heads=st.integers(1, 2),
    head_size=st.sampled_from((4, 2)),
    layout=st.sampled_from(LAYOUT_NAMES),
    backend=st.sampled_from(("cpu", "cpu", "cpu", "disk")),  # the disk backend one in four
)


class SchedulerMachine(LockstepMachine):
    """Subclass with ``variant`` and ``recorder`` set, or use :func:`scheduler_machine`."""

    # the registry's row of the target whose scheduler it drives; None: the model alone,
    # every invariant checked
    target_spec: ClassVar[TargetSpec | None]

    @setup_rule()
    def setup(self, **drawn: Any) -> None:
        self.begin_program(**drawn)

    def begin_program(
        self,
        layout: tuple[tuple[int, ...], int],
        gpu_blocks: int,
        cpu_blocks: int,
        world_size: int,
        lazy: bool,
        kv_events: bool,
        whole: bool,
        first: list[int],
        workers: WorkerLayout | None = None,
    ) -> None:
        """The program's configuration as drawn (with the worker machine's layout)."""
        started = time.perf_counter()
        sizes, hbs = layout
        gpu_blocks *= len(sizes)  # a block per group and position
        config = OffloadConfig(
            gpu_blocks, cpu_blocks, sizes, hbs, world_size, lazy, kv_events=kv_events
        )
        self.whole = whole
        if workers is not None and workers.layout not in layouts_for(config):
            # (a layout vLLM's planner refuses for these groups: the one it takes in its place)
            allowed = layouts_for(config)
            workers = workers._replace(
                layout=allowed[LAYOUT_NAMES.index(workers.layout) % len(allowed)]
            )
        self.workers = workers
        variant = type(self).variant
        self.model = OffloadModel(
            config,
            variant=variant,
            check=keeps_invariants(variant),
            scheduling=scheduling(whole),
        )
        self.target: Any = None
        row = type(self).target_spec
        try:
            if row is not None:
                assert row.scheduler is not None
                self.target = (
                    row.scheduler(config, whole, self.workers)
                    if self.workers is not None
                    else row.scheduler(config, whole)
                )
        except Exception as error:
            raise SetupError(
                f"vLLM's scheduler cannot be built for {config}: {as_outcome(error)}"
            ) from error
        self.model_events: list[KVEvent] = []
        self.begin(config, "scheduler", started)
        self.admit(first, 2, False, "add_request", continued=False)

    def close_target(self) -> None:
        # vLLM's workers let their threads, devices and files go with their program
        if getattr(self, "target", None) is not None:
            self.target.close()

    def check(self, call: Call, n: int) -> str | None:
        if self.target is None:
            return invariant_broken(self.model, call, n, self.workers)
        return compare_call(self.model, self.target, call, n, self.model_events)

    def failure(self, found: str) -> Failure:
        row = type(self).target_spec
        return Failure(
            MODEL_ALONE if row is None else row.name,
            type(self).variant,
            self.config,
            tuple(self.program),
            self.rule_steps,
            found,
            release=None if row is None else row.release(),
            target=None if row is None else row.identity(),
            machine=SCHEDULER if self.workers is None else WORKER,
            whole_sequence_admission=self.whole,
            workers=self.workers,
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

    # Steps whose outputs report some of the completions owed (issue 34): some workers of a
    # store event and the rest later, a later event before an earlier one, a load before a
    # store sent earlier. Reporting every store for every worker in one output, as vLLM's own
    # test helper does, lets a bug in the per-worker counts escape.
    @rule(budget=BUDGETS, steps=st.integers(1, 3), data=st.data())
    def report_some(self, budget: int, steps: int, data: st.DataObject) -> None:
        for n in range(steps):
            picks = data.draw(PICKS)
            self.run(("step", budget, False, picks), "report_some", continued=n > 0)

    # The workers' reports in an order of their own (issue 34), as the offload machine's rule
    # of that name makes them: a new prompt of two scheduler blocks and more, then two or
    # three steps of a few blocks' tokens whose outputs report nothing, so that several
    # events are owed at once, then steps that report them latest first (stores before
    # loads or loads before stores, each event in a step of its own) or in a drawn order
    # (each worker's report of a store in a step of its own). With ``report_some`` alone,
    # stores completed out of order in 1 program of 162 of the ci stream, a store passed a
    # load in none (a step's picks seldom meet several events owed).
    @rule(
        data=st.data(),
        fresh=PROMPTS,
        budget=INTERLEAVE_BUDGETS,
        steps=HELD_STEPS,
        order=ORDERS,
    )
    def interleave(
        self, data: st.DataObject, fresh: list[int], budget: int, steps: int, order: str
    ) -> None:
        # (a token past two scheduler blocks, so that each held step can store a block)
        size = 2 * self.config.scheduler_block_size + 1
        rule_steps = self.rule_steps
        self.admit(fresh * -(-size // len(fresh)), 1, False, "interleave", continued=False)
        for n in range(steps):
            started = n > 0 or self.rule_steps > rule_steps
            self.run(("step", budget, False), "interleave", continued=started)
        self.report_owed(data, budget, order, "interleave")

    # The same over loads: the engine runs idle and the GPU's prefix cache is reset, then
    # three held steps: a new prompt before the first (its stores issued from there), an
    # earlier prompt the CPU holds before each of the others (a load each, the second
    # issued after the first's and after stores).
    @precondition(lambda self: bool(self.prompts))
    @rule(data=st.data(), budget=st.integers(4, 24), fresh=PROMPTS, order=KIND_ORDERS)
    def reload_interleaved(
        self, data: st.DataObject, budget: int, fresh: list[int], order: str
    ) -> None:
        rule_steps = self.rule_steps
        self.settle_steps(32, "reload_interleaved", first=True)
        started = self.rule_steps > rule_steps
        self.run(("reset_prefix_cache", False), "reload_interleaved", continued=started)
        loaded: list[list[int]] = []
        for n in range(3):
            if n == 0:
                # (a scheduler block and a token at least, so that a block of it is stored)
                size = self.config.scheduler_block_size + 1
                self.admit(fresh * -(-size // len(fresh)), 1, False, "reload_interleaved", True)
            else:
                # (a prompt the CPU would serve, another than the first load's where there
                # is one; the model's lookup is read-only)
                held = [p for p in self.prompts if self.model.lookup(p)]
                others = [p for p in held if p not in loaded] or held
                if others:
                    loaded.append(data.draw(st.sampled_from(others)))
                    self.admit(loaded[-1], 1, False, "reload_interleaved", True)
            self.run(("step", budget, False), "reload_interleaved", continued=True)
        self.report_owed(data, budget, order, "reload_interleaved")

    def report_owed(self, data: st.DataObject, budget: int, order: str, rule_name: str) -> None:
        """The reports owed, at most :data:`REPORTING_STEPS` steps of ``budget`` tokens each
        reporting one part, in ``order``; a part a step's output cannot make any more (its
        request aborted, its event reported) is passed over. Each step's picks index the
        reports owed before it as :func:`kvoffload.vllm_target.scheduler.picked` reads them
        (a step that sends a load of its own shifts the stores' by one: a report then picks
        another, which the interleaving table counts as it is)."""
        parts: list[tuple[str, int, int | None]]
        if order == "drawn":
            parts = data.draw(st.permutations(self.owed_reports()))
        else:
            # latest first, one kind before the other, a store event's workers in one output
            first = "load" if order == "loads latest first" else "store"
            events = sorted({(kind, e) for kind, e, _ in self.owed_reports()})
            events.sort(key=lambda part: (part[0] != first, -part[1]))
            parts = [(kind, e, None) for kind, e in events]
        for part in parts[:REPORTING_STEPS]:
            owed = self.owed_reports()
            picks = [i for i, report in enumerate(owed) if _matches(report, part)]
            if picks:
                self.run(("step", budget, False, picks), rule_name, continued=True)

    def owed_reports(self) -> list[tuple[str, int, int]]:
        """The reports owed as a step's picks index them (``picked``): each load event
        (worker -1), then each (event, worker) store report."""
        model = self.model
        loads = sorted({e for e, _ in model.outstanding("load")})
        return [("load", e, -1) for e in loads] + [
            ("store", *r) for r in model.outstanding("store")
        ]

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


def _matches(report: tuple[str, int, int], part: tuple[str, int, int | None]) -> bool:
    """Whether ``report`` (kind, event, worker; -1 for a load's) is of ``part`` (a worker's
    report, or with worker None every report of an event)."""
    return report[:2] == part[:2] and part[2] in (None, report[2])


class WorkerMachine(SchedulerMachine):
    """The worker machine (issue 33): the scheduler machine's programs with vLLM's own
    workers on every rank, their KV caches laid out as a drawn layout says."""

    @setup_rule(workers=WORKER_LAYOUTS)
    def setup(self, **drawn: Any) -> None:
        self.begin_program(**drawn)


def scheduler_machine(
    variant: str,
    recorder: Recorder,
    vllm: bool = True,
    target: str = "vllm",
    workers: bool = False,
) -> type[SchedulerMachine]:
    """The machine over ``target``'s scheduler (a row of the registry with one), or without
    ``vllm`` over the model alone, compared with (or held to) ``variant``; with ``workers``
    the worker machine: vLLM's own workers on every rank beside it."""
    if not vllm and not keeps_invariants(variant):
        raise ValueError(f"the model alone is checked by its invariants, which {variant} breaks")
    row = spec(target) if vllm else None
    if row is not None and row.scheduler is None:
        raise ConfigError(f"the target {target!r} has no scheduler for the scheduler machine")
    # The class name seeds a derandomized run (as the offload machine's, machine_for).
    name = "VllmSchedulerMachine" if vllm else "SchedulingMachine"
    return type(
        "VllmWorkerMachine" if workers else name,
        (WorkerMachine if workers else SchedulerMachine,),
        {"variant": variant, "recorder": recorder, "target_spec": row},
    )


def reduced(failure: Failure) -> Failure:
    """``failure`` reduced (:func:`kvoffload.testing.reduce.reduced`), each candidate
    replayed on a fresh scheduler and model."""
    assert failure.whole_sequence_admission is not None
    whole, vllm = failure.whole_sequence_admission, failure.adapter != MODEL_ALONE

    def disagrees(config: OffloadConfig) -> Callable[[list[Call]], str | None]:
        return lambda calls: first_difference(
            config, calls, failure.variant, whole, vllm, failure.workers
        )

    return reduce.reduced(failure, disagrees)


def run_scheduler_check(
    variant: str,
    profile: settings,
    seconds: float | None,
    seed: int | None = None,
    vllm: bool = True,
    workers: bool = False,
) -> dict[str, Any]:
    """The machine over vLLM's scheduler against ``variant`` of the model, for ``profile``'s
    examples (a quarter of them: a program here costs about four of the offload target's),
    or in batches for ``seconds`` (:func:`kvoffload.testing.campaign.campaign_batch`); its
    failure reduced and saved as the offload machine's are; the result as
    :func:`kvoffload.testing.campaign.check_record` reports one. ``vllm=False``: the model
    alone, held to its invariants."""
    machine = scheduler_machine(variant, Recorder(), vllm, workers=workers)
    # (a worker machine's program costs several of the scheduler machine's)
    examples = max(1, profile.max_examples // (16 if workers else 4))
    batch = campaign_batch(settings(profile, max_examples=examples), seconds, profile.database)
    result = run_machine_campaign(
        machine, "vllm" if vllm else MODEL_ALONE, batch, reduced, seconds, seed
    )
    return check_record(result, variant, WORKER if workers else SCHEDULER)
