"""Longest prefix-cache hit across KV groups (vLLM's hybrid coordinator lookup).

Groups with the same kind, block size and window or chunk are looked up together (a position hits
only when every one of them has its key cached); full-attention groups come first. Each
kind finds its own hit below a candidate length:

- full attention scans its block keys from the start and stops at the first miss;
- a sliding-window group scans from the candidate's end towards the start and stops at the
  first run of ``ceil((window - 1) / block_size)`` cached blocks (all a token after the hit
  attends to); the blocks before that run are the null block. A run that reaches the start
  of the lookup is a hit however short;
- a chunked local attention group takes the null block for every block before the chunk
  the candidate's end falls in, and scans that chunk's blocks from its start, stopping at the
  first miss: the hit is the nulls and that run;
- a Mamba group scans from the candidate's end towards the start and stops at the first
  cached block (the state after the tokens up to its end): the hit is the nulls before it
  and that block.

The candidate starts at ``max_length`` and every group may lower it; the groups are asked
again until no group lowers it (once only with one full-attention and one other group, as
vLLM's ``is_simple_hybrid``). Full-attention groups keep the blocks that cover the hit.

Fine-grained hits (``fine``: vLLM's ``enable_partial_hash_hits``, a Mamba group larger than
the hash block): hits are aligned to the hash block, not the scheduler block. Full attention
then also probes the hash boundaries inside its first block past the run, from the highest
down (a block keyed at the prompt's tail), and a Mamba group larger than the hash block takes
the last cached state at any hash boundary.

Invariants: the hit is a multiple of the alignment (the scheduler block size, or the hash
block size with fine-grained hits) and at most ``max_length``;
each returned non-null block is registered under the key of its position; a sliding-window
group's blocks are nulls followed by a run of cached blocks that ends at the hit; a chunked
local group's blocks are the nulls of whole chunks followed by cached blocks; a Mamba group's
are nulls followed by one cached block.
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import TYPE_CHECKING

from kvoffload.model.arith import align_down, window_run
from kvoffload.model.block_pool import Block, BlockPool
from kvoffload.model.keys import BlockKey, block_keys, fine_key

if TYPE_CHECKING:
    from kvoffload.model.config import OffloadConfig


def _cached(
    pool: BlockPool, keys: list[list[BlockKey]], i: int, skip: Container[int]
) -> list[Block] | None:
    """The blocks of position ``i`` in every group of a spec group, or None on a miss."""
    found = [pool.get_one_block(group_keys[i], skip) for group_keys in keys]
    return None if any(b is None for b in found) else [b for b in found if b is not None]


def _extend_run(
    pool: BlockPool,
    keys: list[list[BlockKey]],
    blocks: list[list[Block]],
    start: int,
    stop: int,
    skip: Container[int],
) -> None:
    """Append to ``blocks`` the cached blocks of positions ``start``, ``start + 1``, ... up to
    the first miss (at most up to ``stop`` and the keys' end)."""
    for i in range(start, min(stop, len(keys[0]))):
        found = _cached(pool, keys, i, skip)
        if found is None:
            return
        for group, block in zip(blocks, found, strict=True):
            group.append(block)


def _full_attention_hit(
    pool: BlockPool,
    keys: list[list[BlockKey]],
    fine_keys: list[list[BlockKey]],
    block_size: int,
    max_length: int,
    alignment: int,
    skip: Container[int],
) -> tuple[list[list[Block]], int]:
    """vLLM's ``FullAttentionManager.find_longest_cache_hit``: the run of cached blocks from
    the start; with an alignment finer than the block (fine-grained hits), then the highest
    hash boundary inside the next block that some block holds the key of (``fine_keys``: per
    group, the key of each hash block's end)."""
    blocks: list[list[Block]] = [[] for _ in keys]
    _extend_run(pool, keys, blocks, 0, max_length // block_size, skip)
    hit = len(blocks[0]) * block_size
    if alignment < block_size and block_size % alignment == 0:
        scale = block_size // alignment
        first = len(blocks[0]) * scale
        for j in range(
            min(first + scale - 1, max_length // alignment, len(fine_keys[0])) - 1, first - 1, -1
        ):
            found = _cached(pool, fine_keys, j, skip)
            if found is None:
                continue
            for group, block in zip(blocks, found, strict=True):
                group.append(block)
            hit = (j + 1) * alignment
            break
    hit = align_down(hit, alignment)
    return [group[: -(-hit // block_size)] for group in blocks], hit


def _sliding_window_hit(
    pool: BlockPool,
    keys: list[list[BlockKey]],
    block_size: int,
    window: int,
    max_length: int,
    alignment: int,
    skip: Container[int],
) -> tuple[list[list[Block]], int]:
    """vLLM's ``SlidingWindowManager.find_longest_cache_hit`` (no EAGLE)."""
    need = window_run(window, block_size)
    num_blocks = min(max_length // block_size, len(keys[0]))
    blocks: list[list[Block]] = [[pool.null_block] * num_blocks for _ in keys]
    run = 0
    for i in range(num_blocks - 1, -1, -1):
        found = _cached(pool, keys, i, skip)
        if found is None:
            run = 0
            continue
        # A run must end on an aligned boundary; a block that would end it elsewhere is
        # passed over (without breaking a run: none has started).
        if run == 0 and block_size != alignment and (i + 1) * block_size % alignment:
            continue
        for group, block in zip(blocks, found, strict=True):
            group[i] = block
        run += 1
        if run >= need:
            return [group[: i + run] for group in blocks], (i + run) * block_size
    # No run of ``need`` blocks: the run that starts the lookup is the hit, aligned down.
    blocks = [group[:run] for group in blocks]
    while block_size != alignment and len(blocks[0]) * block_size % alignment:
        blocks = [group[:-1] for group in blocks]
    return blocks, len(blocks[0]) * block_size


def _chunked_local_hit(
    pool: BlockPool,
    keys: list[list[BlockKey]],
    block_size: int,
    chunk: int,
    max_length: int,
    skip: Container[int],
) -> tuple[list[list[Block]], int]:
    """vLLM's ``ChunkedLocalAttentionManager.find_longest_cache_hit`` (its block size is the
    alignment). The chunks are counted from the lookup's start: the caller's local prefix is
    a whole number of chunks (vLLM 0.33.0; bug S24 of docs/history.md before it)."""
    start = align_down(max_length, chunk) // block_size
    blocks: list[list[Block]] = [[pool.null_block] * start for _ in keys]
    _extend_run(pool, keys, blocks, start, max_length // block_size, skip)
    return blocks, len(blocks[0]) * block_size


def _mamba_hit(
    pool: BlockPool,
    keys: list[list[BlockKey]],
    fine_keys: list[list[BlockKey]],
    block_size: int,
    max_length: int,
    alignment: int,
    skip: Container[int],
) -> tuple[list[list[Block]], int]:
    """vLLM's ``MambaManager.find_longest_cache_hit`` in align mode: the last cached state
    at or below ``max_length`` that ends on an aligned boundary; with an alignment finer
    than the block (fine-grained hits), the last cached state at any hash boundary
    (``fine_keys``: per group, the key of each hash block's end), after the nulls of the
    blocks before it."""
    if alignment < block_size and block_size % alignment == 0:
        scale = block_size // alignment
        for j in range(min(max_length // alignment, len(fine_keys[0])) - 1, -1, -1):
            found = _cached(pool, fine_keys, j, skip)
            if found is not None:
                return [[pool.null_block] * (j // scale) + [b] for b in found], (j + 1) * alignment
        return [[] for _ in keys], 0
    for i in range(min(max_length // block_size, len(keys[0])) - 1, -1, -1):
        if (i + 1) * block_size % alignment:
            continue
        found = _cached(pool, keys, i, skip)
        if found is not None:
            return [[pool.null_block] * i + [block] for block in found], (i + 1) * block_size
    return [[] for _ in keys], 0


def find_longest_cache_hit(
    pool: BlockPool,
    digests: Sequence[str],
    num_computed_tokens: int,
    max_length: int,
    config: OffloadConfig,
    skip: Container[int] = (),
    fine: bool = False,
) -> tuple[tuple[list[Block], ...], int]:
    """The blocks of the longest hit after ``num_computed_tokens``, and its length; the
    blocks in ``skip`` are passed over as if they were not cached; ``fine``: fine-grained
    hits (the alignment is the hash block)."""
    blocks, hit, _ = find_hybrid_hit(
        pool, digests, num_computed_tokens, max_length, config, skip, fine
    )
    return blocks, hit


def find_hybrid_hit(
    pool: BlockPool,
    digests: Sequence[str],
    num_computed_tokens: int,
    max_length: int,
    config: OffloadConfig,
    skip: Container[int] = (),
    fine: bool = False,
) -> tuple[tuple[list[Block], ...], int, int]:
    """:func:`find_longest_cache_hit`, and the longest hit any one kind found on the way
    (vLLM's ``longest_hit_length``: a prefix some group caches past the common hit)."""
    sizes = config.group_block_sizes
    hbs = config.hash_block_size
    alignment = hbs if fine else config.scheduler_block_size
    # Spec groups: (window, chunk, Mamba, block size) -> group ids, full attention first.
    specs: dict[tuple[int | None, int | None, bool, int], list[int]] = {}
    for g, size in enumerate(sizes):
        specs.setdefault((config.window(g), config.chunk(g), config.is_mamba(g), size), []).append(
            g
        )
    order = sorted(specs, key=lambda spec: spec[0] is not None or spec[1] is not None or spec[2])
    keys = {
        g: block_keys(digests, g, size, config.hash_block_size)[num_computed_tokens // size :]
        for g, size in enumerate(sizes)
    }
    # The key of each hash block's end, from the lookup's start (fine-grained probes).
    fine_keys = (
        {
            g: [
                fine_key(digests, j, g, hbs)
                for j in range(num_computed_tokens // hbs, len(digests))
            ]
            for g in range(len(sizes))
        }
        if fine
        else {g: [] for g in range(len(sizes))}
    )
    result: dict[int, list[Block]] = {g: [] for g in range(len(sizes))}
    full_hits: dict[tuple[int | None, int | None, bool, int], int] = {}
    simple = len(order) == 2 and order[0][:3] == (None, None, False)
    hit = max(max_length, 0)
    longest = 0
    while True:
        candidate = hit
        for spec in order:
            window, chunk, mamba, size = spec
            full = window is None and chunk is None and not mamba
            if full and spec in full_hits:
                # Full attention is downward-closed: one lookup, trimmed later.
                candidate = min(candidate, full_hits[spec])
                continue
            group_keys = [keys[g] for g in specs[spec]]
            group_fine_keys = [fine_keys[g] for g in specs[spec]]
            if full:
                found, candidate = _full_attention_hit(
                    pool, group_keys, group_fine_keys, size, candidate, alignment, skip
                )
                full_hits[spec] = candidate
            elif mamba:
                found, candidate = _mamba_hit(
                    pool, group_keys, group_fine_keys, size, candidate, alignment, skip
                )
            elif chunk is not None:
                found, candidate = _chunked_local_hit(
                    pool, group_keys, size, chunk, candidate, skip
                )
            else:
                assert window is not None
                found, candidate = _sliding_window_hit(
                    pool, group_keys, size, window, candidate, alignment, skip
                )
            for g, blocks in zip(specs[spec], found, strict=True):
                result[g] = blocks
            longest = max(longest, candidate)
        if candidate >= hit:
            break
        hit = candidate
        if simple:
            break
    for g, size in enumerate(sizes):
        if config.full_attention(g):
            result[g] = result[g][: -(-hit // size)]
    return tuple(result[g] for g in range(len(sizes))), hit, longest
