"""The connector's scheduler side: vLLM's ``SimpleCPUOffloadScheduler`` as fixed by PR
#53532 (vLLM 0.30.0 and later) and by 0.34.0's lazy mode, over full-attention,
sliding-window, chunked local and Mamba groups (their states stored as the scheduler hands
them off), with the kv-cache events of the CPU tier.

It owns the CPU pool and borrows the engine's GPU pool. In eager mode, per step it selects
newly confirmed GPU blocks of every scheduled request, reserves CPU blocks for them, pins the
GPU blocks and sends one store event; at finish it queues a final flush that the next store
event carries. With fine-grained hits (``OffloadConfig.cpu_fine_grained_hits``) its lookups
end on any hash boundary, its scans reach every block the confirmed tokens fill, and the
final flush also stores the block holding the prompt's tail (the first full-attention group's
last hash boundary before the prompt's last token, inside a block), so that a hit can end
there from the CPU. In lazy mode (``OffloadConfig.lazy``), per step it walks the GPU free queue
from its head (the blocks evicted next), up to ``lazy_target_free`` blocks, and stores the
cached ones whose key the CPU pool does not hold; when their store completes they go back
to the head of the GPU queue, since the CPU now holds them. In both modes completions
register every key of the source GPU block on the CPU block.

Invariants kept (checked by :mod:`kvoffload.model.invariants`):

- SKIP: a selected GPU block is not null, has a primary key, is not in flight and its key
  is not in the CPU map at selection.
- CAPACITY: one selection never takes more blocks than the CPU pool has free at its start.
- UNREACHABLE: the CPU block of a queued, in-flight or abandoned store holds no key in the
  map before its store completes.
- REGISTERED: a completed store registers the GPU block's primary (with its token count)
  and every secondary key on the CPU block, which is then free at the queue tail.
- PENDING: ``has_pending_stores()`` iff a flush is queued or a store is in flight or
  abandoned.
- IN-FLIGHT: the in-flight set is exactly the GPU blocks of queued flushes and in-flight
  (not abandoned) store events.
- RESET: after ``reset()`` no flush is queued; it returns True iff nothing was abandoned
  and the CPU pool was fully free, and then the CPU map is empty. A prefix-cache reset
  (``reset_prefix_cache``) that returns True leaves neither tier's map holding a key.
- EVENTS: event ids are below their counters, counters never go back, an event is
  processed once, partial counts stay below ``world_size``.
- FLUSH-COMPLETE: when a tracked request finishes, every block confirmed by then has a
  disposition: stored, already present, in flight, null, unhashed, or dropped for capacity.
- LOAD-PINNED: CPU blocks pinned by a lookup or a load are in use and registered.
- NO-READ: a request that skips reading the prefix cache gets no CPU hit and no load.
- LAZY-SCAN: a lazy selection takes, in queue order, every cached GPU block of the first
  ``lazy_target_free`` of the free queue whose key the CPU pool does not hold, until the CPU
  pool's free blocks are all taken.
- LAZY-EVICT-FIRST: the GPU blocks of a completed lazy store that become free are the first
  of the free queue, in their store's order.
- EVENT-STORED: with kv-cache events, each ``stored`` event names a key the CPU map holds
  when it is published, and the tokens it carries, chained from its parent digest, give
  that key's digest.
- RECOVER: a null position (a sliding window's freed block) that a store scan reaches is
  passed over as null only when the GPU pool caches no block under its key; otherwise the
  block cached there is what the scan considers. A window position whose block now holds
  another key (freed and reused) is such a null.
- POSITION: a block a store scan takes for a position of a request holds that position's
  key.
- STATS: a drain of the stats reports the GPU blocks of the sent loads completed since the
  previous drain (and starts the count over, a reset keeping it), the CPU blocks in use and
  the CPU blocks of every store not yet completed (in flight, queued or abandoned), and
  per outcome the boundary-state hand-offs decided since the previous drain.
- BOUNDARY: a boundary-state hand-off (a Mamba state the scheduler keyed this step) is
  stored only for a live tracked request, its block not null, keyed, not in flight, its key
  not in the CPU map; every hand-off is counted under one outcome in the stats.
- TAIL: a final flush stores the block holding its request's prompt tail exactly when the
  block holds the tail's key, is neither in flight nor selected by the scan, the CPU map
  lacks the key and the CPU pool has room for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from kvoffload.model.arith import align_down, lookup_limit, plan_selection, ready_blocks
from kvoffload.model.block_pool import Block, BlockPool
from kvoffload.model.keys import BlockKey, block_keys, fine_key
from kvoffload.model.lookup import find_longest_cache_hit
from kvoffload.model.types import NO_EVENT, STORED, ConnectorMetadata, KVEvent, OffloadStats

if TYPE_CHECKING:
    from kvoffload.model.config import OffloadConfig
    from kvoffload.model.engine import Request, SchedulerOutput


class Disposition(StrEnum):
    """What the eager scan or the final flush decided for one confirmed GPU block."""

    STORED = "stored"
    PRESENT = "present"
    IN_FLIGHT = "in_flight"
    NULL = "null"
    UNHASHED = "unhashed"
    DROPPED_CAPACITY = "dropped_capacity"


# What a store captured for a key's ``stored`` event: (parent digest, token ids, block size;
# 0 for what was captured under the block's primary key, as vLLM names no size for it).
StoreMeta = tuple[str | None, tuple[int, ...], int]


@dataclass
class Transfer:
    """GPU and CPU block ids of one store or load, pairwise; with kv-cache events, what each
    stored block's keys covered when it was selected (vLLM's ``BlockStoreMeta``), pairwise
    too (None: nothing captured, as for lazy stores)."""

    gpu_block_ids: list[int]
    cpu_block_ids: list[int]
    meta: list[dict[BlockKey, StoreMeta]] | None = None


@dataclass
class LoadState:
    request_id: str
    transfer: Transfer
    load_event: int | None = None
    finished: bool = False


@dataclass
class StoreState:
    request: Request
    block_ids: tuple[list[int], ...]
    num_stored_blocks: list[int]
    store_events: set[int] = field(default_factory=set)
    finished: bool = False


@dataclass
class PendingHit:
    blocks: tuple[list[Block], ...]
    hit_length: int
    num_computed_tokens: int


# -- ghost records: observations the invariants check; they steer nothing ------------------


@dataclass(frozen=True)
class PickRecord:
    """A GPU block a selection took, with the facts observed just before it was taken."""

    gpu_block_id: int
    is_null: bool
    key: BlockKey | None
    was_in_flight: bool
    was_in_cpu_map: bool
    index: int = 0  # its position in the request's table
    position_key: BlockKey | None = None  # the request's key for that position


@dataclass(frozen=True)
class SelectionRecord:
    request_id: str
    final_flush: bool
    num_free: int
    picks: tuple[PickRecord, ...]
    # the tokens whole scheduler blocks of the request's computed tokens cover at selection
    # (with fine-grained CPU hits, the computed tokens themselves)
    confirmed: int | None = None


@dataclass(frozen=True)
class CompletionRecord:
    event: int
    gpu_block_id: int
    cpu_block_id: int
    primary: BlockKey | None
    num_tokens: int | None
    secondary: frozenset[BlockKey]


@dataclass(frozen=True)
class LazyScanRecord:
    """A lazy selection, with the GPU free queue as it was before: each block's id, its key
    and whether the CPU pool held that key."""

    queue: tuple[tuple[int, BlockKey | None, bool], ...]
    target_free: int
    num_free: int
    picks: tuple[int, ...]


@dataclass(frozen=True)
class LazyReturnRecord:
    """The GPU blocks of a completed lazy store that became free, in store order, and the
    GPU free queue right after."""

    freed: tuple[int, ...]
    queue_after: tuple[int, ...]


@dataclass(frozen=True)
class NullRecord:
    """A null position a store scan reached: its key, whether the GPU pool cached that key
    then, and the block recovered for it (None when none was)."""

    request_id: str
    group: int
    index: int
    key: BlockKey | None
    gpu_cached: bool
    recovered: int | None


class Outcome(StrEnum):
    """What became of one boundary-state hand-off (vLLM's ``SAVE_OUTCOMES`` labels)."""

    STORED = "stored"
    DROPPED_CPU_FULL = "dropped_cpu_full"
    DROPPED_REQUEST_GONE = "dropped_request_gone"
    DROPPED_NULL_BLOCK = "dropped_null_block"
    DROPPED_NOT_HASHED = "dropped_not_hashed"
    SKIPPED_ALREADY_CACHED = "skipped_already_cached"
    SKIPPED_IN_FLIGHT = "skipped_in_flight"


# Why the eager scan would pass over a block, as a hand-off's outcome.
_OUTCOME_OF = {
    Disposition.NULL: Outcome.DROPPED_NULL_BLOCK,
    Disposition.UNHASHED: Outcome.DROPPED_NOT_HASHED,
    Disposition.IN_FLIGHT: Outcome.SKIPPED_IN_FLIGHT,
    Disposition.PRESENT: Outcome.SKIPPED_ALREADY_CACHED,
}


@dataclass(frozen=True)
class BoundaryRecord:
    """A boundary-state hand-off, its outcome, and the facts observed when it was decided:
    whether its request was tracked and live, the block's key, whether it was in flight, and
    whether the CPU map held its key."""

    request_id: str
    gpu_block_id: int
    outcome: Outcome
    live: bool
    is_null: bool
    key: BlockKey | None
    was_in_flight: bool
    was_in_cpu_map: bool


@dataclass(frozen=True)
class TailRecord:
    """A final flush with fine-grained CPU hits, the first full-attention group's prompt
    tail inside a block of the request's table, and the facts observed when it was decided:
    whether the map held the tail's key for that block, whether the block was in flight,
    whether the CPU map held the key, whether the scan selected the block, whether the CPU
    pool had a block free past the scan's, and whether the flush took it."""

    request_id: str
    boundary: int
    gpu_block_id: int
    holds_key: bool
    was_in_flight: bool
    was_in_cpu_map: bool
    selected: bool
    room: bool
    taken: bool


@dataclass(frozen=True)
class StoredRecord:
    """A ``stored`` event as it was published, and whether the CPU map held its key then."""

    event: KVEvent
    reachable: bool


@dataclass(frozen=True)
class StatsRecord:
    """A drain of the stats, with the sent loads whose completions it covers (their GPU
    block counts, as each completion was processed) and the outcomes of the boundary-state
    hand-offs decided since the previous drain."""

    report: OffloadStats
    loads: tuple[int, ...]
    outcomes: tuple[Outcome, ...] = ()


@dataclass(frozen=True)
class ResetRecord:
    returned: bool
    abandoned: bool
    cpu_idle: bool


def resend_boundary(request: Request, hash_block_size: int) -> int:
    """The prompt tail a full-attention block of several hash blocks registers when it ends
    inside the block, with fine-grained hits: the last hash boundary a resend of the prompt
    can hit (its last token is recomputed), at most the request's hashed tokens (vLLM 0.33.0
    on, ``FullAttentionManager._cache_partial_tail_block``)."""
    hbs = hash_block_size
    return min((len(request.prompt) - 1) // hbs, len(request.digests)) * hbs


def _at(keys: list[BlockKey], index: int) -> BlockKey | None:
    """The key of position ``index`` (None past the request's hashes)."""
    return keys[index] if index < len(keys) else None


class OffloadScheduler:
    """Eager CPU offloading for one engine. Method names follow vLLM's."""

    pool_class: type[BlockPool] = BlockPool  # the kind of both pools, GPU and CPU
    # Whether the machine draws preemption against this model (the engine preempts as
    # vLLM's scheduler does); False for the pools before 0.24.0 (docs/upstream.md).
    preempts: bool = True

    def __init__(self, config: OffloadConfig, gpu_pool: BlockPool) -> None:
        self.config = config
        self.block_size = config.scheduler_block_size
        self.hash_block_size = config.hash_block_size
        self.group_block_sizes = config.group_block_sizes
        self.cpu_pool = self.pool_class(config.cpu_blocks, "cpu")
        if config.kv_events:
            self.cpu_pool.events = []
        self.gpu_pool = gpu_pool
        self.expected_worker_count = config.world_size

        self.reqs_to_load: dict[str, LoadState] = {}
        self.load_event_to_reqs: dict[int, list[str]] = {}
        self.pending_cpu_hits: dict[str, PendingHit] = {}
        self.abandoned_reqs_to_load: dict[str, LoadState] = {}

        self.store_event_to_blocks: dict[int, Transfer] = {}
        self.abandoned_store_event_to_blocks: dict[int, Transfer] = {}
        self.reqs_to_store: dict[str, StoreState] = {}
        self.store_event_to_reqs: dict[int, list[str]] = {}
        self.in_flight_store_gpu_blocks: set[int] = set()
        self.pending_finished_stores: list[Transfer] = []

        self.load_event_counter = 0
        self.store_event_counter = 0
        self.store_event_pending_counts: dict[int, int] = {}
        # Store events a worker reported failed (kvoffload's contract: vLLM's workers report
        # no failure): when every worker has reported, the copy is dropped, not registered.
        self.failed_store_events: set[int] = set()
        # GPU blocks of the sent loads completed since the stats were last drained.
        self.loaded_blocks_since_drain = 0
        # Boundary-state hand-offs per outcome since the stats were last drained (a reset
        # keeps them for the next report, as vLLM's carries them over).
        self.save_outcomes: dict[Outcome, int] = {}

        # Ghost state for the invariants.
        self.dispositions: dict[str, list[dict[int, Disposition]]] = {}
        self.processed_store_events: list[int] = []
        self.issued_store_events: list[int] = []
        self.issued_load_events: list[int] = []
        self.selection_log: list[SelectionRecord] = []
        self.completion_log: list[CompletionRecord] = []
        self.dropped_log: list[Transfer] = []  # stores dropped for a failed copy
        self.reset_log: list[ResetRecord] = []
        self.prefix_reset_log: list[bool] = []  # what each reset_prefix_cache returned
        self.stats_log: list[StatsRecord] = []
        self.completed_loads: list[int] = []  # since the last drain, GPU blocks of each
        self.decided_outcomes: list[Outcome] = []  # since the last drain, each hand-off's
        self.lazy_scan_log: list[LazyScanRecord] = []
        self.lazy_return_log: list[LazyReturnRecord] = []
        self.null_log: list[NullRecord] = []
        self.stored_log: list[StoredRecord] = []
        self.boundary_log: list[BoundaryRecord] = []
        self.tail_log: list[TailRecord] = []

    # -- lookup and load ------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` the CPU pool can load; pins the hit blocks."""
        stale = self.pending_cpu_hits.pop(request.request_id, None)
        if stale is not None:
            self._free_pending_cpu_hit(stale)
        if not self.reads_for(request):
            return 0, False
        if num_computed_tokens % self.block_size != 0:
            return 0, False
        if not self.starts_on_chunk_boundary(num_computed_tokens):
            return 0, False
        if len(request.digests) <= num_computed_tokens // self.hash_block_size:
            return 0, False
        # At least the last token is recomputed, to sample from it.
        max_hit_len = lookup_limit(request.num_tokens, num_computed_tokens)
        if max_hit_len <= 0:
            return 0, False
        blocks, hit = self._intact_hit(request.digests, num_computed_tokens, max_hit_len)
        if hit <= 0:
            return 0, False
        self._pin_hit(request.request_id, PendingHit(blocks, hit, num_computed_tokens))
        return hit, True

    def starts_on_chunk_boundary(self, num_computed_tokens: int) -> bool:
        """Whether a CPU hit may follow a local prefix of ``num_computed_tokens``: the lookup
        counts a chunked local group's chunks from its own start, so that start must be a
        chunk boundary (vLLM 0.33.0; bug S24 of docs/history.md: after a prefix that ends
        inside a chunk, the chunked group's hit sits one chunk boundary off, and its load
        writes into the null block)."""
        return all(
            num_computed_tokens % chunk == 0
            for g in range(self.config.num_groups)
            if (chunk := self.config.chunk(g)) is not None
        )

    def reads_for(self, request: Request) -> bool:
        """Whether a CPU hit may be served to ``request``: not to one that skips reading the
        prefix cache (PR #54998, vLLM 0.30.0; a prompt-logprobs request needs every prompt
        token computed)."""
        return not request.skip_reading_prefix_cache

    def _pin_hit(self, request_id: str, hit: PendingHit) -> None:
        """Pin a hit until the allocation takes it (PR #42289), so that no store
        allocation in between evicts it."""
        self.cpu_pool.touch([b for group in hit.blocks for b in group if not b.is_null])
        self.pending_cpu_hits[request_id] = hit

    def _intact_hit(
        self, digests: list[str], num_computed_tokens: int, max_hit_len: int
    ) -> tuple[tuple[list[Block], ...], int]:
        """The longest CPU hit whose blocks hold the bytes they were registered with.

        kvoffload's integrity contract (vLLM's scheduler reads no bytes): a hit block found
        damaged is evicted, as ``evict_blocks`` does, and the lookup is made again, so the
        hit ends before it and a damaged block is never loaded. Again, since a key cached
        by several blocks may lead to another damaged one; each round evicts at least one.
        """
        while True:
            blocks, hit = find_longest_cache_hit(
                self.cpu_pool,
                digests,
                num_computed_tokens,
                max_hit_len,
                self.config,
                fine=self.config.cpu_fine_grained_hits,
            )
            damaged = [b.block_id for g in blocks for b in g if b.block_id in self.cpu_pool.damaged]
            if not damaged:
                return blocks, hit
            self.cpu_pool.evict_blocks(damaged)

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        if not self.config.lazy and req_id not in self.reqs_to_store:  # eager mode only
            self.reqs_to_store[req_id] = StoreState(
                request,
                tuple([] for _ in block_ids),
                [0] * len(block_ids),
            )
            self.dispositions[req_id] = [{} for _ in block_ids]
        pending = self.pending_cpu_hits.pop(req_id, None)
        if num_external_tokens == 0:
            if pending is not None:
                self._free_pending_cpu_hit(pending)
            return
        if pending is None:
            return
        gpu_ids: list[int] = []
        cpu_blocks: list[Block] = []
        for g, g_block_size in enumerate(self.group_block_sizes):
            # Only the leading blocks the scheduler accepted are loaded.
            taken = pending.blocks[g][: math.ceil(num_external_tokens / g_block_size)]
            start = self.load_start(pending, g_block_size, len(taken), num_external_tokens)
            for i, cpu_block in enumerate(taken):
                if cpu_block.is_null:
                    continue
                gpu_ids.append(block_ids[g][start + i])
                cpu_blocks.append(cpu_block)
        # Pin for the load before the lookup pin is dropped, so the net is +1.
        self.cpu_pool.touch(cpu_blocks)
        self._free_pending_cpu_hit(pending)
        self.gpu_pool.touch([self.gpu_pool.blocks[i] for i in gpu_ids])
        assert req_id not in self.reqs_to_load
        self.reqs_to_load[req_id] = LoadState(
            req_id, Transfer(gpu_ids, [b.block_id for b in cpu_blocks])
        )

    def load_start(
        self, pending: PendingHit, group_block_size: int, num_taken: int, num_external: int
    ) -> int:
        """The table position of a group where a load's first block goes: right after the
        local prefix the hit was found after (vLLM 0.30.0 on keep it with the pending hit)."""
        return pending.num_computed_tokens // group_block_size

    def ready_count(self, num_computed: int, group_block_size: int, table_len: int) -> int:
        """How many of a group's table positions the eager scan may reach: those whole
        scheduler blocks of confirmed tokens fill (:func:`~kvoffload.model.arith.ready_blocks`);
        with fine-grained CPU hits, those the confirmed tokens fill (vLLM's
        ``get_num_cacheable_tokens`` rounds nothing then)."""
        if self.config.cpu_fine_grained_hits:
            return min(table_len, num_computed // group_block_size)
        return ready_blocks(num_computed, self.block_size, group_block_size, table_len)

    def _free_pending_cpu_hit(self, pending: PendingHit) -> None:
        self.cpu_pool.free_blocks([b for group in pending.blocks for b in group if not b.is_null])

    # -- eager store selection --------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        store_meta: list[dict[BlockKey, StoreMeta]] | None = None
        if self.config.lazy:
            store_gpu, store_cpu, store_req_ids = self._prepare_lazy_store_specs()
        else:
            store_gpu, store_cpu, store_req_ids, store_meta = self._prepare_eager_store_specs(
                scheduler_output
            )
        # PR #53532: every queued final flush rides on this step's store event.
        for transfer in self.pending_finished_stores:
            store_gpu.extend(transfer.gpu_block_ids)
            store_cpu.extend(transfer.cpu_block_ids)
            if store_meta is not None and transfer.meta is not None:
                store_meta.extend(transfer.meta)
        self.pending_finished_stores.clear()
        store_event = NO_EVENT
        if store_gpu:
            store_event = self.store_event_counter
            self.store_event_counter += 1
            self.issued_store_events.append(store_event)
            self.store_event_to_blocks[store_event] = Transfer(store_gpu, store_cpu, store_meta)
            if store_req_ids:
                self.store_event_to_reqs[store_event] = store_req_ids
                for req_id in store_req_ids:
                    self.reqs_to_store[req_id].store_events.add(store_event)

        load_gpu: list[int] = []
        load_cpu: list[int] = []
        load_req_ids: list[str] = []
        for req_id, load in self.reqs_to_load.items():
            if load.load_event is None:
                load_gpu.extend(load.transfer.gpu_block_ids)
                load_cpu.extend(load.transfer.cpu_block_ids)
                load_req_ids.append(req_id)
        load_event = NO_EVENT
        if load_req_ids:
            load_event = self.load_event_counter
            self.load_event_counter += 1
            self.issued_load_events.append(load_event)
            for req_id in load_req_ids:
                self.reqs_to_load[req_id].load_event = load_event
            self.load_event_to_reqs[load_event] = load_req_ids

        return ConnectorMetadata(
            store_event=store_event,
            store_gpu_blocks=tuple(store_gpu),
            store_cpu_blocks=tuple(store_cpu),
            load_event=load_event,
            load_gpu_blocks=tuple(load_gpu),
            load_cpu_blocks=tuple(load_cpu),
            load_event_to_reqs={e: tuple(r) for e, r in self.load_event_to_reqs.items()},
        )

    def _prepare_eager_store_specs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[list[int], list[int], list[str], list[dict[BlockKey, StoreMeta]] | None]:
        merged_gpu: list[int] = []
        merged_cpu: list[int] = []
        merged_meta: list[dict[BlockKey, StoreMeta]] | None = [] if self.config.kv_events else None
        req_ids: list[str] = []
        for req_id, entries in scheduler_output.boundary_offloads:
            if self._store_boundary_states(
                req_id, entries, scheduler_output, merged_gpu, merged_cpu, merged_meta
            ):
                req_ids.append(req_id)
        # vLLM 0.32.0 (bug S20 of docs/history.md): preemption freed the request's blocks; its
        # table and cursors start over, whatever shape its resumption comes in (up to 0.31.0
        # only a resumption flagged as such, which vLLM's newer model runner never sends).
        for req_id in sorted(scheduler_output.preempted_req_ids):
            self.forget_table(req_id)
        for req_id, new_block_ids in scheduler_output.req_data():
            state = self.reqs_to_store.get(req_id)
            if state is None or state.finished:
                continue
            # A resumed request's data is its whole table, as a new request's (0.33.0 clears
            # the table for it too: by then preemption has cleared it).
            for g, ids in enumerate(new_block_ids):
                state.block_ids[g].extend(ids)
            if scheduler_output.num_scheduled_tokens.get(req_id, 0) == 0:
                continue
            gpu_ids, advanced, meta = self._select_eager_blocks_to_store(
                state, state.block_ids, final_flush=False
            )
            if gpu_ids:
                cpu_blocks = self.allocate_store_destinations(gpu_ids)
                req_ids.append(req_id)
                merged_gpu.extend(gpu_ids)
                merged_cpu.extend(b.block_id for b in cpu_blocks)
                if merged_meta is not None and meta is not None:
                    merged_meta.extend(meta)
                self.in_flight_store_gpu_blocks.update(gpu_ids)
                self.gpu_pool.touch([self.gpu_pool.blocks[i] for i in gpu_ids])
            for g, n in enumerate(advanced):
                state.num_stored_blocks[g] += n
        # A request with both a hand-off and a scan in the event is named once.
        return merged_gpu, merged_cpu, list(dict.fromkeys(req_ids)), merged_meta

    def _store_boundary_states(
        self,
        req_id: str,
        entries: tuple[tuple[int, int, int], ...],
        scheduler_output: SchedulerOutput,
        merged_gpu: list[int],
        merged_cpu: list[int],
        merged_meta: list[dict[BlockKey, StoreMeta]] | None,
    ) -> bool:
        """Store a request's boundary-state hand-offs (Mamba states the scheduler cached
        this step, which leave the table at once), each under the key its block holds, while
        the CPU pool has room; whether any was stored. A request finished, preempted or not
        tracked gives up its blocks, which may be another's now: none is read (vLLM 0.30.0,
        PR #54736)."""
        state = self.reqs_to_store.get(req_id)
        live = not (state is None or state.finished or req_id in scheduler_output.preempted_req_ids)
        stored = False
        for _, gpu_id, _ in entries:
            block = self.gpu_pool.blocks[gpu_id]
            reason = self._classify(block)
            if not live:
                outcome = Outcome.DROPPED_REQUEST_GONE
            elif reason is not None:
                outcome = _OUTCOME_OF[reason]
            elif self.cpu_pool.num_free_blocks <= 0:
                outcome = Outcome.DROPPED_CPU_FULL
            else:
                outcome = Outcome.STORED
            self.boundary_log.append(
                BoundaryRecord(
                    req_id,
                    gpu_id,
                    outcome,
                    live,
                    block.is_null,
                    block.block_hash,
                    gpu_id in self.in_flight_store_gpu_blocks,
                    block.block_hash is not None and block.block_hash in self.cpu_pool.cached,
                )
            )
            self.save_outcomes[outcome] = self.save_outcomes.get(outcome, 0) + 1
            self.decided_outcomes.append(outcome)
            if outcome is not Outcome.STORED:
                continue
            (cpu_block,) = self.allocate_store_destinations([gpu_id])
            merged_gpu.append(gpu_id)
            merged_cpu.append(cpu_block.block_id)
            if merged_meta is not None:
                # Its keys are the block's own, resolved at completion: nothing is captured
                # (an event without tokens, as vLLM's).
                merged_meta.append({})
            self.in_flight_store_gpu_blocks.add(gpu_id)
            self.gpu_pool.touch([block])
            stored = True
        return stored

    def forget_table(self, req_id: str) -> None:
        """A preempted request's store state: no table, every cursor at 0."""
        state = self.reqs_to_store.get(req_id)
        if state is not None:
            for ids in state.block_ids:
                ids.clear()
            state.num_stored_blocks = [0] * len(state.block_ids)

    # -- lazy store selection ---------------------------------------------------------------

    def _prepare_lazy_store_specs(self) -> tuple[list[int], list[int], list[str]]:
        """The cached GPU blocks nearest eviction whose key the CPU pool lacks: the free
        queue from its head, ``lazy_target_free`` blocks at most, as many as the CPU pool
        has free. The stores belong to no request."""
        target, num_free = self.config.lazy_target_free, self.cpu_pool.num_free_blocks
        queue = self.lazy_scan_queue()
        picked: list[int] = []
        visited: list[int] = []
        for covered, block_id in enumerate(queue):
            if covered >= target or len(picked) >= num_free:
                break
            visited.append(block_id)
            block = self.gpu_pool.blocks[block_id]
            key = block.block_hash
            if key is not None and not block.is_null and self.cpu_pool.get_one_block(key) is None:
                picked.append(block_id)
        self.lazy_scan_log.append(self._observe_scan(target, num_free, picked))
        self.after_lazy_scan(visited)
        cpu_blocks = self.allocate_store_destinations(picked)
        self.gpu_pool.touch([self.gpu_pool.blocks[i] for i in picked])
        return picked, [b.block_id for b in cpu_blocks], []

    def lazy_scan_queue(self) -> list[int]:
        """Where the lazy scan walks: the whole GPU free queue, from its head (0.34.0)."""
        return list(self.gpu_pool.free_queue)

    def after_lazy_scan(self, visited: list[int]) -> None:
        """What the scan keeps of the blocks it visited: nothing (0.34.0)."""

    def _observe_scan(self, target: int, num_free: int, picked: list[int]) -> LazyScanRecord:
        """The whole free queue before the picks are taken out of it."""
        blocks = [self.gpu_pool.blocks[i] for i in self.gpu_pool.free_queue]
        cached = self.cpu_pool.cached
        return LazyScanRecord(
            tuple((b.block_id, b.block_hash, b.block_hash in cached) for b in blocks),
            target,
            num_free,
            tuple(picked),
        )

    def allocate_store_destinations(self, gpu_ids: list[int]) -> list[Block]:
        """Reserve one CPU block per selected GPU block. Fixed code does not stamp them."""
        return self.cpu_pool.get_new_blocks(len(gpu_ids))

    def _classify(self, block: Block) -> Disposition | None:
        """Why the scan passes over this block, or None when it may be stored."""
        if block.is_null:
            return Disposition.NULL
        if block.block_hash is None:
            return Disposition.UNHASHED
        if block.block_id in self.in_flight_store_gpu_blocks:
            return Disposition.IN_FLIGHT
        if self.cpu_pool.get_one_block(block.block_hash) is not None:
            return Disposition.PRESENT
        return None

    def _select_eager_blocks_to_store(
        self, state: StoreState, block_ids: tuple[list[int], ...], final_flush: bool
    ) -> tuple[list[int], list[int], list[dict[BlockKey, StoreMeta]] | None]:
        """Confirmed blocks to store from each group's cursor on, the cursor advances, and,
        with kv-cache events, what each selected block's keys cover.

        Shared by the per-step scan and the final flush (PR #53532). When the final flush
        stops for capacity, the blocks it did not reach are recorded as dropped.
        """
        request = state.request
        num_free = self.cpu_pool.num_free_blocks
        # Per group, the request's key of each position: what the scan, its records and the
        # kv-cache events compare a block with.
        keys = [
            block_keys(request.digests, g, size, self.hash_block_size)
            for g, size in enumerate(self.group_block_sizes)
        ]
        candidates = [
            [
                (i, self._scan_block(request.request_id, g, i, ids[i], _at(keys[g], i)))
                for i in range(
                    state.num_stored_blocks[g],
                    self.ready_count(request.num_computed_tokens, size, len(ids)),
                )
            ]
            # A Mamba table is not scanned: its states leave it at once, and go by hand-offs
            # (vLLM's has_positionally_stable_blocks).
            if not self.config.is_mamba(g)
            else []
            for g, (ids, size) in enumerate(zip(block_ids, self.group_block_sizes, strict=True))
        ]
        candidates = [self.scannable(group) for group in candidates]
        reasons = [[self._classify(block) for _, block in group] for group in candidates]
        picks, advanced, full = self.plan(
            [[reason is None for reason in group] for group in reasons], num_free
        )
        marks = self.dispositions[request.request_id]
        chosen = [[candidates[g][j] for j in group] for g, group in enumerate(picks)]
        observed = [
            self._observe(i, block, _at(keys[g], i))
            for g, group in enumerate(chosen)
            for i, block in group
        ]
        selected = [block.block_id for group in chosen for _, block in group]
        for g, group in enumerate(candidates):
            for j in range(advanced[g]):
                i, _ = group[j]
                marks[g].setdefault(i, reasons[g][j] or Disposition.STORED)
        if final_flush and full:
            for g, group in enumerate(candidates):
                for i, _ in group:
                    marks[g].setdefault(i, Disposition.DROPPED_CAPACITY)
        self.selection_log.append(
            SelectionRecord(
                request.request_id,
                final_flush,
                num_free,
                tuple(observed),
                request.num_computed_tokens
                if self.config.cpu_fine_grained_hits
                else align_down(request.num_computed_tokens, self.block_size),
            )
        )
        meta = None
        if self.config.kv_events:
            meta = [
                self._store_meta(request, g, keys[g], i, block)
                for g, group in enumerate(chosen)
                for i, block in group
            ]
        return selected, advanced, meta

    def scannable(self, candidates: list[tuple[int, Block]]) -> list[tuple[int, Block]]:
        """The positions of a group the scan goes over: all of them (an unkeyed block is
        passed over, its cursor advancing, since 0.22.0)."""
        return candidates

    def _store_meta(
        self, request: Request, group: int, keys: list[BlockKey], index: int, block: Block
    ) -> dict[BlockKey, StoreMeta]:
        """What position ``index`` of ``group`` covers in ``request`` (whose keys in that
        group are ``keys``), under the selected block's primary key and under every
        fine-grained key of the request inside it (vLLM's ``BlockStoreMeta`` per hash): the
        tokens past the key before, and that key's digest. As vLLM 0.34.0 captures it: the
        primary is the block's, the tokens are the request's (EVENT-STORED says whether they
        agree)."""
        size, hbs = self.group_block_sizes[group], self.hash_block_size
        tokens = request.all_token_ids
        start = index * size
        assert block.block_hash is not None, f"selected GPU block {block.block_id} has no key"
        meta: dict[BlockKey, StoreMeta] = {
            block.block_hash: (
                None if index == 0 else keys[index - 1].digest,
                tuple(tokens[start : start + size]),
                # vLLM's BlockStoreMeta of the primary names no block size: should that key
                # be a secondary one at completion (a window's block reused at a finer
                # position), its event is of size 0 and carries nothing.
                0,
            )
        }
        for j in range(start // hbs, (start + size) // hbs):
            key = fine_key(request.digests, j, group, hbs)
            if key != block.block_hash:
                parent = None if j == 0 else request.digests[j - 1]
                meta[key] = (parent, tuple(tokens[j * hbs : (j + 1) * hbs]), hbs)
        return meta

    def _scan_block(
        self, request_id: str, group: int, index: int, block_id: int, key: BlockKey | None
    ) -> Block:
        """The GPU block the scan considers at a position of a table whose key is ``key``:
        the table's, or, where a sliding window left the null block, the block the GPU
        prefix cache still holds under that key (vLLM 0.30.0: the retained tail the window
        freed)."""
        block = self.gpu_pool.blocks[block_id]
        if not block.is_null and not self.reused(group, block, key):
            return block
        recovered = None if key is None else self.recover_null_block(key)
        self.null_log.append(
            NullRecord(
                request_id,
                group,
                index,
                key,
                key is not None and key in self.gpu_pool.cached,
                None if recovered is None else recovered.block_id,
            )
        )
        return self.gpu_pool.null_block if recovered is None else recovered

    def reused(self, group: int, block: Block, key: BlockKey | None) -> bool:
        """Whether a sliding-window table's block was freed when it left the window and is
        now another position's: it holds a key, not this position's. The scan's copy of the
        table still names it (its positions are confirmed a step after they are computed),
        so the position is taken as the null it is (found by the machine: vLLM 0.34.0 stores
        the reused block, with this position's tokens in its BlockStored event)."""
        return (
            not self.config.full_attention(group)
            and block.block_hash is not None
            and block.block_hash != key
        )

    def recover_null_block(self, key: BlockKey) -> Block | None:
        """The GPU block cached under ``key``, if any."""
        return self.gpu_pool.get_one_block(key)

    def plan(
        self, storable: list[list[bool]], num_free: int
    ) -> tuple[list[list[int]], list[int], bool]:
        """The selection plan (:func:`~kvoffload.model.arith.plan_selection`)."""
        return plan_selection(storable, num_free)

    def _observe(self, index: int, block: Block, position_key: BlockKey | None) -> PickRecord:
        key = block.block_hash
        return PickRecord(
            block.block_id,
            block.is_null,
            key,
            block.block_id in self.in_flight_store_gpu_blocks,
            key is not None and key in self.cpu_pool.cached,
            index,
            position_key,
        )

    # -- completions ------------------------------------------------------------------------

    def update_connector_output(
        self,
        finished_recving: set[str],
        completed_store_events: dict[int, int],
        failed_store_events: frozenset[int] = frozenset(),
    ) -> None:
        for req_id in sorted(finished_recving):
            sent = self.reqs_to_load.get(req_id) or self.abandoned_reqs_to_load.get(req_id)
            if sent is not None and sent.load_event is not None:
                self.completed_loads.append(len(sent.transfer.gpu_block_ids))
            self.loaded_blocks_since_drain += self._cleanup_load_request(req_id)
        self.failed_store_events |= failed_store_events
        for event, count in completed_store_events.items():
            total = self.store_event_pending_counts.get(event, 0) + count
            if total >= self.expected_worker_count:
                self.store_event_pending_counts.pop(event, None)
                self._process_store_event(event)
            else:
                self.store_event_pending_counts[event] = total

    def _process_store_event(self, event: int) -> None:
        failed = event in self.failed_store_events
        self.failed_store_events.discard(event)
        transfer = self.store_event_to_blocks.pop(event, None)
        if transfer is None:
            transfer = self.abandoned_store_event_to_blocks.pop(event, None)
            if transfer is None:
                return  # stale: from before a reset, already released
            self.processed_store_events.append(event)
            self._release_transfer_refs(transfer)
            return
        self.processed_store_events.append(event)
        self.in_flight_store_gpu_blocks.difference_update(transfer.gpu_block_ids)
        if failed:
            # A worker's copy failed: its CPU blocks hold no whole copy, so nothing becomes
            # reachable; the blocks go back as an abandoned store's do. The GPU blocks are
            # not retried (their cursors moved on), which costs hits, never correctness.
            self._release_transfer_refs(transfer)
            self.dropped_log.append(transfer)
        else:
            self._process_store_completion(event, transfer)
        for req_id in self.store_event_to_reqs.pop(event, []):
            state = self.reqs_to_store.get(req_id)
            if state is None:
                continue
            state.store_events.discard(event)
            if state.finished and not state.store_events:
                self._cleanup_store_request(req_id)

    def _process_store_completion(self, event: int, transfer: Transfer) -> None:
        cpu_blocks = [self.cpu_pool.blocks[i] for i in transfer.cpu_block_ids]
        for gpu_id, cpu_block in zip(transfer.gpu_block_ids, cpu_blocks, strict=True):
            gpu_block = self.gpu_pool.blocks[gpu_id]
            self.completion_log.append(
                CompletionRecord(
                    event,
                    gpu_id,
                    cpu_block.block_id,
                    gpu_block.block_hash,
                    gpu_block.block_hash_num_tokens,
                    frozenset(self.gpu_pool.secondary.get(gpu_id, set())),
                )
            )
            self.register_stored_block(gpu_block, cpu_block)
        if self.cpu_pool.events is not None:
            self.publish_stored(transfer)
        self.cpu_pool.free_blocks(cpu_blocks)
        gpu_blocks = [self.gpu_pool.blocks[i] for i in transfer.gpu_block_ids]
        if not self.config.lazy:
            self.gpu_pool.free_blocks(gpu_blocks)
            return
        # Lazy stores come from the GPU's eviction end; now that the CPU holds them, they
        # go back there (vLLM 0.34.0: evict_first).
        self.return_lazy_blocks(gpu_blocks)
        self.lazy_return_log.append(
            LazyReturnRecord(
                tuple(b.block_id for b in gpu_blocks if b.ref_cnt == 0),
                tuple(self.gpu_pool.free_queue),
            )
        )

    def publish_stored(self, transfer: Transfer) -> None:
        """A ``stored`` event for each key a completed store made reachable: each GPU
        block's primary, then its secondary keys, with what the selection captured for
        that key (vLLM 0.30.0's ``BlockStored`` payload, PR #54325); a key it captured
        nothing for has none (a primary still its group's block size, a secondary 0)."""
        for i, gpu_id in enumerate(transfer.gpu_block_ids):
            captured = transfer.meta[i] if transfer.meta is not None else {}
            primary = self.gpu_pool.blocks[gpu_id].block_hash
            assert primary is not None
            parent, tokens, _ = captured.get(primary, (None, (), 0))
            # The primary's event is of its group's block size, whatever was captured.
            self._publish(primary, parent, tokens, self.group_block_sizes[primary.group])
            for key in sorted(self.gpu_pool.secondary.get(gpu_id, set())):
                self._publish(key, *captured.get(key, (None, (), 0)))

    def _publish(
        self, key: BlockKey, parent: str | None, tokens: tuple[int, ...], size: int
    ) -> None:
        assert self.cpu_pool.events is not None
        if len(tokens) != size:
            # What was captured is of another size (vLLM: "token_ids were sliced with a
            # different g_block_size"): the event carries nothing.
            parent, tokens = None, ()
        event = KVEvent(STORED, key, parent, tokens, size)
        self.cpu_pool.events.append(event)
        self.stored_log.append(StoredRecord(event, key in self.cpu_pool.cached))

    def take_events(self) -> list[KVEvent]:
        """The kv-cache events since the last call (vLLM's ``take_events``)."""
        events = self.cpu_pool.events
        if events is None:
            return []
        self.cpu_pool.events = []
        return events

    def return_lazy_blocks(self, gpu_blocks: list[Block]) -> None:
        """Free a completed lazy store's GPU blocks to the head of the queue."""
        self.gpu_pool.free_blocks(gpu_blocks, evict_first=True)

    def register_stored_block(self, gpu_block: Block, cpu_block: Block) -> None:
        """Register the GPU block's primary, then its secondary keys, on the CPU block."""
        primary = gpu_block.block_hash
        assert primary is not None, f"stored GPU block {gpu_block.block_id} lost its key"
        self.cpu_pool.insert_block_hash(primary, cpu_block, gpu_block.block_hash_num_tokens)
        for key in sorted(self.gpu_pool.secondary.get(gpu_block.block_id, set())):
            self.cpu_pool.insert_block_hash(key, cpu_block, None)

    def _release_transfer_refs(self, transfer: Transfer) -> None:
        """Drop a transfer's pins without making its data reachable."""
        self.cpu_pool.free_blocks([self.cpu_pool.blocks[i] for i in transfer.cpu_block_ids])
        self.gpu_pool.free_blocks([self.gpu_pool.blocks[i] for i in transfer.gpu_block_ids])

    def load_event_to_reqs_for(self, event: int) -> tuple[str, ...]:
        """The requests a worker reports as loaded when ``event`` completes."""
        return tuple(self.load_event_to_reqs.get(event, ()))

    def has_pending_stores(self) -> bool:
        return bool(
            self.pending_finished_stores
            or self.store_event_to_blocks
            or self.abandoned_store_event_to_blocks
        )

    # -- finish -----------------------------------------------------------------------------

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> Transfer | None:
        """The finish hook; returns the final-flush transfer it queued, if any."""
        flushed = self._queue_finished_eager_store(request, block_ids)
        self.request_finished(request)
        return flushed

    def _queue_finished_eager_store(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> Transfer | None:
        """PR #53532: queue the confirmed blocks no scan has reached (the final flush)."""
        state = self.reqs_to_store.get(request.request_id)
        if state is None:
            return None
        gpu_ids, _, meta = self._select_eager_blocks_to_store(state, block_ids, final_flush=True)
        tail = self._find_fa_partial_tail_source(request, block_ids)
        observed = self._observe_tail(request, block_ids, gpu_ids)
        taken = (
            tail is not None
            # A decode that filled the tail block made it the scan's: one CPU block for it.
            and tail not in gpu_ids
            and len(gpu_ids) < self.cpu_pool.num_free_blocks
        )
        if observed is not None:
            self.tail_log.append(replace(observed, taken=taken))
        if taken:
            assert tail is not None
            gpu_ids.append(tail)
            if meta is not None:
                # Its keys are read at completion: the event carries no payload.
                meta.append({})
        if not gpu_ids:
            return None
        cpu_blocks = self.allocate_store_destinations(gpu_ids)
        transfer = Transfer(gpu_ids, [b.block_id for b in cpu_blocks], meta)
        self.pending_finished_stores.append(transfer)
        self.in_flight_store_gpu_blocks.update(gpu_ids)
        # Pinned before the engine frees the request's own refs.
        self.gpu_pool.touch([self.gpu_pool.blocks[i] for i in gpu_ids])
        return transfer

    def fa_tail_boundary(self, request: Request) -> int:
        """Where the final flush looks for the prompt tail: where the GPU side registers it
        (vLLM 0.34.0; S28)."""
        return resend_boundary(request, self.hash_block_size)

    def _tail_block(
        self, request: Request, block_ids: tuple[list[int], ...], boundary: int
    ) -> tuple[int, BlockKey] | None:
        """The block of the first full-attention group's table that holds the prompt tail
        ending at ``boundary`` inside it, with the tail's key; None without fine-grained CPU
        hits, or when the boundary is 0, past the computed tokens, a block's end or past
        the table."""
        if not self.config.cpu_fine_grained_hits:
            return None
        group = self.config.first_full_attention_group
        size, hbs = self.group_block_sizes[group], self.hash_block_size
        if not 0 < boundary <= request.num_computed_tokens or boundary % size == 0:
            return None
        index = boundary // size
        if index >= len(block_ids[group]):
            return None
        # vLLM checks the boundary's hash index against the request's hashes here: neither
        # boundary the callers pass is ever past them, so the check is left out.
        return block_ids[group][index], fine_key(request.digests, boundary // hbs - 1, group, hbs)

    def _find_fa_partial_tail_source(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> int | None:
        """The GPU block of the first full-attention group's prompt tail, when a finishing
        request's final flush must store it (vLLM 0.30.0 on, S13): with fine-grained CPU
        hits, a tail inside a block of the computed tokens, registered on the block (as its
        primary or a secondary key), neither in flight nor on the CPU yet."""
        found = self._tail_block(request, block_ids, self.fa_tail_boundary(request))
        if found is None:
            return None
        block_id, key = found
        block = self.gpu_pool.blocks[block_id]
        if block.is_null or block_id in self.in_flight_store_gpu_blocks:
            return None
        if block.block_hash != key and key not in self.gpu_pool.secondary.get(block_id, ()):
            return None
        if self.cpu_pool.get_one_block(key) is not None:
            return None
        return block_id

    def _observe_tail(
        self, request: Request, block_ids: tuple[list[int], ...], selected: list[int]
    ) -> TailRecord | None:
        """What the TAIL invariant checks a final flush's choice against (before the choice),
        when the first full-attention group's prompt tail falls inside a block of the table."""
        # Where the GPU side registered the tail, whatever a variant looks for.
        boundary = resend_boundary(request, self.hash_block_size)
        found = self._tail_block(request, block_ids, boundary)
        if found is None:
            return None
        block_id, key = found
        return TailRecord(
            request.request_id,
            boundary,
            block_id,
            key in self.gpu_pool.keys_of(block_id),
            block_id in self.in_flight_store_gpu_blocks,
            key in self.cpu_pool.cached,
            block_id in selected,
            len(selected) < self.cpu_pool.num_free_blocks,
            taken=False,
        )

    def request_finished(self, request: Request) -> None:
        req_id = request.request_id
        pending = self.pending_cpu_hits.pop(req_id, None)
        if pending is not None:
            self._free_pending_cpu_hit(pending)
        load = self.reqs_to_load.get(req_id)
        if load is not None:
            if load.load_event is not None:
                load.finished = True  # cleaned up when the load completes
            else:
                self._cleanup_load_request(req_id)
        state = self.reqs_to_store.get(req_id)
        if state is not None:
            if state.store_events:
                state.finished = True  # cleaned up when its last store completes
            else:
                self._cleanup_store_request(req_id)

    def _cleanup_load_request(self, req_id: str) -> int:
        """Release a request's load; the GPU blocks it copied if it was sent, else 0."""
        load = self.reqs_to_load.pop(req_id, None)
        if load is None:
            load = self.abandoned_reqs_to_load.pop(req_id, None)
        if load is None:
            return 0
        if load.load_event is not None:
            reqs = self.load_event_to_reqs.get(load.load_event)
            if reqs is not None:
                if req_id in reqs:
                    reqs.remove(req_id)
                if not reqs:
                    del self.load_event_to_reqs[load.load_event]
        self.cpu_pool.free_blocks([self.cpu_pool.blocks[i] for i in load.transfer.cpu_block_ids])
        self.gpu_pool.free_blocks([self.gpu_pool.blocks[i] for i in load.transfer.gpu_block_ids])
        return 0 if load.load_event is None else len(load.transfer.gpu_block_ids)

    def _cleanup_store_request(self, req_id: str) -> None:
        state = self.reqs_to_store.pop(req_id, None)
        if state is None:
            return
        for event in sorted(state.store_events):
            reqs = self.store_event_to_reqs.get(event)
            if reqs is not None:
                if req_id in reqs:
                    reqs.remove(req_id)
                if not reqs:
                    del self.store_event_to_reqs[event]
        state.store_events.clear()

    # -- stats ------------------------------------------------------------------------------

    def stats(self) -> OffloadStats:
        """Drain the stats: what they report now, the load count starting over."""
        pending = [
            *self.store_event_to_blocks.values(),
            *self.pending_finished_stores,
            *self.abandoned_store_event_to_blocks.values(),
        ]
        report = OffloadStats(
            load_blocks=self.loaded_blocks_since_drain,
            used_blocks=len(self.cpu_pool.blocks) - self.cpu_pool.num_free_blocks,
            pending_store_blocks=sum(len(t.cpu_block_ids) for t in pending),
            capacity_blocks=self.config.cpu_blocks,
            lazy=self.config.lazy,
            save_outcomes=tuple(sorted((str(o), n) for o, n in self.save_outcomes.items())),
        )
        self.loaded_blocks_since_drain = 0
        self.save_outcomes = {}
        self.stats_log.append(
            StatsRecord(report, tuple(self.completed_loads), tuple(self.decided_outcomes))
        )
        self.completed_loads = []
        self.decided_outcomes = []
        return report

    # -- reset ------------------------------------------------------------------------------

    def reset(self) -> bool:
        """Abandon transfers in flight, release queued ones, and clear the CPU cache if safe."""
        self.abandoned_store_event_to_blocks.update(self.store_event_to_blocks)
        # PR #53532: queued flushes were never sent, so no copy can be running.
        for transfer in self.pending_finished_stores:
            self._release_transfer_refs(transfer)
        self.pending_finished_stores.clear()
        self.store_event_to_blocks.clear()
        self.in_flight_store_gpu_blocks.clear()
        for req_id in list(self.reqs_to_load):
            load = self.reqs_to_load[req_id]
            if load.load_event is None:
                self._cleanup_load_request(req_id)
            else:
                self.abandoned_reqs_to_load[req_id] = self.reqs_to_load.pop(req_id)
        self.reqs_to_store.clear()
        self.store_event_to_reqs.clear()
        self.dispositions.clear()
        self.store_event_pending_counts = {
            e: c
            for e, c in self.store_event_pending_counts.items()
            if e in self.abandoned_store_event_to_blocks
        }
        abandoned = bool(self.abandoned_store_event_to_blocks or self.abandoned_reqs_to_load)
        cpu_idle = self.cpu_pool.num_free_blocks == len(self.cpu_pool.blocks) - 1
        returned = False if abandoned else self.cpu_pool.reset_prefix_cache()
        self.reset_log.append(ResetRecord(returned, abandoned, cpu_idle))
        return returned

    def serves_nothing(self) -> bool:
        """Whether the CPU tier holds no key it could serve (vLLM issue #57727: a prefix-cache
        reset that leaves the connector alone reports success only then)."""
        return not self.cpu_pool.cached

    def clear_logs(self) -> None:
        """Forget the ghost records of the previous driver call."""
        self.selection_log.clear()
        self.completion_log.clear()
        self.dropped_log.clear()
        self.reset_log.clear()
        self.prefix_reset_log.clear()
        self.stats_log.clear()
        self.lazy_scan_log.clear()
        self.lazy_return_log.clear()
        self.null_log.clear()
        self.stored_log.clear()
        self.boundary_log.clear()
        self.tail_log.clear()
        self.cpu_pool.allocation_log.clear()
        self.gpu_pool.allocation_log.clear()
