"""The ghost records: what the connector's scheduler side observed at each decision, for the
transition invariants to check (:mod:`kvoffload.model.invariants`). They observe; they steer
nothing, and no rule of the algorithm reads them. Kept apart from the algorithm, so that the
floors above read as the spec: a decision there appends one record, built here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload.model.block_pool import Block, BlockPool
from kvoffload.model.keys import BlockKey
from kvoffload.model.offload_state import (
    ConnectorState,
    Disposition,
    Outcome,
    Transfer,
    resend_boundary,
)
from kvoffload.model.types import KVEvent, OffloadStats

if TYPE_CHECKING:
    from kvoffload.model.config import OffloadConfig
    from kvoffload.model.engine import Request


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


class GhostRecords(ConnectorState):
    """The logs of the ghost records, and how each record is built."""

    def __init__(self, config: OffloadConfig, gpu_pool: BlockPool) -> None:
        super().__init__(config, gpu_pool)
        # (observations the invariants check; they steer nothing)
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
        # How many CPU blocks hold each key, as the kv events taken so far announce it
        # (EVENT-STREAM): a router's view of the tier, kept across calls (never cleared with
        # the logs).
        self.announced: dict[BlockKey, int] = {}
        self.boundary_log: list[BoundaryRecord] = []
        self.tail_log: list[TailRecord] = []

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
