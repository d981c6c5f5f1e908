"""The read-only snapshot of all observable state, shared by the model and every
implementation: two implementations conform when their snapshots are equal after every
step. Everything is an immutable value in a canonical order (sorted where the source
order carries no meaning, kept where it does: free-queue order, the block order under one
key, transfer order).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.model.keys import BlockKey


@dataclass(frozen=True)
class BlockView:
    block_id: int
    ref_cnt: int
    primary: BlockKey | None
    primary_tokens: int | None
    secondary: tuple[BlockKey, ...]


@dataclass(frozen=True)
class PoolView:
    """A block pool: every block (null block 0 included), the free queue from head to tail,
    and the key map with the blocks under each key in insertion order."""

    blocks: tuple[BlockView, ...]
    free_queue: tuple[int, ...]
    cached: tuple[tuple[BlockKey, tuple[int, ...]], ...]


@dataclass(frozen=True)
class RequestView:
    request_id: str
    status: str
    num_tokens: int
    num_computed_tokens: int
    output: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class TransferView:
    """A store or load: the event (None while a load is not sent yet), GPU and CPU blocks."""

    event: int | None
    gpu_block_ids: tuple[int, ...]
    cpu_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadView:
    request_id: str
    transfer: TransferView
    finished: bool


@dataclass(frozen=True)
class StoreTrackView:
    """Eager tracking of one request: per-group cursors, its store events, finished flag."""

    request_id: str
    num_stored_blocks: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]
    store_events: tuple[int, ...]
    finished: bool


@dataclass(frozen=True)
class Snapshot:
    gpu: PoolView
    cpu: PoolView
    requests: tuple[RequestView, ...]
    tracked: tuple[StoreTrackView, ...]
    pending_flushes: tuple[TransferView, ...]
    store_events: tuple[TransferView, ...]
    abandoned_store_events: tuple[TransferView, ...]
    store_event_pending_counts: tuple[tuple[int, int], ...]
    store_event_requests: tuple[tuple[int, tuple[str, ...]], ...]
    in_flight_gpu_blocks: tuple[int, ...]
    loads: tuple[LoadView, ...]
    abandoned_loads: tuple[LoadView, ...]
    pending_hits: tuple[tuple[str, tuple[int, ...], int], ...]
    load_event_to_reqs: tuple[tuple[int, tuple[str, ...]], ...]
    store_event_counter: int
    load_event_counter: int
    has_pending_stores: bool
