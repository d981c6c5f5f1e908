"""Longest prefix-cache hit across full-attention groups (vLLM's coordinator lookup).

For each group, the block keys from ``num_computed_tokens`` on are looked up left to right
and the scan stops at the first miss or after ``max_length`` tokens; each group's hit is
aligned down to the scheduler block size; the hit of all groups together is the shortest
of them, and every group keeps the blocks that cover it.

Invariant: the hit is a multiple of the scheduler block size and at most ``max_length``;
each returned block is registered under the key of its position.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

from kvoffload.model.arith import hit_length
from kvoffload.model.block_pool import Block, BlockPool
from kvoffload.model.keys import block_keys

if TYPE_CHECKING:
    from kvoffload.model.config import OffloadConfig


def find_longest_cache_hit(
    pool: BlockPool,
    digests: Sequence[str],
    num_computed_tokens: int,
    max_length: int,
    config: OffloadConfig,
    skip: Container[int] = (),
) -> tuple[tuple[list[Block], ...], int]:
    """The blocks of the longest hit after ``num_computed_tokens``, and its length; the
    blocks in ``skip`` are passed over as if they were not cached."""
    hits: list[list[Block]] = []
    for g, block_size in enumerate(config.group_block_sizes):
        keys = block_keys(digests, g, block_size, config.hash_block_size)
        start = num_computed_tokens // block_size
        found: list[Block] = []
        for key in keys[start : start + max_length // block_size]:
            block = pool.get_one_block(key, skip)
            if block is None:
                break
            found.append(block)
        hits.append(found)
    sizes = list(config.group_block_sizes)
    hit = hit_length([len(f) for f in hits], sizes, config.scheduler_block_size, max(max_length, 0))
    blocks = tuple(found[: hit // size] for found, size in zip(hits, sizes, strict=True))
    return blocks, hit
