"""The content function: the KV bytes every token holds, in every rank, group and layer.

The specification of what a KV block must hold, in plain Python (no torch): the readable
reference beside the implementation's vectorized version (:mod:`kvoffload.impl.content`, held
equal to this by ``tests/test_content.py``), and the function by which the bytes of vLLM's own
worker are judged (:mod:`kvoffload.vllm_target.worker`).

Token ``t`` of a sequence gets a 63-bit seed chained over the tokens before it, so a seed
names a whole prefix (:func:`token_seeds`). Byte ``j`` (from 0) of that token's KV in (rank,
group, layer) mixes the seed with a weight of (rank, group, layer, ``j``):
``m = seed * 0x9E3779B1 + (j + 1) * (0x85EBCA77 + 131 * group + 7919 * layer + 104729 * rank)``
in 64-bit two's complement, and the byte is ``(m ^ (m >> 29)) & 0xFF`` (an arithmetic shift).
A full block's bytes are therefore a function of (rank, group, layer, block key) alone: the
same prefix always has the same KV, as with a real model, while a block of another prefix,
layer, group or tensor-parallel rank (each rank holds its own heads) differs, so that any
misplaced or stale byte shows.

Invariants kept: ``token_seeds(a + b)[len(a):] == token_seeds(b, len(a), token_seeds(a)[-1])``
(a prefix's seeds never change as the sequence grows); rank 0 is the implementation's
content, which has no ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

INITIAL_SEED = 0x6A09E667
_MASK = (1 << 63) - 1
_MUL = 0x100000001B3
_SEED_WEIGHT = 0x9E3779B1


def token_seeds(tokens: Sequence[int], start: int = 0, seed: int = INITIAL_SEED) -> list[int]:
    """Chained seeds of ``tokens`` at positions ``start...``, continuing from ``seed`` (the
    seed of the token before ``start``); ``seeds[i]`` covers the prefix up to that token."""
    seeds = []
    h = seed
    for i, token in enumerate(tokens):
        h = ((h ^ (token + 1)) * _MUL + i + start) & _MASK
        seeds.append(h)
    return seeds


def _int64(value: int) -> int:
    """``value`` wrapped to a signed 64-bit integer, as a machine word holds it."""
    return ((value + (1 << 63)) % (1 << 64)) - (1 << 63)


def token_kv(seed: int, group: int, layer: int, bytes_per_token: int, rank: int = 0) -> bytes:
    """The ``bytes_per_token`` KV bytes of the token with ``seed`` in (rank, group, layer)."""
    weight = 0x85EBCA77 + 131 * group + 7919 * layer + 104729 * rank
    out = bytearray(bytes_per_token)
    for j in range(bytes_per_token):
        m = _int64(seed * _SEED_WEIGHT + (j + 1) * weight)
        out[j] = (m ^ (m >> 29)) & 0xFF
    return bytes(out)


def kv_bytes(
    seeds: Sequence[int], group: int, layer: int, bytes_per_token: int, rank: int = 0
) -> bytes:
    """The KV bytes of the tokens with these seeds, one token after the other."""
    return b"".join(token_kv(s, group, layer, bytes_per_token, rank) for s in seeds)
