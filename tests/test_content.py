"""The content function: the specification's plain version (kvoffload.model.content) and the
implementation's vectorized one (kvoffload.impl.content) give the same bytes, and the bytes
tell apart what a misplaced copy would mix up (another prefix, layer, group or rank)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvoffload.impl.content import layer_bytes, tensor_bytes
from kvoffload.model.content import kv_bytes, token_kv, token_seeds

TOKENS = st.lists(st.integers(0, 50_000), min_size=1, max_size=12)


@given(
    tokens=TOKENS,
    group=st.integers(0, 3),
    layers=st.integers(1, 3),
    bytes_per_token=st.integers(1, 16),
)
def test_the_vectorized_content_is_the_specifications(
    tokens: list[int], group: int, layers: int, bytes_per_token: int
) -> None:
    seeds = token_seeds(tokens)
    fast = layer_bytes(seeds, group, layers, bytes_per_token)
    for layer in range(layers):
        assert tensor_bytes(fast[layer]) == kv_bytes(seeds, group, layer, bytes_per_token)


@given(a=TOKENS, b=TOKENS)
def test_a_prefixs_seeds_never_change_as_the_sequence_grows(a: list[int], b: list[int]) -> None:
    assert token_seeds(a + b)[len(a) :] == token_seeds(b, len(a), token_seeds(a)[-1])


def test_the_bytes_tell_apart_prefix_layer_group_and_rank() -> None:
    seed = token_seeds([1, 2, 3])[-1]
    other = token_seeds([9, 2, 3])[-1]
    base = token_kv(seed, 0, 0, 16)
    variants = [
        token_kv(other, 0, 0, 16),
        token_kv(seed, 0, 1, 16),
        token_kv(seed, 1, 0, 16),
        token_kv(seed, 0, 0, 16, rank=1),
    ]
    assert len(base) == 16 and all(v != base for v in variants)
    assert len(set(variants)) == len(variants)
