"""The final flush (PR #53532): at a request's finish, the confirmed blocks no scan has
reached, and with fine-grained hits the block holding the prompt's tail, queued for the next
store event; then the request's loads and stores are cleaned up.

Invariants kept (docs/spec.md): FLUSH-COMPLETE, TAIL.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from kvoffload.model.completion import (
    Completion,
)
from kvoffload.model.offload_state import (
    Transfer,
    resend_boundary,
)

if TYPE_CHECKING:
    from kvoffload.model.engine import Request


class FinalFlush(Completion):
    """A finishing request's last store."""

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> Transfer | None:
        """The finish hook; returns the final-flush transfer it queued, if any."""
        flushed = self._queue_finished_eager_store(request, block_ids)
        self.request_finished(request)
        return flushed

    def _queue_finished_eager_store(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> Transfer | None:
        """PR #53532: queue the confirmed blocks no scan has reached (the final flush)."""
        state = self.reqs_to_store.get(request.request_id)
        if state is None:
            return None
        gpu_ids, _, meta = self._select_eager_blocks_to_store(state, block_ids, final_flush=True)
        tail = self._find_fa_partial_tail_source(request, block_ids)
        observed = self._observe_tail(request, block_ids, gpu_ids)
        taken = (
            tail is not None
            # A decode that filled the tail block made it the scan's: one CPU block for it.
            and tail not in gpu_ids
            and len(gpu_ids) < self.cpu_pool.num_free_blocks
        )
        if observed is not None:
            self.tail_log.append(replace(observed, taken=taken))
        if taken:
            assert tail is not None
            gpu_ids.append(tail)
            if meta is not None:
                # Its keys are read at completion: the event carries no payload.
                meta.append({})
        if not gpu_ids:
            return None
        cpu_blocks = self.allocate_store_destinations(gpu_ids)
        transfer = Transfer(gpu_ids, [b.block_id for b in cpu_blocks], meta)
        self.pending_finished_stores.append(transfer)
        self.in_flight_store_gpu_blocks.update(gpu_ids)
        # Pinned before the engine frees the request's own refs.
        self.gpu_pool.touch([self.gpu_pool.blocks[i] for i in gpu_ids])
        return transfer

    def fa_tail_boundary(self, request: Request) -> int:
        """Where the final flush looks for the prompt tail: where the GPU side registers it
        (vLLM 0.34.0; S28)."""
        return resend_boundary(request, self.hash_block_size)

    def _find_fa_partial_tail_source(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> int | None:
        """The GPU block of the first full-attention group's prompt tail, when a finishing
        request's final flush must store it (vLLM 0.30.0 on, S13): with fine-grained CPU
        hits, a tail inside a block of the computed tokens, registered on the block (as its
        primary or a secondary key), neither in flight nor on the CPU yet."""
        found = self._tail_block(request, block_ids, self.fa_tail_boundary(request))
        if found is None:
            return None
        block_id, key = found
        block = self.gpu_pool.blocks[block_id]
        if block.is_null or block_id in self.in_flight_store_gpu_blocks:
            return None
        if block.block_hash != key and key not in self.gpu_pool.secondary.get(block_id, ()):
            return None
        if self.cpu_pool.get_one_block(key) is not None:
            return None
        return block_id

    def request_finished(self, request: Request) -> None:
        req_id = request.request_id
        pending = self.pending_cpu_hits.pop(req_id, None)
        if pending is not None:
            self._free_pending_cpu_hit(pending)
        load = self.reqs_to_load.get(req_id)
        if load is not None:
            if load.load_event is not None:
                load.finished = True  # cleaned up when the load completes
            else:
                self._cleanup_load_request(req_id)
        state = self.reqs_to_store.get(req_id)
        if state is not None:
            if state.store_events:
                state.finished = True  # cleaned up when its last store completes
            else:
                self._cleanup_store_request(req_id)
