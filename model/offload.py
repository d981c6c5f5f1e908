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

The class is built in floors, one concern each, every floor on the one below it (a floor
calls only what is beneath it, and a variant of :mod:`kvoffload.model.variants` overrides a
method of any floor):

1. :mod:`~kvoffload.model.offload_state`: the state, and the clean-up of a request's loads
   and stores;
2. :mod:`~kvoffload.model.ghost`: the ghost records the transition invariants check, kept
   apart from the algorithm (they steer nothing);
3. :mod:`~kvoffload.model.loads`: CPU hits, their pins and the loads;
4. :mod:`~kvoffload.model.selection`: the eager scan and the boundary-state hand-offs;
5. :mod:`~kvoffload.model.lazy_scan`: the lazy scan of the GPU free queue;
6. :mod:`~kvoffload.model.completion`: the workers' reports, registration, kv-cache events;
7. :mod:`~kvoffload.model.final_flush`: the final flush at a request's finish;
8. here, :class:`OffloadScheduler`: the step (``build_connector_meta``), the stats, the
   reset.

Invariants kept (docs/spec.md; checked by :mod:`kvoffload.model.invariants`): RESET and
STATS here, and each floor's own, which its module lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.model.final_flush import FinalFlush
from kvoffload.model.ghost import (
    BoundaryRecord,
    CompletionRecord,
    LazyReturnRecord,
    LazyScanRecord,
    NullRecord,
    PickRecord,
    ResetRecord,
    SelectionRecord,
    StatsRecord,
    StoredRecord,
    TailRecord,
)
from kvoffload.model.keys import BlockKey
from kvoffload.model.offload_state import (
    Disposition,
    LoadState,
    Outcome,
    PendingHit,
    StoreMeta,
    StoreState,
    Transfer,
    resend_boundary,
)
from kvoffload.model.types import NO_EVENT, ConnectorMetadata, OffloadStats

if TYPE_CHECKING:
    from kvoffload.model.engine import SchedulerOutput

__all__ = [
    "BoundaryRecord",
    "CompletionRecord",
    "Disposition",
    "LazyReturnRecord",
    "LazyScanRecord",
    "LoadState",
    "NullRecord",
    "OffloadScheduler",
    "Outcome",
    "PendingHit",
    "PickRecord",
    "ResetRecord",
    "SelectionRecord",
    "StatsRecord",
    "StoreMeta",
    "StoreState",
    "StoredRecord",
    "TailRecord",
    "Transfer",
    "resend_boundary",
]


class OffloadScheduler(FinalFlush):
    """Eager or lazy CPU offloading for one engine: the step (``build_connector_meta``), the
    stats and the reset, over the floors below. Method names follow vLLM's."""

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
