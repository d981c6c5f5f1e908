"""Reading the implementation's state into the shared :class:`Snapshot`."""

from __future__ import annotations

from kvoffload.impl.connector import Copy, Load
from kvoffload.impl.engine import ImplEngine
from kvoffload.impl.pool import Pool
from kvoffload.model.snapshot import (
    BlockView,
    LoadView,
    PoolView,
    RequestView,
    Snapshot,
    StoreTrackView,
    TransferView,
)


def pool_view(pool: Pool) -> PoolView:
    return PoolView(
        blocks=tuple(
            BlockView(
                b.block_id,
                b.ref,
                b.key,
                b.key_tokens,
                tuple(sorted(pool.extra_keys.get(b.block_id, ()))),
            )
            for b in pool.blocks
        ),
        free_queue=tuple(b.block_id for b in pool.free),
        cached=tuple((key, tuple(holders)) for key, holders in sorted(pool.index.items())),
    )


def _copy(event: int | None, copy: Copy) -> TransferView:
    return TransferView(
        event, tuple(b.block_id for b in copy.gpu), tuple(b.block_id for b in copy.cpu)
    )


def _load(load: Load) -> LoadView:
    return LoadView(load.request_id, _copy(load.event, load.copy), load.finished)


def take_snapshot(engine: ImplEngine) -> Snapshot:
    c = engine.connector
    return Snapshot(
        gpu=pool_view(engine.gpu),
        cpu=pool_view(c.cpu),
        requests=tuple(
            RequestView(
                rid,
                r.status.value,
                r.num_tokens,
                r.num_computed_tokens,
                tuple(r.output),
                tuple(tuple(ids) for ids in engine.tables.get(rid, [])),
            )
            for rid, r in sorted(engine.requests.items())
        ),
        tracked=tuple(
            StoreTrackView(
                rid,
                tuple(t.cursors),
                tuple(tuple(ids) for ids in t.tables),
                tuple(sorted(t.events)),
                t.finished,
            )
            for rid, t in sorted(c.trackers.items())
        ),
        pending_flushes=tuple(_copy(None, f) for f in c.flushes),
        store_events=tuple(_copy(e, s) for e, s in sorted(c.stores.items())),
        abandoned_store_events=tuple(_copy(e, s) for e, s in sorted(c.abandoned_stores.items())),
        store_event_pending_counts=tuple(sorted(c.partial.items())),
        store_event_requests=tuple((e, tuple(r)) for e, r in sorted(c.store_reqs.items())),
        in_flight_gpu_blocks=tuple(sorted(c.in_flight)),
        loads=tuple(_load(x) for _, x in sorted(c.loads.items())),
        abandoned_loads=tuple(_load(x) for _, x in sorted(c.abandoned_loads.items())),
        pending_hits=tuple(
            (rid, tuple(b.block_id for g in h.blocks for b in g), h.length)
            for rid, h in sorted(c.hits.items())
        ),
        load_event_to_reqs=tuple((e, tuple(r)) for e, r in sorted(c.load_events.items())),
        store_event_counter=c.next_store_event,
        load_event_counter=c.next_load_event,
        has_pending_stores=c.pending(),
    )
