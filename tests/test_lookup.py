"""The hybrid lookup: a chunked local group (vLLM's ``ChunkedLocalAttentionManager``), a
Mamba group, and fine-grained hits."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.model import OffloadConfig
from kvoffload.model.block_pool import BlockPool
from kvoffload.model.keys import block_keys, fine_key, prefix_digests
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


# Fine-grained hits: full attention in blocks of 8 beside a Mamba group of 8 (the scheduler
# block), hashed in blocks of 4: vLLM serves hits on any hash boundary.
FINE = OffloadConfig(16, 16, (8, 8), 4, mamba=(False, True))


def test_fine_grained_full_attention_probes_the_tail_inside_its_next_block() -> None:
    """Phase 2 of vLLM's ``FullAttentionManager.find_longest_cache_hit``: past the run of
    full blocks (8 tokens), the prompt tail keyed at 12 inside the next block is a hit of 12,
    the tail's block kept; without fine-grained hits the run alone, 8."""
    digests = prefix_digests(TOKENS, 4)
    pool = BlockPool(16, "cpu")
    full = block_keys(digests, 0, 8, 4)[0]
    pool.insert_block_hash(full, pool.get_new_blocks(1)[0], 8)
    tail = fine_key(digests, 2, 0, 4)  # the first 12 tokens
    tail_block = pool.get_new_blocks(1)[0]
    pool.insert_block_hash(tail, tail_block, 12)
    only_fa = OffloadConfig(16, 16, (8,), 4)
    blocks, hit = find_longest_cache_hit(pool, digests, 0, 19, only_fa, fine=True)
    assert hit == 12 and blocks[0][-1] is tail_block and len(blocks[0]) == 2
    # a candidate that ends before the tail probes no boundary past it
    assert find_longest_cache_hit(pool, digests, 0, 11, only_fa, fine=True)[1] == 8
    assert find_longest_cache_hit(pool, digests, 0, 19, only_fa)[1] == 8


def test_fine_grained_mamba_takes_the_last_state_at_any_hash_boundary() -> None:
    """vLLM's fine path of ``MambaManager.find_longest_cache_hit``: a state keyed at 12 in
    blocks of 8 is a hit of 12, after the null of block 0; full attention, trimmed to the
    hit, keeps the tail's block."""
    digests = prefix_digests(TOKENS, 4)
    pool = BlockPool(16, "cpu")
    for key in block_keys(digests, 0, 8, 4):
        pool.insert_block_hash(key, pool.get_new_blocks(1)[0], key.num_tokens)
    state = pool.get_new_blocks(1)[0]
    pool.insert_block_hash(fine_key(digests, 2, 1, 4), state, 12)
    blocks, hit = find_longest_cache_hit(pool, digests, 0, 19, FINE, fine=True)
    assert hit == 12
    assert blocks[1] == [pool.null_block, state]
    assert len(blocks[0]) == 2
    # without fine-grained hits no state ends on a block boundary: no hit
    assert find_longest_cache_hit(pool, digests, 0, 19, FINE)[1] == 0


@settings(max_examples=200, deadline=None)
@given(
    layout=st.sampled_from(
        [
            OffloadConfig(16, 16, (8, 8), 4, mamba=(False, True)),
            OffloadConfig(16, 16, (4, 8), 4, mamba=(False, True)),
            OffloadConfig(16, 16, (8, 4, 16), 4, mamba=(False, False, True)),
        ]
    ),
    full=st.lists(st.booleans(), min_size=5, max_size=5),
    tails=st.lists(st.booleans(), min_size=5, max_size=5),
    states=st.lists(st.booleans(), min_size=5, max_size=5),
    max_length=st.integers(0, 19),
)
def test_fine_grained_lookups_find_what_aligned_ones_do_where_the_config_admits_them(
    layout: OffloadConfig,
    full: list[bool],
    tails: list[bool],
    states: list[bool],
    max_length: int,
) -> None:
    """Where the configuration admits fine-grained hits (every Mamba block the scheduler
    block, so its states are keyed at scheduler blocks only), a hash-aligned lookup ends
    where the scheduler-block-aligned one does, with the same blocks, whatever prompt tails
    full attention holds: the implementation's lookups rely on it."""
    assert layout.fine_grained_hits
    digests = prefix_digests(TOKENS, 4)
    pool = BlockPool(64, "cpu")
    for g, size in enumerate(layout.group_block_sizes):
        keys = block_keys(digests, g, size, 4)
        present = states if layout.is_mamba(g) else full
        for i, key in enumerate(keys):
            if present[i % 5]:
                pool.insert_block_hash(key, pool.get_new_blocks(1)[0], key.num_tokens)
        if layout.is_mamba(g):
            continue
        for j, tail in enumerate(tails):
            if tail and (j + 1) * 4 % size:
                pool.insert_block_hash(fine_key(digests, j, g, 4), pool.get_new_blocks(1)[0], None)
    fine_blocks, fine_hit = find_longest_cache_hit(pool, digests, 0, max_length, layout, fine=True)
    blocks, hit = find_longest_cache_hit(pool, digests, 0, max_length, layout)
    assert (fine_hit, fine_blocks) == (hit, blocks)
