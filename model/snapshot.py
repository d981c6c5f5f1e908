"""The read-only snapshot of all observable state, shared by the model and every
implementation: two implementations conform when their snapshots are equal after every
step. Everything is an immutable value in a canonical order (sorted where the source
order carries no meaning, kept where it does: free-queue order, the block order under one
key, transfer order).

The parts are named tuples, so that building a snapshot after every call and comparing two
run at the speed of tuples (issue 15); only the snapshot itself is a dataclass, whose
fields a difference is reported by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvoffload.model.keys import BlockKey


class BlockView(NamedTuple):
    block_id: int
    ref_cnt: int
    primary: BlockKey | None
    primary_tokens: int | None
    secondary: tuple[BlockKey, ...]


class PoolView(NamedTuple):
    """A block pool: every block (null block 0 included), the free queue from head to tail,
    and the key map with the blocks under each key in insertion order."""

    blocks: tuple[BlockView, ...]
    free_queue: tuple[int, ...]
    cached: tuple[tuple[BlockKey, tuple[int, ...]], ...]


class RequestView(NamedTuple):
    request_id: str
    status: str
    num_tokens: int
    num_computed_tokens: int
    output: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]


class TransferView(NamedTuple):
    """A store or load: the event (None while a load is not sent yet), GPU and CPU blocks."""

    event: int | None
    gpu_block_ids: tuple[int, ...]
    cpu_block_ids: tuple[int, ...]


class LoadView(NamedTuple):
    request_id: str
    transfer: TransferView
    finished: bool


class StoreTrackView(NamedTuple):
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
