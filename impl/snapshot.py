"""Reading the implementation's state into the shared :class:`Snapshot`.

:class:`Views` keeps the last snapshot's parts and reuses them while the state they show is
unchanged: a pool's view is rebuilt only when its raw state (ref counts, keys, free queue,
index) differs from the one it was built from, and the snapshot object itself is the last one
when nothing it shows has changed. So taking a snapshot after a call that changed nothing
costs little, and a caller can tell "unchanged" by identity (the lockstep comparison does).
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.impl.connector import Copy, Load
from kvoffload.impl.engine import ImplEngine
from kvoffload.impl.pool import Pool, block_key
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
    return PoolView(
        blocks=tuple(
            BlockView(
                b,
                pool.ref[b],
                None if key is None else block_key(key),
                pool.key_tokens[b],
                tuple(sorted(block_key(k) for k in extra[b])) if b in extra else (),
            )
            for b, key in enumerate(pool.key)
        ),
        free_queue=tuple(pool.free),
        cached=tuple(sorted((block_key(key), pool.holders(key)) for key in pool.index)),
    )


def pool_state(pool: Pool) -> tuple[object, ...]:
    """Everything :func:`pool_view` reads, as plain values (cheap to build and compare)."""
    return (
        tuple(pool.ref),
        tuple(pool.key),
        tuple(pool.key_tokens),
        tuple(pool.free),
        tuple(pool.index.items()),
        tuple((key, tuple(holders)) for key, holders in pool.dups.items()),
        tuple((block, frozenset(keys)) for block, keys in pool.extra_keys.items()),
    )


class Views:
    """Snapshots of one implementation, each part reused while its state is unchanged."""

    def __init__(self) -> None:
        self.pools: dict[str, tuple[tuple[object, ...], PoolView]] = {}
        self.last: Snapshot | None = None

    def pool(self, pool: Pool) -> PoolView:
        state = pool_state(pool)
        known = self.pools.get(pool.name)
        if known is not None and known[0] == state:
            return known[1]
        view = pool_view(pool)
        self.pools[pool.name] = (state, view)
        return view

    def snapshot(self, engine: ImplEngine) -> Snapshot:
        fresh = take_snapshot(engine, self.pool)
        if self.last is not None and fresh == self.last:
            return self.last  # the pools compare by identity: the rest, by value
        self.last = fresh
        return fresh


def _copy(event: int | None, copy: Copy) -> TransferView:
    return TransferView(event, tuple(copy.gpu), tuple(copy.cpu))


def _load(load: Load) -> LoadView:
    return LoadView(load.request_id, _copy(load.event, load.copy), load.finished)


def take_snapshot(engine: ImplEngine, view: Callable[[Pool], PoolView] = pool_view) -> Snapshot:
    c = engine.connector
    return Snapshot(
        gpu=view(engine.gpu),
        cpu=view(c.cpu),
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
