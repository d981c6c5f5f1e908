"""The hybrid lookup with a chunked local group (vLLM's ``ChunkedLocalAttentionManager``)."""

from __future__ import annotations

import pytest

from kvoffload.model import OffloadConfig
from kvoffload.model.block_pool import BlockPool
from kvoffload.model.keys import block_keys, prefix_digests
from kvoffload.model.lookup import find_longest_cache_hit

# Full attention and a chunked local group, blocks of 4 tokens, chunks of 8.
CONFIG = OffloadConfig(16, 16, (4, 4), 4, attention_chunks=(None, 8))
TOKENS = list(range(20))


def _pool_caching(positions: dict[int, range]) -> BlockPool:
    """A pool holding, per group, the keys of ``TOKENS``'s blocks at the positions named."""
    pool = BlockPool(16, "cpu")
    digests = prefix_digests(TOKENS, 4)
    for group, where in positions.items():
        keys = block_keys(digests, group, 4, 4)
        for i in where:
            pool.insert_block_hash(keys[i], pool.get_new_blocks(1)[0], keys[i].num_tokens)
    return pool


@pytest.mark.parametrize(
    ("max_length", "chunked", "hit", "nulls"),
    [
        # vLLM's docstring, example 1: a candidate of 15 tokens ends in the second chunk
        # (tokens 8 to 15), whose complete block 2 is cached: [null, null, block 2]
        (15, range(2, 3), 12, 2),
        # the same without block 2: the nulls of the first chunk alone are the hit
        (15, range(0), 8, 2),
        # example 2: 16 tokens end on a chunk boundary, all four positions left the chunk
        (16, range(0), 16, 4),
        # a candidate inside the first chunk looks its blocks up from the start
        (7, range(0, 1), 4, 0),
    ],
)
def test_a_chunked_group_takes_nulls_before_the_chunk_the_candidate_ends_in(
    max_length: int, chunked: range, hit: int, nulls: int
) -> None:
    pool = _pool_caching({0: range(5), 1: chunked})
    digests = prefix_digests(TOKENS, 4)
    blocks, length = find_longest_cache_hit(pool, digests, 0, max_length, CONFIG)
    assert length == hit
    assert [b.is_null for b in blocks[1]] == [True] * nulls + [False] * (hit // 4 - nulls)
    # full attention is trimmed to the common hit
    assert len(blocks[0]) == hit // 4 and not any(b.is_null for b in blocks[0])


# Full attention and a Mamba group (align mode), blocks of 4 tokens; and with full-attention
# blocks of 8 (the scheduler block), where a Mamba state is a hit only at a multiple of 8.
MAMBA = OffloadConfig(16, 16, (4, 4), 4, mamba=(False, True))
MAMBA_8 = OffloadConfig(16, 16, (8, 4), 4, mamba=(False, True))


@pytest.mark.parametrize(
    ("config", "full", "states", "max_length", "hit"),
    [
        # the last cached state at or below the candidate: 12, its block after 2 nulls
        (MAMBA, range(5), range(0, 3), 19, 12),
        # a state past the full-attention hit is no hit; the one below it is
        (MAMBA, range(2), range(0, 4), 19, 8),
        # no state at all: no hit, whatever full attention holds
        (MAMBA, range(5), range(0), 19, 0),
        # a state in the middle, none at the end: the hit stops at it
        (MAMBA, range(5), range(1, 2), 19, 8),
        # scheduler blocks of 8: the state at 12 ends off the alignment, 8's is the hit
        (MAMBA_8, range(2), range(1, 3), 19, 8),
    ],
)
def test_a_mamba_group_takes_the_last_cached_state_after_nulls(
    config: OffloadConfig, full: range, states: range, max_length: int, hit: int
) -> None:
    pool = BlockPool(32, "cpu")
    digests = prefix_digests(TOKENS, 4)
    for group, where in ((0, full), (1, states)):
        size = config.group_block_sizes[group]
        keys = block_keys(digests, group, size, 4)
        for i in where:
            pool.insert_block_hash(keys[i], pool.get_new_blocks(1)[0], keys[i].num_tokens)
    blocks, length = find_longest_cache_hit(pool, digests, 0, max_length, config)
    assert length == hit
    # the Mamba group: nulls, then the one state block that ends the hit
    assert [b.is_null for b in blocks[1]] == ([True] * (hit // 4 - 1) + [False] if hit else [])
    assert len(blocks[0]) == hit // config.group_block_sizes[0]
