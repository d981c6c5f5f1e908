"""Configuration validation and chained keys."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TypeVar

import pytest

from kvoffload.impl import OffloadImpl
from kvoffload.impl.worker import KVLayout, kv_bytes, require_kv_fits
from kvoffload.model import ConfigError, OffloadConfig
from kvoffload.model.keys import BlockKey, block_keys, fine_key, prefix_digests
from kvoffload.model.limits import (
    MAX_BLOCK_TOKENS,
    MAX_BLOCKS,
    MAX_GROUPS,
    MAX_KV_BYTES,
    MAX_WORLD_SIZE,
)


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


# -- bounds (kvoffload.model.limits) -------------------------------------------------------

HUGE = 10**5000  # an int Python refuses to write as digits
T = TypeVar("T")


# Per bound: a configuration at it (taken), and the same just past it (refused, naming it).
W = MAX_WORLD_SIZE
BOUNDS: dict[str, tuple[dict[str, object], dict[str, object], str]] = {
    "gpu_blocks": (
        {"gpu_blocks": MAX_BLOCKS},
        {"gpu_blocks": MAX_BLOCKS + 1},
        "gpu_blocks must be <= 4194304 .MAX_BLOCKS.",
    ),
    "cpu_blocks": (
        {"cpu_blocks": MAX_BLOCKS},
        {"cpu_blocks": MAX_BLOCKS + 1},
        "cpu_blocks must be <= 4194304 .MAX_BLOCKS.",
    ),
    "hash_block_size": (
        {"group_block_sizes": (MAX_BLOCK_TOKENS,), "hash_block_size": MAX_BLOCK_TOKENS},
        {"group_block_sizes": (MAX_BLOCK_TOKENS,), "hash_block_size": MAX_BLOCK_TOKENS + 1},
        "hash_block_size must be <= 65536 .MAX_BLOCK_TOKENS.",
    ),
    "group block size": (
        {"group_block_sizes": (16, MAX_BLOCK_TOKENS)},
        {"group_block_sizes": (16, MAX_BLOCK_TOKENS + 16)},
        r"group_block_sizes\[1\] must be <= 65536 .MAX_BLOCK_TOKENS.",
    ),
    "groups": (
        {"group_block_sizes": (16,) * MAX_GROUPS},
        {"group_block_sizes": (16,) * (MAX_GROUPS + 1)},
        "33 groups; at most 32 .MAX_GROUPS.",
    ),
    "window": (
        {"group_block_sizes": (16, 16), "sliding_windows": (None, MAX_BLOCK_TOKENS)},
        {"group_block_sizes": (16, 16), "sliding_windows": (None, MAX_BLOCK_TOKENS + 1)},
        r"sliding_windows\[1\] must be <= 65536 .MAX_BLOCK_TOKENS.",
    ),
    "chunk": (
        {"group_block_sizes": (16, 16), "attention_chunks": (None, MAX_BLOCK_TOKENS)},
        {"group_block_sizes": (16, 16), "attention_chunks": (None, MAX_BLOCK_TOKENS + 16)},
        r"attention_chunks\[1\] must be <= 65536 .MAX_BLOCK_TOKENS.",
    ),
    "scheduler block size": (
        {"group_block_sizes": (2**15, 2**16), "hash_block_size": 2**14},
        {"group_block_sizes": (2**16, 3 * 2**14), "hash_block_size": 2**14},
        "scheduler block size 196608 .* must be <= 65536 .MAX_BLOCK_TOKENS.",
    ),
    "world_size": (
        {"world_size": W},
        {"world_size": W + 1},
        "world_size must be <= 256 .MAX_WORLD_SIZE.",
    ),
    "dcp_world_size": (
        {"world_size": W, "dcp_world_size": W, "group_block_sizes": (MAX_BLOCK_TOKENS,)},
        {"world_size": W, "dcp_world_size": W + 1, "group_block_sizes": (MAX_BLOCK_TOKENS,)},
        "dcp_world_size must be <= 256 .MAX_WORLD_SIZE.",
    ),
}


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_a_size_at_its_bound_is_taken_and_just_past_it_refused_naming_it(name: str) -> None:
    at, past, bound = BOUNDS[name]
    base: dict[str, object] = {"gpu_blocks": 8, "cpu_blocks": 4}
    OffloadConfig(**{**base, **at})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=bound) as refused:
        OffloadConfig(**{**base, **past})  # type: ignore[arg-type]
    assert len(str(refused.value)) < 400


@pytest.mark.parametrize(
    ("kwargs", "bound"),
    [
        ({"gpu_blocks": 10**12}, "MAX_BLOCKS"),
        ({"cpu_blocks": HUGE}, "cpu_blocks must be <= 4194304 .MAX_BLOCKS., got an int of"),
        ({"group_block_sizes": (16, 2**40)}, r"group_block_sizes\[1\] .* .MAX_BLOCK_TOKENS."),
        ({"world_size": 10**6}, "MAX_WORLD_SIZE"),
    ],
)
def test_a_size_far_past_its_bound_is_refused_in_one_short_line(
    kwargs: dict[str, object], bound: str
) -> None:
    with pytest.raises(ConfigError, match=bound) as refused:
        OffloadConfig(**{"gpu_blocks": 8, "cpu_blocks": 4, **kwargs})  # type: ignore[arg-type]
    assert len(str(refused.value)) < 400


def test_the_bounds_are_checked_before_anything_is_computed_from_the_sizes() -> None:
    """Sizes whose least common multiple would be huge, and a dcp size that would be checked
    against them, are refused by their bounds first."""
    with pytest.raises(ConfigError, match=r"group_block_sizes\[0\] .*MAX_BLOCK_TOKENS"):
        OffloadConfig(8, 4, (2**40 + 1, 2**41 + 1, 2**42 + 1), 1, dcp_world_size=3)
    with pytest.raises(ConfigError, match="dcp_world_size must be <= 256"):
        OffloadConfig(8, 4, (2**40 + 1,), 1, dcp_world_size=10**6)
    with pytest.raises(ConfigError, match=r"group_block_sizes\[0\] .* got an int of"):
        OffloadConfig(8, 4, (HUGE,), 1)


def test_a_config_error_naming_a_large_value_stays_one_short_line() -> None:
    cases: list[dict[str, object]] = [
        {"group_block_sizes": [16] * 10**5},
        {"group_block_sizes": (16,) * 10**5},
        {"sliding_windows": [None] * 10**5},
        {"mamba": (False,) * 10**5},
        {"lazy": "x" * 10**6},
        {"gpu_blocks": [1] * 10**6},
    ]
    for kwargs in cases:
        with pytest.raises(ConfigError) as refused:
            OffloadConfig(**{"gpu_blocks": 8, "cpu_blocks": 4, **kwargs})  # type: ignore[arg-type]
        assert len(str(refused.value)) < 400, str(refused.value)


class Shifting(tuple[T, ...]):
    """A tuple whose iteration gives its items the first time, and its first item in every
    place after."""

    passes = 0

    def __iter__(self) -> Iterator[T]:
        self.passes += 1
        items = list(super().__iter__())
        return iter(items if self.passes == 1 else items[:1] * len(items))


def test_a_per_group_tuple_is_taken_once_and_kept_as_checked() -> None:
    sizes: Shifting[int] = Shifting((8, 16))
    config = OffloadConfig(8, 4, sizes, 8)
    assert type(config.group_block_sizes) is tuple and config.group_block_sizes == (8, 16)
    assert config.scheduler_block_size == 16 and sizes.passes == 1
    windows: Shifting[int | None] = Shifting((None, 8))
    windowed = OffloadConfig(8, 4, (8, 8), 8, sliding_windows=windows)
    assert type(windowed.sliding_windows) is tuple and windowed.sliding_windows == (None, 8)
    assert windows.passes == 1


# -- the implementation's KV bytes (MAX_KV_BYTES) ------------------------------------------


def test_the_kv_bytes_counted_are_the_bytes_the_workers_allocate() -> None:
    config = OffloadConfig(6, 5, (4, 8), 4, world_size=2)
    layout = KVLayout(num_layers=3, bytes_per_token=2)
    with OffloadImpl(config, layout=layout, device="cpu", lockstep=True) as impl:
        allocated = sum(
            t.numel() * t.element_size()
            for w in impl.workers
            for t in (*w.gpu_blocks, *w.cpu_blocks)
        )
    assert kv_bytes(config, layout) == allocated == 2 * (6 + 5) * 3 * (4 + 8) * 2


def test_an_implementation_past_the_kv_bound_is_refused_before_anything_starts() -> None:
    """Just past MAX_KV_BYTES, with threads of copies: refused, saying the bytes it would
    need, with no thread started; at the bound the check passes (not built: 8 GiB)."""
    layout = KVLayout(num_layers=1, bytes_per_token=1)
    at = OffloadConfig(2**20, 2**20, (16,), world_size=MAX_WORLD_SIZE)
    assert kv_bytes(at, layout) == MAX_KV_BYTES
    require_kv_fits(at, layout)
    past = OffloadConfig(2**20 + 1, 2**20, (16,), world_size=MAX_WORLD_SIZE)
    threads = threading.active_count()
    need = kv_bytes(past, layout)
    with pytest.raises(ConfigError, match=f"would take {need} bytes .* .MAX_KV_BYTES.") as refused:
        OffloadImpl(past, layout=layout, device="cpu", lockstep=False)
    assert threading.active_count() == threads and len(str(refused.value)) < 400
    with pytest.raises(ConfigError, match="MAX_KV_BYTES"):
        OffloadImpl(OffloadConfig(MAX_BLOCKS, MAX_BLOCKS, (MAX_BLOCK_TOKENS,), 16), device="cpu")
    # without tensors (the scheduler alone) nothing is allocated: the pools' bounds suffice
    assert OffloadImpl(past, layout=None).workers == []


@pytest.mark.parametrize("field", ["num_layers", "bytes_per_token"])
def test_a_layout_of_no_bytes_is_refused(field: str) -> None:
    layout = KVLayout(**{field: 0})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=f"KVLayout.{field} must be a positive int, got 0"):
        OffloadImpl(OffloadConfig(4, 4), layout=layout, device="cpu")
