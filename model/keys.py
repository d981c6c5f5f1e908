"""Block keys: chained hashes of token ids, one key space per KV group.

A request's tokens are cut into hash blocks of ``hash_block_size`` tokens; hash block ``j``
gets ``digest_j = H(digest_{j-1}, tokens of block j)``, so a digest names a whole prefix.
Only full hash blocks are hashed. A key is a digest tagged with its KV group (vLLM's
``BlockHashWithGroupId``) and, for readability, with the prefix length it covers.

A group whose block size is ``m * hash_block_size`` uses, for its block ``i``, the digest of
hash block ``(i + 1) * m - 1``: the last fine-grained digest inside the block (vLLM's
``resolve_block_hashes``). So the key of a full block equals the fine-grained key at the
block's end, and a fine-grained key at a boundary inside a block is a different key.

Invariants: equal prefixes give equal keys in the same group; different groups never share
a key; the key of block ``i`` covers ``(i + 1) * block_size`` tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

# Digest of the empty prefix; every chain starts here.
ROOT_DIGEST = "0" * 16


class BlockKey(NamedTuple):
    """A prefix-cache key: ``group``'s key for the prefix of ``num_tokens`` tokens.

    A named tuple, so that hashing, comparing and ordering keys (every pool lookup, every
    sorted view) run as the tuple's own C code (issue 15: the lockstep's cost per call)."""

    group: int
    num_tokens: int
    digest: str

    def __str__(self) -> str:
        return f"g{self.group}:{self.digest[:6]}@{self.num_tokens}"


def chain_digest(parent: str, tokens: Sequence[int]) -> str:
    """The digest of a hash block with the given parent digest and token ids."""
    payload = parent + ":" + ",".join(str(t) for t in tokens)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def extend_digests(digests: list[str], tokens: Sequence[int], hash_block_size: int) -> None:
    """Append the digests of every hash block of ``tokens`` that is full and not hashed yet."""
    while (len(digests) + 1) * hash_block_size <= len(tokens):
        j = len(digests)
        parent = digests[-1] if digests else ROOT_DIGEST
        digests.append(
            chain_digest(parent, tokens[j * hash_block_size : (j + 1) * hash_block_size])
        )


def prefix_digests(tokens: Sequence[int], hash_block_size: int) -> list[str]:
    """The digests of every full hash block of ``tokens``.

    pre: hash_block_size > 0
    post: len(__return__) == len(tokens) // hash_block_size
    post: all(len(d) == 16 for d in __return__)
    """
    digests: list[str] = []
    extend_digests(digests, tokens, hash_block_size)
    return digests


def fine_key(digests: Sequence[str], j: int, group: int, hash_block_size: int) -> BlockKey:
    """The fine-grained key of hash block ``j`` in ``group``."""
    return BlockKey(group, (j + 1) * hash_block_size, digests[j])


def block_keys(
    digests: Sequence[str], group: int, block_size: int, hash_block_size: int
) -> list[BlockKey]:
    """The key of every full block of ``group`` that ``digests`` covers.

    pre: hash_block_size > 0 and block_size > 0 and block_size % hash_block_size == 0
    post: len(__return__) == len(digests) // (block_size // hash_block_size)
    post: all(key.group == group for key in __return__)
    post: all(key.num_tokens == (i + 1) * block_size for i, key in enumerate(__return__))
    """
    m = block_size // hash_block_size
    return [
        BlockKey(group, (i + 1) * block_size, digests[(i + 1) * m - 1])
        for i in range(len(digests) // m)
    ]
