"""Lookup and load: the CPU hit a request gets (``get_num_new_matched_tokens``), its pin until
the allocation takes it, and the load that allocation sends (``update_state_after_alloc``).

Invariants kept (docs/spec.md): LOAD-PINNED, NO-READ, INTEGRITY, LOAD-TARGET.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kvoffload.model.arith import lookup_limit
from kvoffload.model.block_pool import Block
from kvoffload.model.ghost import (
    GhostRecords,
)
from kvoffload.model.lookup import find_longest_cache_hit
from kvoffload.model.offload_state import (
    LoadState,
    PendingHit,
    StoreState,
    Transfer,
)

if TYPE_CHECKING:
    from kvoffload.model.engine import Request


class Loads(GhostRecords):
    """CPU hits and the loads that bring them to the GPU."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens past ``num_computed_tokens`` the CPU pool can load; pins the hit blocks."""
        stale = self.pending_cpu_hits.pop(request.request_id, None)
        if stale is not None:
            self._free_pending_cpu_hit(stale)
        if not self.reads_for(request):
            return 0, False
        if num_computed_tokens % self.block_size != 0:
            return 0, False
        if not self.starts_on_chunk_boundary(num_computed_tokens):
            return 0, False
        if len(request.digests) <= num_computed_tokens // self.hash_block_size:
            return 0, False
        # At least the last token is recomputed, to sample from it.
        max_hit_len = lookup_limit(request.num_tokens, num_computed_tokens)
        if max_hit_len <= 0:
            return 0, False
        blocks, hit = self._intact_hit(request.digests, num_computed_tokens, max_hit_len)
        if hit <= 0:
            return 0, False
        self._pin_hit(request.request_id, PendingHit(blocks, hit, num_computed_tokens))
        return hit, True

    def starts_on_chunk_boundary(self, num_computed_tokens: int) -> bool:
        """Whether a CPU hit may follow a local prefix of ``num_computed_tokens``: the lookup
        counts a chunked local group's chunks from its own start, so that start must be a
        chunk boundary (vLLM 0.33.0; bug S24 of docs/history.md: after a prefix that ends
        inside a chunk, the chunked group's hit sits one chunk boundary off, and its load
        writes into the null block)."""
        return all(
            num_computed_tokens % chunk == 0
            for g in range(self.config.num_groups)
            if (chunk := self.config.chunk(g)) is not None
        )

    def reads_for(self, request: Request) -> bool:
        """Whether a CPU hit may be served to ``request``: not to one that skips reading the
        prefix cache (PR #54998, vLLM 0.30.0; a prompt-logprobs request needs every prompt
        token computed)."""
        return not request.skip_reading_prefix_cache

    def _pin_hit(self, request_id: str, hit: PendingHit) -> None:
        """Pin a hit until the allocation takes it (PR #42289), so that no store
        allocation in between evicts it."""
        self.cpu_pool.touch([b for group in hit.blocks for b in group if not b.is_null])
        self.pending_cpu_hits[request_id] = hit

    def _intact_hit(
        self, digests: list[str], num_computed_tokens: int, max_hit_len: int
    ) -> tuple[tuple[list[Block], ...], int]:
        """The longest CPU hit whose blocks hold the bytes they were registered with.

        kvoffload's integrity contract (vLLM's scheduler reads no bytes): a hit block found
        damaged is evicted, as ``evict_blocks`` does, and the lookup is made again, so the
        hit ends before it and a damaged block is never loaded. Again, since a key cached
        by several blocks may lead to another damaged one; each round evicts at least one.
        """
        while True:
            blocks, hit = find_longest_cache_hit(
                self.cpu_pool,
                digests,
                num_computed_tokens,
                max_hit_len,
                self.config,
                fine=self.config.cpu_fine_grained_hits,
            )
            damaged = [b.block_id for g in blocks for b in g if b.block_id in self.cpu_pool.damaged]
            if not damaged:
                return blocks, hit
            self.cpu_pool.evict_blocks(damaged)

    def update_state_after_alloc(
        self, request: Request, block_ids: tuple[list[int], ...], num_external_tokens: int
    ) -> None:
        req_id = request.request_id
        if not self.config.lazy and req_id not in self.reqs_to_store:  # eager mode only
            self.reqs_to_store[req_id] = StoreState(
                request,
                tuple([] for _ in block_ids),
                [0] * len(block_ids),
            )
            self.dispositions[req_id] = [{} for _ in block_ids]
        pending = self.pending_cpu_hits.pop(req_id, None)
        if num_external_tokens == 0:
            if pending is not None:
                self._free_pending_cpu_hit(pending)
            return
        if pending is None:
            return
        gpu_ids: list[int] = []
        cpu_blocks: list[Block] = []
        for g, g_block_size in enumerate(self.group_block_sizes):
            # Only the leading blocks the scheduler accepted are loaded.
            taken = pending.blocks[g][: math.ceil(num_external_tokens / g_block_size)]
            start = self.load_start(pending, g_block_size, len(taken), num_external_tokens)
            for i, cpu_block in enumerate(taken):
                if cpu_block.is_null:
                    continue
                gpu_ids.append(block_ids[g][start + i])
                cpu_blocks.append(cpu_block)
        # Pin for the load before the lookup pin is dropped, so the net is +1.
        self.cpu_pool.touch(cpu_blocks)
        self._free_pending_cpu_hit(pending)
        self.gpu_pool.touch([self.gpu_pool.blocks[i] for i in gpu_ids])
        assert req_id not in self.reqs_to_load
        self.reqs_to_load[req_id] = LoadState(
            req_id, Transfer(gpu_ids, [b.block_id for b in cpu_blocks])
        )

    def load_start(
        self, pending: PendingHit, group_block_size: int, num_taken: int, num_external: int
    ) -> int:
        """The table position of a group where a load's first block goes: right after the
        local prefix the hit was found after (vLLM 0.30.0 on keep it with the pending hit)."""
        return pending.num_computed_tokens // group_block_size
