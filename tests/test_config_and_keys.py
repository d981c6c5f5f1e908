"""Configuration validation and chained keys."""

from __future__ import annotations

import pytest

from kvoffload.model import ConfigError, OffloadConfig
from kvoffload.model.keys import BlockKey, block_keys, fine_key, prefix_digests


def test_scheduler_block_size_is_the_lcm_of_group_sizes() -> None:
    config = OffloadConfig(gpu_blocks=8, cpu_blocks=4, group_block_sizes=(4, 6), hash_block_size=2)
    assert config.scheduler_block_size == 12
    assert config.num_groups == 2


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu_blocks": 0}, "gpu_blocks must be > 0"),
        ({"cpu_blocks": -1}, "cpu_blocks must be > 0"),
        ({"world_size": 0}, "world_size must be > 0"),
        ({"hash_block_size": 0}, "hash_block_size must be > 0"),
        ({"group_block_sizes": ()}, "non-empty tuple"),
        ({"group_block_sizes": (16, 0)}, r"group_block_sizes\[1\] must be > 0"),
        ({"group_block_sizes": (16, 12), "hash_block_size": 8}, "does not divide group 1"),
        ({"gpu_blocks": 2.5}, "must be an int"),
        ({"gpu_blocks": True}, "must be an int"),
        ({"lazy": 1}, "lazy must be a bool"),
        ({"kv_events": "yes"}, "kv_events must be a bool"),
        ({"sliding_windows": [None]}, "sliding_windows must be a tuple"),
        ({"sliding_windows": (None, 4)}, "names 2 groups, group_block_sizes 1"),
        ({"sliding_windows": (8,)}, "no full-attention group"),
        (
            {"group_block_sizes": (16, 16), "sliding_windows": (None, 0)},
            r"sliding_windows\[1\] must be > 0",
        ),
        ({"attention_chunks": [None]}, "attention_chunks must be a tuple"),
        ({"attention_chunks": (32,)}, "no full-attention group"),
        ({"group_block_sizes": (16, 16), "attention_chunks": (None, 24)}, "not a multiple"),
        (
            {"group_block_sizes": (8, 16), "hash_block_size": 8, "attention_chunks": (32, None)},
            "is not the scheduler block size 16",
        ),
        (
            {
                "group_block_sizes": (16, 16),
                "sliding_windows": (None, 8),
                "attention_chunks": (None, 32),
            },
            "both a sliding window and an attention chunk",
        ),
        ({"mamba": [True]}, "mamba must be a tuple"),
        ({"mamba": (False, True)}, "names 2 groups, group_block_sizes 1"),
        ({"mamba": (1,)}, r"mamba\[0\] must be a bool"),
        ({"mamba": (True,)}, "no full-attention group"),
        (
            {"group_block_sizes": (16, 16), "sliding_windows": (None, 8), "mamba": (False, True)},
            "Mamba group 1 has a sliding window",
        ),
        (
            {"group_block_sizes": (16, 8), "hash_block_size": 4, "mamba": (False, True)},
            "nor the scheduler block size 16 .fine-grained hits inside a scheduler block",
        ),
        (
            {
                "group_block_sizes": (8, 8, 4),
                "hash_block_size": 4,
                "mamba": (False, True, False),
                "sliding_windows": (None, None, 3),
            },
            "group 2 is a sliding-window or chunked local group beside a Mamba group",
        ),
        (
            {
                "group_block_sizes": (16, 16),
                "mamba": (False, True),
                "dcp_world_size": 2,
                "world_size": 2,
            },
            "which is not full attention",
        ),
        ({"dcp_world_size": 0}, "dcp_world_size must be > 0"),
        ({"dcp_world_size": 2}, "does not divide world_size 1"),
        ({"dcp_world_size": 3, "world_size": 3}, "does not divide group 0's block size 16"),
        (
            {
                "dcp_world_size": 2,
                "world_size": 2,
                "group_block_sizes": (16, 16),
                "sliding_windows": (None, 8),
            },
            "group 1, which is not full attention",
        ),
    ],
)
def test_bad_config_is_rejected_with_a_clear_message(
    kwargs: dict[str, object], message: str
) -> None:
    base: dict[str, object] = {"gpu_blocks": 8, "cpu_blocks": 4}
    with pytest.raises(ConfigError, match=message):
        OffloadConfig(**{**base, **kwargs})  # type: ignore[arg-type]


def test_a_chunked_local_group_holds_only_its_chunk_s_blocks() -> None:
    chunked = OffloadConfig(
        gpu_blocks=8,
        cpu_blocks=4,
        group_block_sizes=(4, 4),
        hash_block_size=4,
        attention_chunks=(None, 8),
    )
    assert [chunked.chunk(0), chunked.chunk(1), chunked.window(1)] == [None, 8, None]
    assert not chunked.full_attention(1) and chunked.full_attention(0)
    # the tokens of the chunks before the current one are skipped, whole chunks only
    assert [chunked.skipped_tokens(1, n) for n in (0, 7, 8, 13, 16)] == [0, 0, 8, 8, 16]
    assert chunked.skipped_tokens(0, 13) == 0
    # 40 tokens: 10 full-attention blocks and at most a chunk's two
    assert chunked.blocks_for(40) == 10 + 2
    assert chunked.blocks_for(5) == 2 + 2
    # vLLM's lazy target counts a chunked local group as full attention
    assert chunked.lazy_target_free == 2 * 2 * (2048 // 4)


def test_a_sliding_window_group_holds_only_its_window_s_blocks() -> None:
    full = OffloadConfig(gpu_blocks=8, cpu_blocks=4, group_block_sizes=(4, 4), hash_block_size=4)
    hybrid = OffloadConfig(
        gpu_blocks=8,
        cpu_blocks=4,
        group_block_sizes=(4, 4),
        hash_block_size=4,
        sliding_windows=(None, 6),
    )
    assert [hybrid.window(0), hybrid.window(1), full.window(1)] == [None, 6, None]
    # 40 tokens one at a time: 10 full-attention blocks; the window of 6 never holds more
    # than 3 blocks at once (tokens 5 to 8 need the blocks of 0-3, 4-7 and 8-11)
    assert full.blocks_for(40) == 20
    assert hybrid.blocks_for(40) == 10 + 3
    assert hybrid.blocks_for(3) == 1 + 1
    # the lazy scan covers a window's blocks and one more for the window group
    assert hybrid.lazy_target_free == 2 * (2048 // 4 + 2 + 1)
    assert full.lazy_target_free == 2 * 2 * (2048 // 4)


def test_equal_prefixes_give_equal_keys_and_groups_do_not_share_keys() -> None:
    a = prefix_digests([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = prefix_digests([1, 2, 3, 4, 9, 9, 9, 9], 4)
    assert a[0] == b[0] and a[1] != b[1]
    assert block_keys(a, 0, 4, 4)[0] != block_keys(a, 1, 4, 4)[0]


def test_only_full_hash_blocks_are_hashed() -> None:
    assert len(prefix_digests([1, 2, 3, 4, 5], 2)) == 2


def test_a_block_key_is_the_fine_key_at_the_block_end() -> None:
    digests = prefix_digests(list(range(16)), 2)
    keys = block_keys(digests, 0, 8, 2)
    assert keys == [fine_key(digests, 3, 0, 2), fine_key(digests, 7, 0, 2)]
    assert keys[1] == BlockKey(0, 16, digests[7])
    # A boundary inside a block is a different key.
    assert fine_key(digests, 2, 0, 2) not in keys
