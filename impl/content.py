"""The deterministic content function, vectorized: the KV bytes of every token, layer and
group, as :mod:`kvoffload.model.content` states them (rank 0; the implementation has no
tensor-parallel ranks), computed with torch for a whole block or sequence at once.

Token ``t`` of a sequence gets a 63-bit seed chained over the tokens before it, so a seed
names a whole prefix; the ``bytes_per_token`` bytes of token ``t`` in (group, layer) are a
fixed function of that seed and of (group, layer, byte offset). A full block's bytes are
therefore a function of (group, layer, block key) alone: the same prefix always has the
same KV, as with a real model, and any misplaced or stale byte shows.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence

import torch

from kvoffload.model.content import INITIAL_SEED, token_seeds

__all__ = [
    "INITIAL_SEED",
    "checksum",
    "checksums",
    "layer_bytes",
    "tensor_bytes",
    "token_bytes",
    "token_seeds",
]


def layer_bytes(
    seeds: Sequence[int], group: int, num_layers: int, bytes_per_token: int
) -> torch.Tensor:
    """The KV bytes of the tokens with these seeds in every layer of ``group``, as
    ``uint8[num_layers, len(seeds) * bytes_per_token]``; row ``l`` is
    ``token_bytes(seeds, group, l, bytes_per_token)``."""
    s = torch.tensor(list(seeds), dtype=torch.int64).view(1, -1, 1)
    mixed = s * 0x9E3779B1 + _offset_weights(group, num_layers, bytes_per_token)
    return ((mixed ^ (mixed >> 29)) & 0xFF).to(torch.uint8).reshape(num_layers, -1)


@functools.lru_cache(maxsize=256)
def _offset_weights(group: int, num_layers: int, bytes_per_token: int) -> torch.Tensor:
    """The seed-independent term of every byte, ``int64[num_layers, 1, bytes_per_token]``:
    built once per group and layout, since every write and every check asks for it."""
    offsets = torch.arange(1, bytes_per_token + 1, dtype=torch.int64).view(1, 1, -1)
    layers = torch.arange(num_layers, dtype=torch.int64).view(-1, 1, 1)
    return offsets * (0x85EBCA77 + 131 * group + 7919 * layers)


def token_bytes(seeds: Sequence[int], group: int, layer: int, bytes_per_token: int) -> torch.Tensor:
    """The KV bytes of the tokens with these seeds, as ``uint8[len(seeds) * bytes_per_token]``."""
    return layer_bytes(seeds, group, layer + 1, bytes_per_token)[layer]


def checksums(blocks: torch.Tensor) -> list[int]:
    """:func:`checksum` of each row of ``blocks`` (``[rows, bytes]``), in one pass."""
    values = blocks.to(torch.int64)
    weights = torch.arange(1, values.shape[1] + 1, dtype=torch.int64, device=values.device)
    return [int(v) for v in ((values * weights) % 2_147_483_647).sum(dim=1).tolist()]


def checksum(block: torch.Tensor) -> int:
    """A position-weighted checksum of one block's bytes."""
    return checksums(block.reshape(1, -1))[0]


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes of ``tensor`` in memory order (row-major), copied to the host first when it
    lives on a device: one copy of the raw memory, not a conversion per element."""
    host = tensor.cpu().contiguous()
    if host.numel() == 0:
        return b""
    return ctypes.string_at(host.data_ptr(), host.numel() * host.element_size())
