"""Completions: the workers' reports (``update_connector_output``), a store's registration
under every key of its source block once all workers have copied it, and the kv-cache events
of the CPU tier.

Invariants kept (docs/spec.md): REGISTERED, POOL-PRIMARY, EVENTS, EVENT-STORED, and
UNREACHABLE (a failed copy is dropped, not registered).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.model.block_pool import Block
from kvoffload.model.ghost import (
    CompletionRecord,
    LazyReturnRecord,
    StoredRecord,
)
from kvoffload.model.keys import BlockKey
from kvoffload.model.lazy_scan import (
    LazyScan,
)
from kvoffload.model.offload_state import (
    Transfer,
)
from kvoffload.model.types import STORED, KVEvent, announced

if TYPE_CHECKING:
    pass


class Completion(LazyScan):
    """The workers' reports, and what a completed store registers and announces."""

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
        self.announced = announced(self.announced, events)
        return events

    def register_stored_block(self, gpu_block: Block, cpu_block: Block) -> None:
        """Register the GPU block's primary, then its secondary keys, on the CPU block."""
        primary = gpu_block.block_hash
        assert primary is not None, f"stored GPU block {gpu_block.block_id} lost its key"
        self.cpu_pool.insert_block_hash(primary, cpu_block, gpu_block.block_hash_num_tokens)
        for key in sorted(self.gpu_pool.secondary.get(gpu_block.block_id, set())):
            self.cpu_pool.insert_block_hash(key, cpu_block, None)
