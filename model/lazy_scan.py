"""Lazy store selection (``OffloadConfig.lazy``): each step, the cached blocks near the head
of the GPU free queue whose key the CPU lacks, and their return to that head once stored.

Invariants kept (docs/spec.md): LAZY-SCAN, LAZY-EVICT-FIRST.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.model.block_pool import Block
from kvoffload.model.selection import (
    EagerSelection,
)

if TYPE_CHECKING:
    pass


class LazyScan(EagerSelection):
    """The lazy scan of the GPU free queue."""

    def _prepare_lazy_store_specs(self) -> tuple[list[int], list[int], list[str]]:
        """The cached GPU blocks nearest eviction whose key the CPU pool lacks: the free
        queue from its head, ``lazy_target_free`` blocks at most, as many as the CPU pool
        has free. The stores belong to no request."""
        target, num_free = self.config.lazy_target_free, self.cpu_pool.num_free_blocks
        queue = self.lazy_scan_queue()
        picked: list[int] = []
        visited: list[int] = []
        for covered, block_id in enumerate(queue):
            if covered >= target or len(picked) >= num_free:
                break
            visited.append(block_id)
            block = self.gpu_pool.blocks[block_id]
            key = block.block_hash
            if key is not None and not block.is_null and self.cpu_pool.get_one_block(key) is None:
                picked.append(block_id)
        self.lazy_scan_log.append(self._observe_scan(target, num_free, picked))
        self.after_lazy_scan(visited)
        cpu_blocks = self.allocate_store_destinations(picked)
        self.gpu_pool.touch([self.gpu_pool.blocks[i] for i in picked])
        return picked, [b.block_id for b in cpu_blocks], []

    def lazy_scan_queue(self) -> list[int]:
        """Where the lazy scan walks: the whole GPU free queue, from its head (0.34.0)."""
        return list(self.gpu_pool.free_queue)

    def after_lazy_scan(self, visited: list[int]) -> None:
        """What the scan keeps of the blocks it visited: nothing (0.34.0)."""

    def return_lazy_blocks(self, gpu_blocks: list[Block]) -> None:
        """Free a completed lazy store's GPU blocks to the head of the queue."""
        self.gpu_pool.free_blocks(gpu_blocks, evict_first=True)
