"""Reading the model's state into a :class:`~kvoffload.model.snapshot.Snapshot`."""

from __future__ import annotations

from kvoffload.model.block_pool import BlockPool
from kvoffload.model.engine import Engine
from kvoffload.model.offload import LoadState, Transfer
from kvoffload.model.snapshot import (
    BlockView,
    LoadView,
    PoolView,
    RequestView,
    Snapshot,
    StoreTrackView,
    TransferView,
)


def pool_view(pool: BlockPool) -> PoolView:
    secondary = pool.secondary  # (most blocks have none: no set to make and sort for them)
    return PoolView(
        blocks=tuple(
            BlockView(
                b.block_id,
                b.ref_cnt,
                b.block_hash,
                b.block_hash_num_tokens,
                tuple(sorted(secondary[b.block_id])) if b.block_id in secondary else (),
            )
            for b in pool.blocks
        ),
        free_queue=tuple(pool.free_queue),
        cached=tuple((key, tuple(ids)) for key, ids in sorted(pool.cached.items())),
    )


def _transfer(event: int | None, t: Transfer) -> TransferView:
    return TransferView(event, tuple(t.gpu_block_ids), tuple(t.cpu_block_ids))


def _load(load: LoadState) -> LoadView:
    return LoadView(load.request_id, _transfer(load.load_event, load.transfer), load.finished)


def take_snapshot(engine: Engine) -> Snapshot:
    c = engine.connector
    return Snapshot(
        gpu=pool_view(engine.gpu_pool),
        cpu=pool_view(c.cpu_pool),
        requests=tuple(
            RequestView(
                r.request_id,
                r.status.value,
                r.num_tokens,
                r.num_computed_tokens,
                tuple(r.output),
                tuple(tuple(ids) for ids in engine.req_to_blocks.get(r.request_id, [])),
            )
            for r in sorted(engine.requests.values(), key=lambda r: r.request_id)
        ),
        tracked=tuple(
            StoreTrackView(
                req_id,
                tuple(s.num_stored_blocks),
                tuple(tuple(ids) for ids in s.block_ids),
                tuple(sorted(s.store_events)),
                s.finished,
            )
            for req_id, s in sorted(c.reqs_to_store.items())
        ),
        pending_flushes=tuple(_transfer(None, t) for t in c.pending_finished_stores),
        store_events=tuple(_transfer(e, t) for e, t in sorted(c.store_event_to_blocks.items())),
        abandoned_store_events=tuple(
            _transfer(e, t) for e, t in sorted(c.abandoned_store_event_to_blocks.items())
        ),
        store_event_pending_counts=tuple(sorted(c.store_event_pending_counts.items())),
        store_event_requests=tuple(
            (e, tuple(reqs)) for e, reqs in sorted(c.store_event_to_reqs.items())
        ),
        in_flight_gpu_blocks=tuple(sorted(c.in_flight_store_gpu_blocks)),
        loads=tuple(_load(s) for _, s in sorted(c.reqs_to_load.items())),
        abandoned_loads=tuple(_load(s) for _, s in sorted(c.abandoned_reqs_to_load.items())),
        pending_hits=tuple(
            (req_id, tuple(b.block_id for g in hit.blocks for b in g), hit.hit_length)
            for req_id, hit in sorted(c.pending_cpu_hits.items())
        ),
        load_event_to_reqs=tuple(
            (e, tuple(reqs)) for e, reqs in sorted(c.load_event_to_reqs.items())
        ),
        store_event_counter=c.store_event_counter,
        load_event_counter=c.load_event_counter,
        has_pending_stores=c.has_pending_stores(),
    )
