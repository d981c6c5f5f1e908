"""Reading the implementation's state into the shared :class:`Snapshot`."""

from __future__ import annotations

from kvoffload.impl.connector import Copy, Load
from kvoffload.impl.engine import ImplEngine
from kvoffload.impl.pool import Pool, block_key
from kvoffload.model.keys import BlockKey
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
    extra = pool.extra_keys
    keys: dict[str, BlockKey] = {}

    def shared(key: str) -> BlockKey:
        found = keys.get(key)
        if found is None:
            found = keys[key] = block_key(key)
        return found

    return PoolView(
        blocks=tuple(
            BlockView(
                b,
                pool.ref[b],
                None if pool.key[b] is None else shared(pool.key[b]),  # type: ignore[arg-type]
                pool.key_tokens[b],
                tuple(sorted(shared(k) for k in extra[b])) if b in extra else (),
            )
            for b in range(pool.num_blocks)
        ),
        free_queue=tuple(pool.free),
        cached=tuple(
            sorted((shared(key), pool.holders(key)) for key in pool.index),
        ),
    )


def _copy(event: int | None, copy: Copy) -> TransferView:
    return TransferView(event, tuple(copy.gpu), tuple(copy.cpu))


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
            (rid, tuple(b for g in h.blocks for b in g), h.length)
            for rid, h in sorted(c.hits.items())
        ),
        load_event_to_reqs=tuple((e, tuple(r)) for e, r in sorted(c.load_events.items())),
        store_event_counter=c.next_store_event,
        load_event_counter=c.next_load_event,
        has_pending_stores=c.pending(),
    )
