"""The state of the connector's scheduler side, and what every concern of it shares: the
CPU pool, the loads and stores outstanding, the event counters, and the helpers that clean
a request's loads and stores up. The concerns build on it one floor each
(:mod:`~kvoffload.model.ghost`, :mod:`~kvoffload.model.loads`,
:mod:`~kvoffload.model.selection`, :mod:`~kvoffload.model.lazy_scan`,
:mod:`~kvoffload.model.completion`, :mod:`~kvoffload.model.final_flush`), and
:class:`~kvoffload.model.offload.OffloadScheduler` is the top floor.

Invariants kept (docs/spec.md; checked by :mod:`kvoffload.model.invariants`): PENDING, and
with the floors above REF-GPU, REF-CPU and IN-FLIGHT.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from kvoffload.model.block_pool import Block, BlockPool
from kvoffload.model.keys import BlockKey, fine_key

if TYPE_CHECKING:
    from kvoffload.model.config import OffloadConfig
    from kvoffload.model.engine import Request


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


class Outcome(StrEnum):
    """What became of one boundary-state hand-off (vLLM's ``SAVE_OUTCOMES`` labels)."""

    STORED = "stored"
    DROPPED_CPU_FULL = "dropped_cpu_full"
    DROPPED_REQUEST_GONE = "dropped_request_gone"
    DROPPED_NULL_BLOCK = "dropped_null_block"
    DROPPED_NOT_HASHED = "dropped_not_hashed"
    SKIPPED_ALREADY_CACHED = "skipped_already_cached"
    SKIPPED_IN_FLIGHT = "skipped_in_flight"


def resend_boundary(request: Request, hash_block_size: int) -> int:
    """The prompt tail a full-attention block of several hash blocks registers when it ends
    inside the block, with fine-grained hits: the last hash boundary a resend of the prompt
    can hit (its last token is recomputed), at most the request's hashed tokens (vLLM 0.33.0
    on, ``FullAttentionManager._cache_partial_tail_block``)."""
    hbs = hash_block_size
    return min((len(request.prompt) - 1) // hbs, len(request.digests)) * hbs


class ConnectorState:
    """What the connector's scheduler side holds; method names follow vLLM's."""

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

    def allocate_store_destinations(self, gpu_ids: list[int]) -> list[Block]:
        """Reserve one CPU block per selected GPU block. Fixed code does not stamp them."""
        return self.cpu_pool.get_new_blocks(len(gpu_ids))

    def has_pending_stores(self) -> bool:
        return bool(
            self.pending_finished_stores
            or self.store_event_to_blocks
            or self.abandoned_store_event_to_blocks
        )

    def load_event_to_reqs_for(self, event: int) -> tuple[str, ...]:
        """The requests a worker reports as loaded when ``event`` completes."""
        return tuple(self.load_event_to_reqs.get(event, ()))

    def _release_transfer_refs(self, transfer: Transfer) -> None:
        """Drop a transfer's pins without making its data reachable."""
        self.cpu_pool.free_blocks([self.cpu_pool.blocks[i] for i in transfer.cpu_block_ids])
        self.gpu_pool.free_blocks([self.gpu_pool.blocks[i] for i in transfer.gpu_block_ids])

    def _free_pending_cpu_hit(self, pending: PendingHit) -> None:
        self.cpu_pool.free_blocks([b for group in pending.blocks for b in group if not b.is_null])

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
