"""The engine around the connector, reduced to what the connector sees.

vLLM's scheduler and KV cache manager for full-attention and sliding-window groups:
requests as token ids with chained keys, GPU blocks per request and group, GPU prefix-cache
hits, a step with a token budget (running requests first, then waiting ones in order;
chunked prefill; one-token decode steps), async CPU loads, and finish, which tells the
connector before it frees the request's GPU blocks.

Sliding-window groups: the blocks wholly before a request's window leave its table (the
null block takes their place) when it is allocated again and when it finishes; they are
freed, and keep their keys in the free queue until evicted. Its hits are nulls up to the
run of blocks the window needs. Of each scheduler block, only the blocks a hit can end
with get keys.

Preemption, as vLLM's scheduler does it first come first served (recompute): a running
request that cannot get blocks preempts the last running request (itself, last of all): its
blocks are freed, its computed tokens drop to 0 and it goes to the front of the waiting
queue, keeping its output; no waiting request is admitted in a step that preempted. The
connector sees the step's preempted ids, and a resumed request comes back as a new request
with its whole block table (the shape of vLLM's newer model runner, 0.34.0's only one).
Against the models of vLLM before 0.24.0 (whose pool cannot take what follows a preemption,
``OffloadScheduler.preempts``) a running request that cannot grow waits instead.

Scheduling (:class:`Scheduling`): a waiting request is admitted when the blocks of its first
chunk fit, and a block's key is registered as the block fills. vLLM 0.34.0's own scheduler
and KV cache manager add (full-attention groups only: vLLM caps the counts of the others by
their windows and chunks, not modelled): the blocks of the whole sequence must fit too
(``scheduler_reserve_full_isl``); a request whose hit loads asynchronously is admitted only
beside the blocks that the requests still prefilling and the loads parked still need to hold
their whole sequences (``reserved_blocks``); a request whose load has started waits in a
queue of its own, taken before the others; keys are registered up to the scheduler block
boundary only; and the prompt tail is the last boundary a resend can hit.

Mamba groups (align mode, no speculative blocks, no prefill checkpoints): a request's table
holds the null block everywhere but at its running state's block and, until the next
allocation, the block its state is copied from; an allocation that passes the table's end
pads it with nulls and takes one block; the blocks before the last computed token's are
freed (null gaps do not stop it). A state block that fills is cached as the step is
scheduled, and handed to the connector in the step's output (vLLM's boundary-state
hand-offs), since it leaves the table at the next allocation; a waiting request whose Mamba
hit was cached in this very step waits (its state is computed by this step's forward).

Fine-grained hits (a Mamba group larger than the hash block, every Mamba block the
scheduler block): lookups are aligned to the hash block, keys are registered as blocks fill
(not rounded to the scheduler block), and a block of several hash blocks registers the
prompt's tail at the last boundary a resend can hit (vLLM 0.33.0 on). A prefill chunk does not
stop at the prompt's tail inside a Mamba block, so no Mamba state is keyed there and no hit
ends inside a scheduler block: vLLM's scheduler stops there, and what follows (copy-on-write
of a partially hit block, the ``partial_tail`` branch) is not modelled (docs/fine-grained.md).

Not modelled: speculative decoding, Mamba's prefill checkpoints, encoder inputs.

Invariants kept (checked by :mod:`kvoffload.model.invariants`):

- REF-GPU: each GPU block's ref count is the number of request block tables holding it
  plus the store transfers (queued, in flight, abandoned) and loads (pending, in flight,
  abandoned) that include it.
- REF-CPU: each CPU block's ref count is the number of lookup pins and loads that include
  it plus one if it is the destination of a queued, in-flight or abandoned store.
- KEYS: the GPU blocks of a request's computed full blocks carry the request's keys.
- WINDOW: in a sliding-window table the null block is a prefix, no longer than the blocks
  wholly before the window of the request's computed tokens; a full-attention table holds
  no null.
- MAMBA: a Mamba table holds at most two blocks that are not null, one of them at its end.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kvoffload.model.arith import mamba_chunk, reachable
from kvoffload.model.block_pool import Block
from kvoffload.model.config import OffloadConfig
from kvoffload.model.errors import ConfigError
from kvoffload.model.keys import BlockKey, block_keys, extend_digests, fine_key
from kvoffload.model.lookup import find_hybrid_hit
from kvoffload.model.offload import Disposition, OffloadScheduler, Transfer, resend_boundary
from kvoffload.model.types import StepResult

# Decoded tokens come from a small alphabet so that continuations are shared, as with
# greedy decoding of equal prefixes.
DECODE_ALPHABET = 4


def greedy_token(tokens: Sequence[int]) -> int:
    """The token the reduced model decodes after ``tokens``: a function of the prefix."""
    return sum(tokens) % DECODE_ALPHABET


class RequestStatus(StrEnum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(frozen=True)
class Scheduling:
    """Where the engine's scheduling follows vLLM 0.34.0's own scheduler and KV cache manager
    rather than the reduced engine the conformance machine drives (whose programs and
    figures were recorded with none of these). ``whole_sequence``: a waiting request is
    admitted only when the free blocks hold its whole sequence (vLLM's
    ``scheduler_reserve_full_isl``), not as soon as its first chunk fits.
    ``load_reservations``: a request whose hit loads asynchronously fits beside the blocks
    reserved for the requests still prefilling and the loads parked (vLLM's
    ``_inflight_prefill_reserved_blocks``). ``holders_first``: the requests whose loads
    started are taken first (vLLM's ``kv_holding_waiting``). ``aligned_caching``: a group's
    blocks get their keys only up to the scheduler block boundary (vLLM's hybrid
    coordinator without fine-grained hits, ``_align_cacheable``), not each as it fills.
    ``resend_tail``: the prompt tail a block of several hash blocks registers ends on the
    last hash boundary before the prompt's last token (vLLM 0.33.0 on), not the prompt's
    last hash boundary. All are on in vLLM 0.34.0 (:data:`VLLM_SCHEDULING`)."""

    whole_sequence: bool = False
    load_reservations: bool = False
    holders_first: bool = False
    aligned_caching: bool = False
    resend_tail: bool = False

    @property
    def gated(self) -> bool:
        return self.whole_sequence or self.load_reservations


REDUCED_SCHEDULING = Scheduling()
VLLM_SCHEDULING = Scheduling(
    whole_sequence=True,
    load_reservations=True,
    holders_first=True,
    aligned_caching=True,
    resend_tail=True,
)


@dataclass
class Request:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    hash_block_size: int
    skip_reading_prefix_cache: bool = False
    output: list[int] = field(default_factory=list)
    # Where a prefix some group caches past the common hit ends (vLLM's
    # shared_prefix_boundary, a junction a Mamba model's prefill chunk stops at), or 0.
    shared_prefix_boundary: int = 0
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    digests: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        extend_digests(self.digests, self.all_token_ids, self.hash_block_size)

    @property
    def all_token_ids(self) -> list[int]:
        return [*self.prompt, *self.output]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def append_output(self, token: int) -> None:
        self.output.append(token)
        extend_digests(self.digests, self.all_token_ids, self.hash_block_size)


@dataclass(frozen=True)
class SchedulerOutput:
    """What ``build_connector_meta`` reads: new (and resumed) requests with their whole
    block table, running requests with the blocks added this step, tokens scheduled per
    request, the requests preempted this step, and the step's boundary-state hand-offs (per
    request, in the order offered: group, GPU block, tokens its key covers)."""

    new_reqs: tuple[tuple[str, tuple[list[int], ...]], ...]
    cached_reqs: tuple[tuple[str, tuple[list[int], ...]], ...]
    num_scheduled_tokens: dict[str, int]
    preempted_req_ids: frozenset[str] = frozenset()
    boundary_offloads: tuple[tuple[str, tuple[tuple[int, int, int], ...]], ...] = ()

    def req_data(self) -> Iterator[tuple[str, tuple[list[int], ...]]]:
        yield from self.new_reqs
        yield from self.cached_reqs


@dataclass(frozen=True)
class FinishRecord:
    """Ghost record of a tracked request's finish, for FLUSH-COMPLETE."""

    request_id: str
    confirmed_blocks: tuple[int, ...]
    dispositions: tuple[dict[int, Disposition], ...]


@dataclass
class _StepPlan:
    """What one step has scheduled so far: vLLM's ``SchedulerOutput`` as it is built."""

    budget: int  # the tokens left to schedule
    scheduled: dict[str, tuple[int, int]] = field(default_factory=dict)  # computed tokens
    new_reqs: list[tuple[str, tuple[list[int], ...]]] = field(default_factory=list)
    cached_reqs: list[tuple[str, tuple[list[int], ...]]] = field(default_factory=list)
    loading: list[str] = field(default_factory=list)  # requests whose loads were sent
    preempted: list[str] = field(default_factory=list)
    started: list[str] = field(default_factory=list)  # the loads started this step
    blocked: bool = False  # a running request could not grow and preempted nobody


class Engine:
    """The reduced vLLM engine core with one offload connector."""

    def __init__(
        self,
        config: OffloadConfig,
        connector_cls: type[OffloadScheduler] = OffloadScheduler,
        scheduling: Scheduling = REDUCED_SCHEDULING,
    ) -> None:
        if scheduling.gated and not all(config.full_attention(g) for g in range(config.num_groups)):
            raise ConfigError(
                "vLLM's admission gates are modelled for full-attention groups only: vLLM "
                "caps the blocks of sliding-window, chunked local and Mamba groups"
            )
        self.config = config
        self.scheduling = scheduling
        # Under load reservations: the requests still prefilling after their last chunk
        # (vLLM's _inflight_prefills), and the blocks reserved for each parked load.
        self.inflight_prefills: set[str] = set()
        self.parked: dict[str, int] = {}
        # Under holders first: the waiting requests whose loads started, in that order.
        self.holders: list[str] = []
        # The requests a prefix-cache reset preempted, for the next step's output.
        self.reset_preempted: list[str] = []
        # The machine draws no preemption against the releases whose pool cannot take it
        # (OffloadScheduler.preempts): there a running request that cannot grow waits.
        self.preemption = connector_cls.preempts
        # Both pools are of the release's kind (a variant may name an older BlockPool).
        self.gpu_pool = connector_cls.pool_class(config.gpu_blocks, "gpu")
        self.connector = connector_cls(config, self.gpu_pool)
        self.requests: dict[str, Request] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.req_to_blocks: dict[str, list[list[int]]] = {}
        self.num_cached_blocks: dict[str, list[int]] = {}
        self.finished_recving: set[str] = set()
        self.delayed_free: set[str] = set()
        self.finish_records: list[FinishRecord] = []
        # Mamba: the step's boundary-state hand-offs (request, group, block, tokens), and
        # the keys of the states cached in this step.
        self.mamba_groups = frozenset(g for g in range(config.num_groups) if config.is_mamba(g))
        self.boundary_offers: list[tuple[str, int, int, int]] = []
        self.cached_this_step: set[BlockKey] = set()

    # -- requests ---------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        skip_reading_prefix_cache: bool = False,
    ) -> None:
        self.requests[request_id] = Request(
            request_id,
            tuple(prompt),
            max_tokens,
            self.config.hash_block_size,
            skip_reading_prefix_cache,
        )
        self.waiting.append(request_id)

    def blocks_of(self, request_id: str) -> list[list[int]]:
        return self.req_to_blocks.get(request_id, [[] for _ in self.config.group_block_sizes])

    # -- one step ---------------------------------------------------------------------------

    def step(self, token_budget: int) -> StepResult:
        """One engine step, as vLLM's ``Scheduler.schedule()`` and ``update_from_output()``
        do it, in four phases:

        1. the running requests in queue order, each grown by a chunk of the budget, the
           last running requests preempted (FCFS) while the GPU pool cannot hold the chunk
           (:meth:`_schedule_running`);
        2. unless that preempted or blocked a request, the waiting requests in order: the
           GPU prefix hit, the connector's CPU hit, the allocation, the connector's
           ``update_state_after_alloc``, then either a load parked or the request running
           (:meth:`_schedule_waiting`);
        3. the connector's ``build_connector_meta`` over the step's :class:`SchedulerOutput`;
        4. the scheduled requests' computed tokens advance, a token is sampled where a
           request's tokens are all computed, and finished requests are freed
           (:meth:`_advance`).
        """
        self.cached_this_step.clear()
        plan = _StepPlan(token_budget)
        self._schedule_running(plan)
        if not (plan.preempted or plan.blocked):
            self._schedule_waiting(plan)
        # At the end of the queue of holders, in the order they started (vLLM re-queues
        # them after the pass).
        self.holders += plan.started
        output = SchedulerOutput(
            tuple(plan.new_reqs),
            tuple(plan.cached_reqs),
            {req_id: end - start for req_id, (start, end) in plan.scheduled.items()},
            # with those a prefix-cache reset preempted since the last step
            frozenset(plan.preempted) | frozenset(self.reset_preempted),
            self.take_boundary_offers(),
        )
        self.reset_preempted.clear()
        metadata = self.connector.build_connector_meta(output)
        finished = self._advance(plan.scheduled)
        return StepResult(
            plan.scheduled, tuple(plan.loading), finished, metadata, tuple(plan.preempted)
        )

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Phase 1 of :meth:`step`: grow the running requests, preempting to make room."""
        index = 0
        while index < len(self.running) and plan.budget > 0:
            req_id = self.running[index]
            req = self.requests[req_id]
            num_new = self.chunk(req, min(req.num_tokens - req.num_computed_tokens, plan.budget), 0)
            if num_new == 0:
                # No block-aligned chunk fits the budget: passed over this step.
                index += 1
                continue
            before = [len(ids) for ids in self.blocks_of(req_id)]
            allocated = self._allocate_slots(req, num_new)
            if not allocated and not self.preemption:
                plan.blocked = True
                return
            while not allocated:
                # vLLM's FCFS preemption: the last running request makes room, until the
                # request itself is the one preempted.
                victim = self.running.pop()
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim == req_id:
                    break
                allocated = self._allocate_slots(req, num_new)
            if not allocated:
                return
            after = self.blocks_of(req_id)
            plan.cached_reqs.append(
                (req_id, tuple(list(ids[n:]) for ids, n in zip(after, before, strict=True)))
            )
            plan.scheduled[req_id] = (req.num_computed_tokens, req.num_computed_tokens + num_new)
            plan.budget -= num_new
            index += 1

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Phase 2 of :meth:`step`: admit the waiting requests in order, with their hits,
        until one does not fit."""
        for req_id in self._waiting_order():
            if plan.budget <= 0:
                return
            req = self.requests[req_id]
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                if req_id not in self.finished_recving:
                    continue
                self._update_waiting_for_remote_kv(req)
                self._reserve_parked(req)
            hit_blocks: tuple[list[Block], ...] | None = None
            local = external = 0
            load_async = False
            if req.num_computed_tokens == 0:
                # vLLM's KV cache manager reads no prefix cache for a request that skips
                # reading it. The connector is asked all the same, as vLLM's scheduler
                # asks it (up to 0.32.0, nothing but the connector drops a CPU hit for such
                # a request; bug S12 of docs/history.md).
                req.shared_prefix_boundary = 0
                if not req.skip_reading_prefix_cache:
                    hit_blocks, local, longest = find_hybrid_hit(
                        self.gpu_pool,
                        req.digests,
                        0,
                        req.num_tokens - 1,
                        self.config,
                        fine=self.config.fine_grained_hits,
                    )
                    req.shared_prefix_boundary = longest if longest > local else 0
                external, load_async = self.connector.get_num_new_matched_tokens(req, local)
            num_new = 0
            if not load_async:
                num_new = self.chunk(
                    req,
                    min(req.num_tokens - req.num_computed_tokens - local - external, plan.budget),
                    local + external,
                )
                if num_new == 0:
                    return  # no block-aligned chunk fits the budget
            if self.scheduling.whole_sequence and not self._fits(
                req,
                req.num_tokens - req.num_computed_tokens - local - external,
                hit_blocks,
                local + external,
            ):
                # vLLM's ``full_sequence_must_fit``, checked before the chunk's own count.
                return
            reserved = self._reserved() if load_async else 0
            if not self._allocate_slots(
                req, num_new, hit_blocks, local, external, load_async, reserved
            ):
                return
            self.connector.update_state_after_alloc(
                req, tuple(list(ids) for ids in self.blocks_of(req_id)), external
            )
            if load_async:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                req.num_computed_tokens = local + external
                self._reserve_parked(req)
                plan.loading.append(req_id)
                if self.scheduling.holders_first and req_id not in self.holders:
                    plan.started.append(req_id)
                continue
            req.num_computed_tokens += local + external
            if self.scheduling.load_reservations:
                # Still prefilling after this chunk, or a load just promoted: reserved for
                # until its prefill ends (vLLM's _inflight_prefills).
                if req.num_computed_tokens + num_new < req.num_tokens or req_id in self.parked:
                    self.inflight_prefills.add(req_id)
                self.parked.pop(req_id, None)
            self.waiting.remove(req_id)
            if req_id in self.holders:
                self.holders.remove(req_id)
            self.running.append(req_id)
            req.status = RequestStatus.RUNNING
            plan.new_reqs.append((req_id, tuple(list(ids) for ids in self.blocks_of(req_id))))
            plan.scheduled[req_id] = (req.num_computed_tokens, req.num_computed_tokens + num_new)
            plan.budget -= num_new

    def _advance(self, scheduled: dict[str, tuple[int, int]]) -> tuple[str, ...]:
        """Phase 4 of :meth:`step`: the scheduled tokens are computed; the requests that
        finish are freed, and returned. Computed tokens advance only after the connector
        has seen the step, so a block computed in step N is confirmed in step N + 1."""
        finished: list[str] = []
        for req_id, (_, end) in scheduled.items():
            req = self.requests[req_id]
            req.num_computed_tokens = end
            if end >= req.num_tokens:
                self.inflight_prefills.discard(req_id)
            if end == req.num_tokens:
                req.append_output(greedy_token(req.all_token_ids))
                if len(req.output) >= req.max_tokens:
                    self.finish_request(req_id)
                    finished.append(req_id)
        return tuple(finished)

    def _waiting_order(self) -> list[str]:
        """The waiting requests in the order a step considers them: the queue's, or with
        holders first, the requests whose loads started before the others."""
        if not self.scheduling.holders_first:
            return list(self.waiting)
        return self.holders + [r for r in self.waiting if r not in self.holders]

    def chunk(self, req: Request, num_new: int, num_hit: int) -> int:
        """The tokens of ``num_new`` the step computes for ``req`` (with ``num_hit`` tokens
        hit before them): all of them, but with a Mamba group, a prefill chunk split where
        states are cached (:func:`~kvoffload.model.arith.mamba_chunk`, at scheduler blocks)."""
        if not self.mamba_groups:
            return num_new
        return mamba_chunk(
            req.num_computed_tokens + num_hit,
            num_new,
            max(len(req.prompt), req.num_tokens - 1),
            req.num_tokens,
            self.config.scheduler_block_size,
            req.shared_prefix_boundary,
        )

    def reset_prefix_cache(self, reset_connector: bool, reset_running: bool = False) -> bool:
        """vLLM's ``Scheduler.reset_prefix_cache``: with ``reset_running``, every running
        request preempted first (from the last, so that they wait in their order; the next
        step tells the connector); the GPU pool's reset (refused while any block is in use),
        then the connector's, asked or not; the answer is whether neither tier serves a hit
        now."""
        while reset_running and self.running:
            victim = self.running.pop()
            self._preempt(victim)
            self.reset_preempted.append(victim)
        gpu = self.gpu_pool.reset_prefix_cache()
        if reset_connector:
            # As vLLM's: the connector is reset even when the GPU's reset was refused.
            result = self.connector.reset() and gpu
        else:
            result = gpu and self.connector.serves_nothing()
        self.connector.prefix_reset_log.append(result)
        return result

    def blocks_kept_from_reset(self) -> list[int]:
        """The GPU blocks in use that preempting every running request would not free (held
        by a waiting request's load, a transfer, a request being finished)."""
        held: dict[int, int] = {}
        null = self.gpu_pool.null_block.block_id
        for req_id in self.running:
            for ids in self.req_to_blocks.get(req_id, []):
                for block_id in ids:
                    if block_id != null:
                        held[block_id] = held.get(block_id, 0) + 1
        return [
            b.block_id
            for b in self.gpu_pool.blocks
            if b.block_id != null and b.ref_cnt > held.get(b.block_id, 0)
        ]

    def take_boundary_offers(self) -> tuple[tuple[str, tuple[tuple[int, int, int], ...]], ...]:
        """Drain the step's boundary-state hand-offs, per request in the order of its first
        (vLLM's ``take_boundary_state_offloads``)."""
        offers: dict[str, list[tuple[int, int, int]]] = {}
        for req_id, group, block_id, tokens in self.boundary_offers:
            offers.setdefault(req_id, []).append((group, block_id, tokens))
        self.boundary_offers.clear()
        return tuple((req_id, tuple(entries)) for req_id, entries in offers.items())

    def _preempt(self, request_id: str) -> None:
        """vLLM's ``_preempt_request`` (the caller took it out of the running queue): its
        blocks are freed, it starts over from the front of the waiting queue."""
        req = self.requests[request_id]
        self._free_blocks(request_id)
        self.inflight_prefills.discard(request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        req.num_computed_tokens = 0
        self.waiting.insert(0, request_id)

    def _allocate_slots(
        self,
        req: Request,
        num_new: int,
        hit_blocks: tuple[list[Block], ...] | None = None,
        num_local: int = 0,
        num_external: int = 0,
        delay_cache: bool = False,
        reserved: int = 0,
    ) -> bool:
        """Give ``req`` slots for ``num_new`` more tokens; False when the pool is too small.

        As vLLM's ``allocate_slots``: sliding-window blocks that left the window are freed
        first (even when the allocation then fails), then the pool is checked, then the
        hits are taken, then the external range, then the rest.
        """
        req_id = req.request_id
        sizes = self.config.group_block_sizes
        computed = req.num_computed_tokens + num_local + num_external
        if req_id in self.req_to_blocks:
            self.remove_skipped_blocks(req_id, computed)
        hits = hit_blocks if hit_blocks is not None else tuple([] for _ in sizes)
        for g in self.mamba_groups:
            if hits[g] and self.hit_key(req, g, len(hits[g]) - 1) in self.cached_this_step:
                # The hit's state is computed by this step's forward: not before the next
                # step (vLLM's MambaManager reports the pool too small).
                return False
        if not self._fits(req, num_new, hits, num_local + num_external, reserved):
            return False
        skipped = self._skipped(req_id, computed)
        if req_id not in self.req_to_blocks:
            # First allocation: touch every group's hits before any block is taken, then the
            # blocks of the external range, then the rest (vLLM issue #33775).
            null = self.gpu_pool.null_block.block_id
            self.req_to_blocks[req_id] = [
                [null] * skip + [b.block_id for b in hit[skip:]]
                for hit, skip in zip(hits, skipped, strict=True)
            ]
            self.num_cached_blocks[req_id] = [len(ids) for ids in self.req_to_blocks[req_id]]
            for hit, skip in zip(hits, skipped, strict=True):
                self.gpu_pool.touch(hit[skip:])
            if num_external:
                total = num_local + num_external
                for g, size in enumerate(sizes):
                    ids = self.req_to_blocks[req_id][g]
                    if total - self.config.skipped_tokens(g, total) <= 0:
                        # The external range has all left the window (a window of 1 attends
                        # to no earlier token) or the chunk (it ends on a chunk boundary):
                        # vLLM allocates it nothing.
                        continue
                    n = max(0, math.ceil(total / size) - len(ids))
                    ids.extend(b.block_id for b in self.gpu_pool.get_new_blocks(n))
        for g, size in enumerate(sizes):
            ids = self.req_to_blocks[req_id][g]
            n = max(0, math.ceil((computed + num_new) / size) - len(ids))
            if g in self.mamba_groups and n:
                # Nulls up to the running state's block, which is the one taken.
                ids.extend([self.gpu_pool.null_block.block_id] * (n - 1))
                n = 1
            ids.extend(b.block_id for b in self.gpu_pool.get_new_blocks(n))
        if not delay_cache:
            self.cache_blocks(req, min(computed + num_new, req.num_tokens))
        return True

    def _skipped(self, req_id: str, computed: int) -> list[int]:
        """Per group, the hit blocks before the window a first allocation does not take
        (its table holds nulls there); none once the request has a table."""
        return [
            0 if req_id in self.req_to_blocks else self.skipped_blocks(g, computed)
            for g in range(self.config.num_groups)
        ]

    def _fits(
        self,
        req: Request,
        num_new: int,
        hit_blocks: tuple[list[Block], ...] | None,
        num_hit: int,
        reserved: int = 0,
    ) -> bool:
        """Whether the free blocks but ``reserved`` can take ``num_new`` more tokens of
        ``req`` after ``num_hit`` tokens hit on ``hit_blocks`` (vLLM's
        ``get_num_blocks_to_allocate`` against the free count): the new blocks, and the hit
        blocks that leave the free queue when touched."""
        sizes = self.config.group_block_sizes
        computed = req.num_computed_tokens + num_hit
        current = self.blocks_of(req.request_id)
        hits = hit_blocks if hit_blocks is not None else tuple([] for _ in sizes)
        skipped = self._skipped(req.request_id, computed)
        need = [
            max(0, math.ceil((computed + num_new) / size) - max(skip, len(ids) + len(hit)))
            for size, ids, hit, skip in zip(sizes, current, hits, skipped, strict=True)
        ]
        for g in self.mamba_groups:
            # One block at most: the running state's (vLLM's align-mode physical cap).
            need[g] = min(
                1,
                max(0, math.ceil((computed + num_new) / sizes[g]) - len(current[g]) - len(hits[g])),
            )
        # Hit blocks that sit in the free queue leave it when touched (a Mamba group counts
        # the hit's state even where the external range passes it, as vLLM's does).
        evictable = sum(
            1
            for g, (hit, skip) in enumerate(zip(hits, skipped, strict=True))
            for b in (hit if g in self.mamba_groups else hit[skip:])
            if b.ref_cnt == 0 and not b.is_null
        )
        return sum(need) + evictable <= self.gpu_pool.num_free_blocks - reserved

    def _remaining_blocks(self, req: Request) -> int:
        """The blocks ``req`` still needs to hold its whole sequence (vLLM's
        ``_request_remaining_blocks``; full-attention groups)."""
        return sum(
            max(0, math.ceil(req.num_tokens / size) - len(ids))
            for size, ids in zip(
                self.config.group_block_sizes, self.blocks_of(req.request_id), strict=True
            )
        )

    def _reserved(self) -> int:
        """The blocks an asynchronous load must leave free: what the requests still
        prefilling and the parked loads need (none without load reservations)."""
        return sum(self.parked.values()) + sum(
            self._remaining_blocks(self.requests[r]) for r in self.inflight_prefills
        )

    def _reserve_parked(self, req: Request) -> None:
        """Reserve, or refresh, what a parked load needs (vLLM's ``_reserve_parked``)."""
        if self.scheduling.load_reservations:
            self.parked[req.request_id] = self._remaining_blocks(req)

    def skipped_blocks(self, group: int, num_computed: int) -> int:
        """Leading blocks of ``group`` no token after ``num_computed`` attends to (0 for
        full attention; before the window, or before the current chunk)."""
        return (
            self.config.skipped_tokens(group, num_computed) // self.config.group_block_sizes[group]
        )

    def remove_skipped_blocks(self, request_id: str, num_computed: int) -> None:
        """Free the sliding-window blocks that left the window and put the null block in
        their place (vLLM's ``remove_skipped_blocks``): from the last one back, stopping at a
        null, freed in that order (hashed ones stay cached at the free queue's tail)."""
        null = self.gpu_pool.null_block.block_id
        for g, ids in enumerate(self.req_to_blocks[request_id]):
            freed: list[int] = []
            for i in range(min(self.skipped_blocks(g, num_computed), len(ids)) - 1, -1, -1):
                if ids[i] == null and g in self.mamba_groups:
                    continue  # a Mamba table has null gaps between its states
                if ids[i] == null:
                    break
                freed.append(ids[i])
                ids[i] = null
            if freed:
                self.gpu_pool.free_blocks([self.gpu_pool.blocks[i] for i in freed])

    def cache_blocks(self, req: Request, num_tokens: int) -> None:
        """Register the keys of ``req``'s full blocks up to ``num_tokens``, and its prompt tail."""
        hbs = self.config.hash_block_size
        if self.scheduling.aligned_caching and not self.config.fine_grained_hits:
            # vLLM's hybrid coordinator: only what a hit could end on (one group: its blocks;
            # with fine-grained hits, every hash boundary: nothing is rounded).
            size = self.config.scheduler_block_size
            num_tokens = num_tokens // size * size
        for g, size in enumerate(self.config.group_block_sizes):
            ids = self.req_to_blocks[req.request_id][g]
            blocks = [self.gpu_pool.blocks[i] for i in ids]
            cached = self.num_cached_blocks[req.request_id]
            num_full = num_tokens // size
            if num_full > cached[g]:
                for start, end in self.reachable_runs(g, cached[g], num_full):
                    self.cache_full_blocks(req, g, blocks, start, end)
                if g in self.mamba_groups:
                    self.offer_states(req, g, blocks, cached[g], num_full)
                cached[g] = num_full
            if size == hbs or not self.config.full_attention(g):
                continue
            # The prompt's last hash boundary, when it falls inside a block, is registered on
            # that block: as its primary while the block is partial, as a secondary key once
            # the block is full (vLLM's FullAttentionManager._cache_partial_tail_block).
            boundary = len(req.prompt) // hbs * hbs
            if self.scheduling.resend_tail or self.config.fine_grained_hits:
                # The last boundary a resend of the prompt can hit (its last token is
                # recomputed), the prompt's hashed tokens at most. Fine-grained hits are
                # modelled from vLLM 0.33.0 on, whose GPU side registers this one.
                boundary = resend_boundary(req, hbs)
            if boundary == 0 or boundary > num_tokens or boundary % size == 0:
                continue
            index = boundary // size
            if index < len(blocks):
                self.cache_prompt_tail(req, g, blocks[index], boundary)

    def offer_states(
        self, req: Request, group: int, blocks: list[Block], start: int, end: int
    ) -> None:
        """Hand the Mamba states just cached (positions ``start <= i < end`` that hold a
        block) to the connector, and remember their keys for the step."""
        size = self.config.group_block_sizes[group]
        keys = block_keys(req.digests, group, size, self.config.hash_block_size)
        for i in range(start, end):
            if blocks[i].is_null:
                continue
            self.boundary_offers.append((req.request_id, group, blocks[i].block_id, (i + 1) * size))
            self.cached_this_step.add(keys[i])

    def hit_key(self, req: Request, group: int, index: int) -> BlockKey:
        """The key of ``req``'s position ``index`` in ``group``."""
        size = self.config.group_block_sizes[group]
        return block_keys(req.digests, group, size, self.config.hash_block_size)[index]

    def reachable_runs(self, group: int, start: int, end: int) -> list[tuple[int, int]]:
        """The runs of blocks ``start <= i < end`` of ``group`` that get keys: every block
        of a full-attention group; of a sliding-window group, those
        :func:`~kvoffload.model.arith.reachable` names."""
        window = self.config.window(group)
        size = self.config.group_block_sizes[group]
        runs: list[tuple[int, int]] = []
        for i in range(start, end):
            if window is not None and not reachable(
                i, window, size, self.config.scheduler_block_size
            ):
                continue
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        return runs

    def cache_full_blocks(
        self, req: Request, group: int, blocks: list[Block], start: int, end: int
    ) -> None:
        """Register ``req``'s keys on ``group``'s full blocks ``start <= i < end``."""
        size = self.config.group_block_sizes[group]
        keys = block_keys(req.digests, group, size, self.config.hash_block_size)
        self.gpu_pool.cache_full_blocks(blocks, keys, start, end)

    def cache_prompt_tail(self, req: Request, group: int, block: Block, boundary: int) -> None:
        """Register the key of ``req``'s first ``boundary`` tokens on ``block``."""
        hbs = self.config.hash_block_size
        self.gpu_pool.cache_partial_block(
            block, fine_key(req.digests, boundary // hbs - 1, group, hbs)
        )

    def _update_waiting_for_remote_kv(self, req: Request) -> None:
        self.cache_blocks(req, req.num_computed_tokens)
        # On a full hit the last token is recomputed, to sample from it.
        if req.num_computed_tokens == req.num_tokens:
            req.num_computed_tokens = req.num_tokens - 1
        self.finished_recving.discard(req.request_id)
        # A preempted request whose load finished is preempted still, as vLLM says of it.
        req.status = RequestStatus.PREEMPTED if req.num_preemptions else RequestStatus.WAITING

    # -- finish -----------------------------------------------------------------------------

    def finish_request(self, request_id: str) -> Transfer | None:
        """Finish (or abort) a request: the connector first, then its GPU blocks."""
        req = self.requests[request_id]
        sizes = self.config.group_block_sizes
        self.inflight_prefills.discard(request_id)
        self.parked.pop(request_id, None)
        if request_id in self.holders:
            self.holders.remove(request_id)
        loading = req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        if request_id in self.req_to_blocks and not loading:
            # vLLM's scheduler frees the blocks that left the window before it hands the
            # table to the connector (the flush recovers their keys from the free queue).
            self.remove_skipped_blocks(request_id, req.num_computed_tokens)
        block_ids = tuple(
            ids[: math.ceil(req.num_computed_tokens / size)]
            for ids, size in zip(self.blocks_of(request_id), sizes, strict=True)
        )
        tracked = request_id in self.connector.reqs_to_store
        flushed = self.connector.request_finished_all_groups(req, block_ids)
        if tracked:
            aligned = req.num_computed_tokens
            if not self.config.cpu_fine_grained_hits:
                # Without fine-grained hits a scan reaches whole scheduler blocks only.
                aligned = aligned // self.config.scheduler_block_size
                aligned *= self.config.scheduler_block_size
            self.finish_records.append(
                FinishRecord(
                    request_id,
                    tuple(
                        # A Mamba group's states are not scanned: they go by hand-offs.
                        0 if g in self.mamba_groups else min(len(ids), aligned // size)
                        for g, (ids, size) in enumerate(zip(block_ids, sizes, strict=True))
                    ),
                    tuple(dict(d) for d in self.connector.dispositions.get(request_id, [])),
                )
            )
        self.connector.dispositions.pop(request_id, None)
        if request_id in self.running:
            self.running.remove(request_id)
        if request_id in self.waiting:
            self.waiting.remove(request_id)
        req.status = RequestStatus.FINISHED
        if loading and request_id not in self.finished_recving:
            # The load still writes into these blocks: they are freed when it completes.
            self.delayed_free.add(request_id)
        else:
            self.finished_recving.discard(request_id)
            self._free_blocks(request_id)
        return flushed

    def _free_blocks(self, request_id: str) -> None:
        # Its hand-offs not yet offered go: its blocks may go to another request now.
        self.boundary_offers = [o for o in self.boundary_offers if o[0] != request_id]
        null = self.gpu_pool.null_block.block_id
        for ids in self.req_to_blocks.pop(request_id, []):
            # Tail blocks first, so that they are evicted first; the nulls a sliding window
            # left are no blocks of the request.
            self.gpu_pool.free_blocks([self.gpu_pool.blocks[i] for i in reversed(ids) if i != null])
        self.num_cached_blocks.pop(request_id, None)

    # -- completions ------------------------------------------------------------------------

    def loads_finished(self, request_ids: set[str]) -> None:
        """Every worker has loaded these requests' blocks."""
        self.worker_output(request_ids, {})

    def worker_output(self, request_ids: set[str], stores: dict[int, int]) -> None:
        """One output of the workers, as vLLM's scheduler takes it: the connector's reports
        (the loads of ``request_ids`` finished on every worker, then ``stores``' counts),
        then the requests whose loads finished (vLLM's ``_update_from_kv_xfer_finished``)."""
        self.connector.update_connector_output(request_ids, stores)
        for req_id in sorted(request_ids):
            req = self.requests[req_id]
            if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.finished_recving.add(req_id)
            elif req_id in self.delayed_free:
                self.delayed_free.discard(req_id)
                self._free_blocks(req_id)

    def store_completed(self, event: int, count: int, failed: bool = False) -> None:
        self.connector.update_connector_output(
            set(), {event: count}, frozenset({event}) if failed else frozenset()
        )
