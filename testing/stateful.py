"""The conformance state machine: random programs drive the model and an implementation
in lockstep, compared after every call (results, snapshots, KV bytes), with the model's
``check()`` of every invariant. Parameterize it with an adapter (:func:`machine_for`).

Rules are few and draws small, so that shrinking works: requests come from three token
stems (prefixes are shared) and earlier prompts come back (CPU hits), budgets are small,
pools tiny (4 to 8 GPU blocks; 2 to 4 CPU blocks, or 12 to 32) so that eviction, failed
allocation and the CPU capacity limit happen, hash blocks may be smaller than blocks
(secondary keys), and up to 4 workers report completions in any order. ``docs/conformance.md``
explains each rule.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvoffload.model import OffloadConfig, OffloadModel, SetupError
from kvoffload.model.invariants import exercised
from kvoffload.model.keys import prefix_digests
from kvoffload.model.lookup import find_longest_cache_hit
from kvoffload.model.validate import MAX_TOKEN_ID
from kvoffload.model.variants import keeps_invariants
from kvoffload.testing.adapters import Adapter, Target
from kvoffload.testing.efficiency import ProgramEfficiency
from kvoffload.testing.failure import Failure, validate
from kvoffload.testing.interleavings import Interleavings
from kvoffload.testing.lockstep import (
    Call,
    agreement,
    as_outcome,
    compare,
    outcome,
    target_outcome,
)
from kvoffload.testing.machine import LockstepMachine, Recorder
from kvoffload.testing.profiles import without_local_constants
from kvoffload.testing.targets import TargetSpec, spec, variant_of

# (group block sizes, hash block size, sliding windows, attention chunks): full attention,
# then hybrid layouts with one sliding-window group whose window the prompts slide past. A
# window of 3 needs a run of one block, so that a prompt of 8 tokens (4 blocks in all) already
# leaves a block behind its window: a freed window block then comes back through a repeat's
# hit (S14's class). In the second and third, that run is shorter than a scheduler block
# (two), so only every other block of the window group gets a key (S3's class), and a block
# that left the window without one goes to the head of the free queue, where the next
# allocation reuses it (the live bug window-stale-ids): with blocks of 2 tokens, every other
# token. The last two have a chunked local group (Llama 4's layout) with chunks of two
# scheduler blocks: a GPU hit of one block ends inside a chunk, where a CPU hit must not
# follow (S24's class); with hash blocks of 2 the full-attention group's blocks are half
# the chunked group's. The last two have a Mamba group (align mode) beside full attention:
# its states at every scheduler block, or, beside full-attention blocks of 8, at every other
# of its blocks (a state that ends off the scheduler's alignment is no hit); in the last, Mamba
# blocks of 16 hashed in blocks of 4 turn fine-grained hits on: full attention's blocks of 16
# register the prompt's tail inside them (at 4, 8 or 12 tokens: most prompts have one), and a
# finishing request's final flush stores it (vLLM 0.33.0 on). The model's own
# test (tests/test_model_stateful.py) also draws longer runs, three groups and longer chunks.
Layout = tuple[
    tuple[int, ...], int, tuple[int | None, ...], tuple[int | None, ...], tuple[bool, ...]
]
LAYOUTS: list[Layout] = [
    ((4,), 4, (), (), ()),
    ((4,), 2, (), (), ()),
    ((8,), 4, (), (), ()),
    ((4, 8), 4, (), (), ()),
    ((4, 4), 4, (None, 3), (), ()),
    ((8, 4), 4, (None, 3), (), ()),
    ((4, 2), 2, (None, 3), (), ()),
    ((4, 4), 4, (), (None, 8), ()),
    ((2, 4), 2, (), (None, 8), ()),
    ((4, 4), 4, (), (), (False, True)),
    ((8, 4), 4, (), (), (False, True)),
    ((16, 16), 4, (), (), (False, True)),
]

# What a seed draws must not depend on what else is imported (testing/profiles.py).
without_local_constants()


# Prompts from three stems, so that prefixes are shared, with up to two tokens after the
# stem, so that they also diverge. Half are exact block multiples without a tail: that is
# where a full hit stops one block short and the request recomputes its last block.
def _prompt(stem: int, length: int, tail: list[int]) -> list[int]:
    return [(stem * 5 + i) % 7 for i in range(length)] + tail


TAILS = st.lists(st.integers(0, 3), max_size=2)
PROMPTS = st.one_of(
    st.builds(_prompt, st.integers(0, 2), st.sampled_from([4, 8, 12, 16]), st.just([])),
    st.builds(_prompt, st.integers(0, 2), st.integers(1, 16), TAILS),
)
# One output token half the time: the request then finishes in the step that computes its
# last blocks, and they go out in the final flush.
MAX_TOKENS = st.one_of(st.just(1), st.integers(1, 6))
# A request that skips reading the prefix cache (prompt logprobs), one in eight (each one
# is a CPU hit not taken: more would make loads rare); shrinks to an ordinary request.
SKIP_READING = st.integers(0, 7).map(lambda n: n == 7)
SETTLE_ROUNDS = 8  # requests that deadlock on a full pool (no preemption) stop it
HOLD_OUTPUTS = 4  # a filler held by ``evict`` decodes this long: it keeps its blocks
BUDGETS = st.integers(0, 24)
SETTLE_MIN_BUDGET, SETTLE_MAX_BUDGET = 8, 32  # a prompt and its outputs in a few rounds
SETTLE_BUDGETS = st.integers(SETTLE_MIN_BUDGET, SETTLE_MAX_BUDGET)
# The orders in which the interleaving rules make the reports owed (testing/interleavings.py)
KIND_ORDERS = st.sampled_from(("stores latest first", "loads latest first"))
ORDERS = st.sampled_from(
    ("stores latest first", "loads latest first") * 2 + ("drawn",)  # (two in five of each)
)
INTERLEAVE_BUDGETS, INTERLEAVE_STEPS = st.integers(1, 24), st.integers(1, 3)
# Tiny pools, so that eviction, failed allocation and the CPU capacity limit happen.
SETUP = initialize(
    layout=st.sampled_from(LAYOUTS),
    gpu_blocks=st.integers(4, 8),
    # the CPU pool tiny (its capacity limits the flush) or larger than the GPU's (hits)
    cpu_blocks=st.one_of(st.integers(2, 4), st.integers(12, 32)),
    world_size=st.integers(1, 4),
    first=PROMPTS,
    # lazy offloading one program in three (a configuration of the connector, as in vLLM)
    lazy=st.integers(0, 2).map(lambda n: n == 2),
    # kv-cache events published and compared after every call, one program in three
    kv_events=st.integers(0, 2).map(lambda n: n == 2),
    # decode context parallelism over two ranks, one program in three where the layout
    # allows it (full attention only)
    dcp=st.integers(0, 2).map(lambda n: 2 if n == 2 else 1),
)


def busy(model: OffloadModel) -> bool:
    """Whether the engine has work left: a live request, a completion owed, a store queued."""
    return bool(
        model.live_requests()
        or model.outstanding("store")
        or model.outstanding("load")
        or model.has_pending_stores()
    )


def settle_round(budget: int, reports_stats: bool) -> list[Call]:
    """The calls of one round of the ``settle`` rule: a step, a drain, the stats drained."""
    return [("step", budget), ("drain",), *([("stats",)] if reports_stats else [])]


def settle_calls(model: OffloadModel, budget: int, reports_stats: bool) -> list[Call]:
    """The calls the ``settle`` rule makes from ``model``'s state, applied to ``model`` as
    they are made: the rule's program, for a reduction that groups calls into rules."""
    calls: list[Call] = []
    for _ in range(SETTLE_ROUNDS):
        if not busy(model):
            break
        for call in settle_round(budget, reports_stats):
            outcome(model, call)
            calls.append(call)
    return calls


class ConformanceMachine(LockstepMachine):
    """Subclass with ``adapter`` set, or use :func:`machine_for`."""

    adapter_name: ClassVar[str] = "impl"
    target_spec: ClassVar[TargetSpec]  # the registry's row of the target
    injects: ClassVar[bool] = True  # the target takes injected faults
    resets: ClassVar[bool] = True  # the target has reset() (vLLM's offload code from 0.24.0)
    reports_stats: ClassVar[bool] = True  # the target has stats() (vLLM's from 0.31.0)
    # False: every call applied to both sides and nothing checked (no comparison, the
    # model's invariants unchecked): what the machine costs without its checks, measured by
    # ``kvoffload bench`` beside it
    checks: ClassVar[bool] = True
    adapter: ClassVar[Adapter]

    model: OffloadModel
    target: Target
    efficiency: ProgramEfficiency

    @SETUP
    def setup(
        self,
        layout: Layout,
        gpu_blocks: int,
        cpu_blocks: int,
        world_size: int,
        first: list[int],
        lazy: bool,
        kv_events: bool,
        dcp: int,
    ) -> None:
        started = time.perf_counter()
        groups, hbs, windows, chunks, mamba = layout
        if windows or chunks or mamba:
            # Two groups hold a block each per position: twice the blocks, so that prompts
            # long enough to slide past the window still run alone in one chunk. vLLM's
            # coordinator allows decode context parallelism for full attention only.
            gpu_blocks *= 2
            dcp = 1
        # The DCP ranks split the tensor-parallel world: an odd world is made even for two.
        world_size += world_size % dcp
        config = OffloadConfig(
            gpu_blocks,
            cpu_blocks,
            groups,
            hbs,
            world_size,
            lazy,
            sliding_windows=windows,
            kv_events=kv_events,
            attention_chunks=chunks,
            dcp_world_size=dcp,
            mamba=mamba,
        )
        # vLLM rejects some layouts (one group hashed in smaller blocks): not drawn for it.
        assume(type(self).target_spec.unsupported(config) is None)
        # A variant with a bug breaks invariants by design: it is compared, not checked.
        variant = type(self).variant
        self.model = OffloadModel(
            config, variant=variant, check=keeps_invariants(variant) and type(self).checks
        )
        try:
            self.target = type(self).adapter(config)
        except Exception as error:
            # Not a verdict on the target: the environment cannot build it (vLLM missing a
            # variable or a module, a device that is not there).
            raise SetupError(
                f"the target {type(self).adapter_name} cannot be built for {config}: "
                f"{as_outcome(error)}"
            ) from error
        self.begin(config, "hybrid" if windows or chunks or mamba else "full attention", started)
        self.efficiency = ProgramEfficiency(config)
        self.admit(first, 2, "add_request")

    def check(self, call: Call, n: int) -> str | None:
        if not type(self).checks:
            outcome(self.model, call)
            target_outcome(self.target, call)
            return None
        before = agreement(self.model, self.target)
        found = compare(self.model, self.target, call, n)
        rec = type(self).recorder
        for invariant in exercised(self.model.engine):
            rec.count(rec.invariants, invariant)
        after = agreement(self.model, self.target)
        if found is None and after is not None:
            # (measured on the target's own snapshots; never a verdict: issue 34)
            previous = before.target_snapshot if before is not None else None
            self.efficiency.observe(call, previous, after.target_snapshot, after.result)
        return found

    def failure(self, found: str) -> Failure:
        row = type(self).target_spec
        return Failure(
            type(self).adapter_name,
            type(self).variant,
            self.config,
            tuple(self.program),
            self.rule_steps,
            found,
            release=row.release(),
            target=row.identity(),
        )

    def teardown(self) -> None:
        if hasattr(self, "efficiency"):
            last = agreement(self.model, self.target)
            counts = self.efficiency.end(last.target_snapshot if last is not None else None)
            type(self).recorder.efficiency.add(counts)
        super().teardown()

    def close_target(self) -> None:
        # A target that holds threads or devices lets them go with its program.
        close = getattr(getattr(self, "target", None), "close", None)
        if close is not None:
            close()

    def fits(self, tokens: list[int], max_tokens: int) -> bool:
        """Whether a request can run alone in one chunk: every group holding a block per
        ``block_size`` tokens. A sliding-window group frees what left its window only from
        its second allocation on, and without preemption a request admitted on the smaller
        count (``OffloadConfig.blocks_for``, what ``add_request`` accepts) could wait for a
        chunk that never fits, keeping the machine from its other rules."""
        need = len(tokens) + max_tokens - 1
        return sum(-(-need // size) for size in self.config.group_block_sizes) < (
            self.config.gpu_blocks
        )

    @rule(tokens=PROMPTS, max_tokens=MAX_TOKENS, skip=SKIP_READING)
    def add_request(self, tokens: list[int], max_tokens: int, skip: bool) -> None:
        self.admit(tokens, max_tokens, "add_request", skip_reading=skip)

    # A repeated prompt is what offloading is for, and independent draws from PROMPTS rarely
    # repeat one: the CPU hit paths (a hit's pin while allocation fails, a final flush over
    # blocks already stored) need an earlier prompt again while its blocks are cached. It
    # comes back as it was or with a new tail (a follow-up turn): a hit never covers a
    # prompt's last token, so only a longer prompt can hit its last block.
    @rule(data=st.data(), tail=TAILS, max_tokens=MAX_TOKENS, skip=SKIP_READING)
    def repeat_request(
        self, data: st.DataObject, tail: list[int], max_tokens: int, skip: bool
    ) -> None:
        if self.prompts:
            earlier = data.draw(st.sampled_from(self.prompts))
            self.admit(earlier + tail, max_tokens, "repeat_request", skip_reading=skip)

    def admit(
        self,
        tokens: list[int],
        max_tokens: int,
        rule_name: str,
        continued: bool = False,
        remember: bool = True,
        skip_reading: bool = False,
    ) -> None:
        if len(self.model.live_requests()) >= 3 or not self.fits(tokens, max_tokens):
            return
        call: Call = ("add", f"r{self.next_id}", tokens, max_tokens)
        self.run((*call, True) if skip_reading else call, rule_name, continued)
        if remember:
            self.prompts.append(tokens)
        self.next_id += 1

    @rule(budget=BUDGETS, steps=st.integers(1, 3))
    def step(self, budget: int, steps: int) -> None:
        for n in range(steps):
            self.run(("step", budget), "step", continued=n > 0)

    # The engine running until idle (every request finished, every copy completed) in one
    # rule: a prompt computed, stored and out of the GPU's way is then a single step, so the
    # paths that need it (CPU hits, repeats over stored blocks) are within a few rules.
    @rule(budget=SETTLE_BUDGETS)
    def settle(self, budget: int) -> None:
        self.settle_rounds(budget, "settle", first=True)

    def settle_rounds(
        self, budget: int, rule_name: str, first: bool = False, until_idle: bool = True
    ) -> None:
        """Rounds of a step and a drain until the engine is idle (``until_idle``) or no
        request is live; ``first``: the rule's first call is this one's."""
        for n in range(SETTLE_ROUNDS):
            if not (self.busy() if until_idle else self.model.live_requests()):
                return
            for i, call in enumerate(settle_round(budget, self.reports_stats)):
                self.run(call, rule_name, continued=not (first and n == 0 and i == 0))

    def busy(self) -> bool:
        return busy(self.model)

    @precondition(lambda self: bool(self.model.live_requests()))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.run(("finish", data.draw(st.sampled_from(self.model.live_requests()))), "finish")

    @precondition(
        lambda self: bool(self.model.outstanding("store") + self.model.outstanding("load"))
    )
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        choices = [("store", *c) for c in self.model.outstanding("store")]
        choices += [("load", *c) for c in self.model.outstanding("load")]
        call = data.draw(st.sampled_from(choices))
        self.run(call, f"complete {call[0]}")
        self.read_stats()

    # The workers' reports in an order of their own (issue 34): one to three more steps, each
    # issuing its transfers, then every report owed made one call each, latest first (every
    # event, and an event's workers, in reverse; stores before loads or loads before stores),
    # or in a drawn order, so that
    # events complete out of issue order, a load passes a store and a store a load, and an
    # event's workers report apart and out of rank (testing/interleavings.py). With
    # `complete` alone (one report at random, in a stream that drains after most steps)
    # stores completed out of order in none of 300 programs of the ci stream, loads never.
    @rule(data=st.data(), budget=INTERLEAVE_BUDGETS, steps=INTERLEAVE_STEPS, order=ORDERS)
    def interleave(self, data: st.DataObject, budget: int, steps: int, order: str) -> None:
        issued = Interleavings()  # (what is owed, in the order it was issued)
        issued.observe(self.owed(), ())
        for n in range(steps):
            self.run(("step", budget), "interleave", continued=n > 0)
            issued.observe(self.owed(), ())
        self.report_owed(data, issued.in_issue_order(), order, "interleave")

    # The same over loads: the engine runs idle and the GPU's prefix cache is reset, then
    # four steps: a new prompt before the first (its stores issued in the next ones), an
    # earlier prompt the CPU holds before each of the others (a load each, the later ones
    # after the first stores). Its own rule, so that it is drawn as often as the other.
    @precondition(lambda self: self.resets and bool(self.prompts))
    @rule(
        data=st.data(),
        budget=SETTLE_BUDGETS,
        fresh=PROMPTS,
        order=KIND_ORDERS,
    )
    def reload_interleaved(
        self, data: st.DataObject, budget: int, fresh: list[int], order: str
    ) -> None:
        before = self.rule_steps
        self.settle_rounds(budget, "reload_interleaved", first=True)
        self.run(("reset_prefix_cache", False), "reload_interleaved", self.rule_steps > before)
        issued = Interleavings()
        loaded: list[list[int]] = []
        for n in range(4):
            if n == 0:
                # (a scheduler block and a token at least, so that a block of it is stored)
                size = self.config.scheduler_block_size + 1
                self.admit(fresh * -(-size // len(fresh)), 1, "reload_interleaved", True)
            else:
                # (a prompt the CPU would serve, another than the first load's where there
                # is one: its blocks are on the GPU by now; the model's lookup is read-only)
                held = [p for p in self.prompts if self.model.lookup(p)]
                others = [p for p in held if p not in loaded] or held
                if others:
                    loaded.append(data.draw(st.sampled_from(others)))
                    self.admit(loaded[-1], 1, "reload_interleaved", True, remember=False)
            self.run(("step", budget), "reload_interleaved", continued=True)
            issued.observe(self.owed(), ())
        self.report_owed(data, issued.in_issue_order(), order, "reload_interleaved")

    def report_owed(
        self, data: st.DataObject, issued: list[tuple[str, int]], order: str, rule_name: str
    ) -> None:
        """Every report owed, one call each, in ``order`` over ``issued``."""
        owed = self.owed()
        reports = [(k, e, w) for k, e in issued for e2, w in owed[k] if e2 == e]
        if order == "drawn":
            reports = data.draw(st.permutations(reports))
        else:
            # latest first, every event's workers in reverse too, one kind before the other
            reports.reverse()
            first = "store" if order == "stores latest first" else "load"
            reports.sort(key=lambda r: r[0] != first)
        for call in reports:
            self.run(call, rule_name, continued=True)
        self.read_stats()

    def owed(self) -> dict[str, list[tuple[int, int]]]:
        """Per kind, the (event, worker) reports still owed."""
        return {kind: self.model.outstanding(kind) for kind in ("store", "load")}

    @rule()
    def drain(self) -> None:
        self.run(("drain",), "drain")
        self.read_stats()

    def read_stats(self) -> None:
        """Drain the stats, as a metrics logger does between steps: part of the rule before
        it, and drawing nothing, so that comparing them adds calls to a program and never
        changes which rules and draws make it (issue 12)."""
        if self.reports_stats:
            self.run(("stats",), "stats", continued=True)

    @rule(data=st.data(), tokens=PROMPTS)
    def lookup(self, data: st.DataObject, tokens: list[int]) -> None:
        again: bool = bool(self.prompts) and data.draw(st.booleans())
        if again:
            tokens = data.draw(st.sampled_from(self.prompts))
        self.run(("lookup", tokens), "lookup")

    @precondition(lambda self: self.resets)
    @rule()
    def reset(self) -> None:
        self.run(("reset",), "reset")
        self.read_stats()

    # vLLM's Scheduler.reset_prefix_cache, with the connector's reset or without (vLLM issue
    # #57727: without it, vLLM reports success while the CPU tier still serves hits).
    @precondition(lambda self: self.resets)
    @rule(reset_connector=st.booleans())
    def reset_prefix_cache(self, reset_connector: bool) -> None:
        self.run(("reset_prefix_cache", reset_connector), "reset_prefix_cache")
        self.read_stats()

    # A trainer's weight update between generation rounds, what vLLM's
    # reset_prefix_cache(reset_connector=True) is for: the round runs until no request is
    # live, then both tiers are reset. The step that finishes the last request queues its
    # final flush (PR #53532), and no later step sends it: the reset must release it. Drawn
    # as one rule because a `reset` drawn at random lands right after a finishing step about
    # once in 200 resets, and the matrix found reset-leaks-flush on some streams only.
    @precondition(lambda self: self.resets and bool(self.model.live_requests()))
    @rule(budget=SETTLE_BUDGETS)
    def weight_update(self, budget: int) -> None:
        self.settle_rounds(budget, "weight_update", first=True, until_idle=False)
        self.run(("reset_prefix_cache", True), "weight_update", continued=True)
        self.read_stats()

    # The CPU tier measured on its own: the engine run until idle, the GPU's prefix cache
    # reset alone (reset_prefix_cache without the connector's reset), then an earlier prompt
    # again, run until idle: its blocks are cached in the CPU tier only, so it loads. Without
    # `evict` (the mutation matrix's machine) loads came in about one program in 40, and a
    # fault in a load's completion or its stats was found in some streams only after 900.
    # Two times in three, the prompt's first scheduler blocks (one or two, a shared system
    # prompt, leaving at least one to load) run on their own first: the prompt then hits the
    # GPU for them and the CPU for the rest (vLLM's partial GPU prefix plus CPU load). With
    # a chunked local group, a GPU hit of one block ends inside a chunk, where no CPU hit may
    # follow (S24's class).
    @precondition(lambda self: self.resets and bool(self.prompts))
    @rule(data=st.data(), budget=SETTLE_BUDGETS)
    def reload(self, data: st.DataObject, budget: int) -> None:
        earlier = data.draw(st.sampled_from(self.prompts))
        warm = data.draw(st.integers(0, 2))
        before = self.rule_steps
        self.settle_rounds(budget, "reload", first=True)
        self.run(("reset_prefix_cache", False), "reload", continued=self.rule_steps > before)
        self.read_stats()
        align = self.config.scheduler_block_size
        # at least a block is left to load: the last token is computed, not loaded
        warm_tokens = max(0, min(warm, (len(earlier) - 1) // align - 1)) * align
        if warm_tokens:
            self.admit(earlier[:warm_tokens], 1, "reload", continued=True, remember=False)
            self.settle_rounds(budget, "reload")
        self.admit(earlier, 1, "reload", continued=True, remember=False)
        self.settle_rounds(budget, "reload")

    # Faults injected into the target (issue 14): a worker whose copy failed, a cached host
    # block whose bytes were damaged. The model says what must follow (the integrity
    # contract of docs/spec.md), so a weakened integrity check is a disagreement like any
    # other. vLLM's scheduler side takes neither: not drawn for it.
    @precondition(lambda self: self.injects and bool(self.model.outstanding("store")))
    @rule(data=st.data())
    def fail_store(self, data: st.DataObject) -> None:
        event, worker = data.draw(st.sampled_from(self.model.outstanding("store")))
        self.run(("fail_store", event, worker), "fail_store")

    @precondition(lambda self: self.injects)
    @rule(data=st.data(), aimed=st.booleans())
    def corrupt(self, data: st.DataObject, aimed: bool) -> None:
        pool = self.model.engine.connector.cpu_pool
        cached = [b.block_id for b in pool.blocks if b.block_hash is not None and not b.ref_cnt]
        # Half the time a block an earlier prompt would load, then that prompt looked up:
        # damage is found out only when a hit reaches it, and a check that reads only a
        # hit's first block must be shown wrong, so the last blocks come first.
        earlier: list[int] | None = None
        if aimed and self.prompts:
            earlier = data.draw(st.sampled_from(self.prompts))
            digests = prefix_digests(earlier, self.config.hash_block_size)
            hit, _ = find_longest_cache_hit(pool, digests, 0, len(earlier) - 1, self.config)
            # (a sliding window's hit starts with nulls: no block to damage)
            hit_blocks = [b.block_id for g in hit for b in g if not b.ref_cnt and not b.is_null]
            cached = hit_blocks[::-1] or cached
        if cached:
            block = data.draw(st.sampled_from(cached))
            worker = data.draw(st.integers(0, self.config.world_size - 1))
            self.run(("corrupt", block, worker), "corrupt")
            if earlier is not None:
                self.run(("lookup", earlier), "corrupt", continued=True)

    # Bad input between good calls (issue 14): every driver must reject it with the model's
    # error and change nothing, so that a weakened validation is a disagreement, found and
    # shrunk like any other (a duplicate worker report counted twice, a request half added).
    @rule(data=st.data())
    def misuse(self, data: st.DataObject) -> None:
        before = self.model.snapshot()
        self.run(data.draw(st.sampled_from(self.bad_calls())), "misuse")
        assert self.model.snapshot() == before, "the model changed on bad input"

    def bad_calls(self) -> list[Call]:
        """Calls every driver must reject, given the program so far."""
        fresh, live = f"r{self.next_id}", self.model.live_requests()
        finished = [r for r in (f"r{n}" for n in range(self.next_id)) if r not in live]
        too_long = [0] * self.config.gpu_blocks * max(self.config.group_block_sizes)
        connector = self.model.engine.connector
        counters = {"store": connector.store_event_counter, "load": connector.load_event_counter}
        calls: list[Call] = [
            ("add", "", [0], 1),
            ("add", fresh, [], 1),
            ("add", fresh, [0, -1], 1),
            ("add", fresh, [0, MAX_TOKEN_ID + 1], 1),
            ("add", fresh, [0], 0),
            ("add", fresh, [0], 1, 1),  # the flag must be a bool
            ("add", fresh, too_long, 1),
            ("step", -1),
            ("finish", fresh),
            ("lookup", []),
            ("lookup", [-1]),
            ("store", -1, 0),
            ("store", 0, self.config.world_size),
        ]
        if self.resets:
            calls.append(("reset_prefix_cache", 1))  # the flag must be a bool
        calls += [("add", r, [0], 1) for r in live + finished]
        calls += [("finish", r) for r in finished]
        for kind, counter in counters.items():
            calls.append((kind, counter, 0))  # never issued
            owed = set(self.model.outstanding(kind))
            calls += [
                (kind, event, worker)  # reported already
                for event in range(counter)
                for worker in range(self.config.world_size)
                if (event, worker) not in owed
            ]
        return calls


class LoadingConformanceMachine(ConformanceMachine):
    """The machine with one more rule, ``evict``, which makes CPU loads common. Campaigns
    (``kvoffload verify``, vLLM's releases) use it; the mutation matrix runs the rules above
    alone, since its targets are about shrinking and a rule that runs a whole scenario can
    hold the shrinker in a longer counterexample (``no-hit-pins``: 12 rules with it,
    4 without)."""

    fillers = 0  # fillers run by this program (each machine starts from the class's 0)

    # A CPU load needs a prompt whose blocks have left the GPU but are still on the CPU,
    # which random rules seldom arrange (loads were in about 1 program in 45). Here a
    # filler prompt, never seen before and up to as long as the GPU pool allows, runs to the
    # end and evicts the least recently used GPU blocks; then, unless ``recall`` is False, an
    # earlier prompt comes back and loads from the CPU, its load left in flight for the other
    # rules. The filler is not an earlier prompt for the other rules: its blocks are the
    # ones left on the GPU. With ``hold`` the filler is still decoding when the earlier
    # prompt comes back: its CPU hit is pinned and its allocation fails for want of GPU
    # blocks, the state in which a hit's pin must survive store allocations (vLLM #39702)
    # and a reset must release it (S21 of docs/history.md).
    @precondition(lambda self: bool(self.prompts) and not self.model.live_requests())
    @rule(data=st.data(), budget=SETTLE_BUDGETS, recall=st.booleans(), hold=st.booleans())
    def evict(self, data: st.DataObject, budget: int, recall: bool, hold: bool) -> None:
        self.fillers += 1
        outputs = HOLD_OUTPUTS if hold else 1
        longest = max(n for n in range(1, 65) if self.fits([0] * n, outputs))
        # The whole pool evicts every earlier prompt; less leaves a GPU prefix hit in front
        # of the CPU hit (a local and an external range in one request).
        length = data.draw(st.one_of(st.just(longest), st.integers(1, longest)))
        # Token ids from 7 up appear in no other prompt and in no decoded output.
        filler = [6 + self.fillers] + [(self.fillers + i) % 7 for i in range(length - 1)]
        self.admit(filler, outputs, "evict", remember=False)
        if hold:
            self.run_until_computed(f"r{self.next_id - 1}", len(filler), budget)
        else:
            self.settle_rounds(budget, "evict")
        if recall:
            earlier = data.draw(st.sampled_from(self.prompts))
            tail, max_tokens = data.draw(TAILS), data.draw(MAX_TOKENS)
            self.admit(earlier + tail, max_tokens, "evict", continued=True)
            self.run(("step", budget), "evict", continued=True)
            # An operator's reset while that request waits with its hit pinned: reset()
            # must let the pin go, or the CPU cache cannot be cleared (S21). Or the request
            # is aborted while it waits: its finish must let the pin go too.
            recalled = f"r{self.next_id - 1}"
            if hold and self.resets and data.draw(st.booleans()):
                self.run(("reset",), "evict", continued=True)
            elif (
                hold
                and recalled in self.model.live_requests()
                and data.draw(st.integers(0, 3)) == 3  # a quarter: an abort loses a load
            ):
                self.run(("finish", recalled), "evict", continued=True)

    # Preemption (vLLM's recompute preemption, S20 of docs/history.md): requests that each
    # fit the GPU pool alone but not together, prefilled in small chunks. A later chunk of
    # the first finds the pool taken by the others and preempts the last one, which resumes
    # (as a new request, with its output so far) once blocks are free again.
    @precondition(lambda self: not self.model.live_requests())
    @rule(
        data=st.data(),
        stems=st.lists(st.integers(0, 2), min_size=2, max_size=3),
        chunk=st.integers(2, 6),
        max_tokens=st.integers(1, 4),
    )
    def crowd(self, data: st.DataObject, stems: list[int], chunk: int, max_tokens: int) -> None:
        longest = max(n for n in range(1, 65) if self.fits([0] * n, max_tokens))
        for n, stem in enumerate(stems):
            length = data.draw(st.integers(max(1, longest // 2), longest))
            self.admit(_prompt(stem, length, []), max_tokens, "crowd", continued=n > 0)
        for _ in range(SETTLE_ROUNDS):
            if not self.model.live_requests():
                break
            self.run(("step", chunk), "crowd", continued=True)

    def run_until_computed(self, request_id: str, tokens: int, budget: int) -> None:
        """Steps until ``request_id`` has computed ``tokens`` (its prompt), at most
        ``SETTLE_ROUNDS``; its blocks stay held."""
        for _ in range(SETTLE_ROUNDS):
            request = self.model.engine.requests.get(request_id)
            if request is None or request.num_computed_tokens >= tokens:
                return
            self.run(("step", budget), "evict", continued=True)


def machine_for(
    adapter_name: str,
    recorder: Recorder | None = None,
    variant: str | None = None,
    loads: bool = True,
    checks: bool = True,
) -> type[ConformanceMachine]:
    """A conformance machine driving the implementation ``adapter_name`` names, compared
    with ``variant`` of the model (default: the one the adapter is expected to match);
    with ``loads``, the machine with the ``evict`` rule; without ``checks``, the same rules
    and calls with nothing compared or checked (a floor for measurements only)."""
    row = spec(adapter_name)
    compared_with = variant_of(adapter_name, variant)
    # The class name keys Hypothesis's example database: one entry per target, release and
    # model variant, so that each check replays its own earlier failures first. It also
    # seeds a derandomized run: the unchecked machine keeps it, so that it runs the very
    # programs the conformance machine runs (under another name, other ones: 4985 driver
    # calls for 5608 in the bench's 100 programs, and a floor a third too high).
    release = row.release()
    target = f"{adapter_name}=={release}" if release else adapter_name
    return type(
        f"Conformance[{target} vs {compared_with}]",
        (LoadingConformanceMachine if loads else ConformanceMachine,),
        {
            "adapter_name": adapter_name,
            "target_spec": row,
            "adapter": staticmethod(row.build),
            "recorder": recorder or Recorder(),
            "variant": compared_with,
            "injects": row.injects,
            "resets": row.resets(),
            "reports_stats": row.reports_stats(),
            "checks": checks,
        },
    )


def reproducer(failure: dict[str, Any]) -> str:
    """A standalone program that reproduces a recorded failure."""
    return validate(failure).reproducer()
