"""vLLM's block hashes and the model's keys, both ways.

vLLM hash ``j`` of a token sequence and the model's digest ``j`` name the same prefix
(``(j + 1) * hash_block_size`` tokens): both chain over whole hash blocks, and vLLM's key of a
bigger block is the hash of its last hash block, as the model's is. So every sequence hashed by
both sides adds pairs, and a vLLM key with its group (``hash + group.to_bytes(4, "big")``,
vLLM's ``BlockHashWithGroupId``) names a model :class:`~kvoffload.model.keys.BlockKey`.

Invariant: a pair, once learned, never changes (a hash names one prefix).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.model.keys import BlockKey


class KeyMap:
    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self._to_model: dict[bytes, tuple[str, int]] = {}
        self._to_vllm: dict[str, bytes] = {}

    def learn(self, digests: Sequence[str], hashes: Sequence[bytes]) -> None:
        """Pair vLLM's ``hashes`` of a token sequence with the model's ``digests`` of it."""
        for j, (digest, block_hash) in enumerate(zip(digests, hashes, strict=True)):
            self._to_model.setdefault(bytes(block_hash), (digest, (j + 1) * self.hash_block_size))
            self._to_vllm.setdefault(digest, bytes(block_hash))

    def key(self, vllm_key: bytes) -> BlockKey:
        """The model's key for a vLLM key (hash and group)."""
        digest, num_tokens = self._to_model[bytes(vllm_key[:-4])]
        return BlockKey(int.from_bytes(vllm_key[-4:], "big"), num_tokens, digest)

    def model_key(self, vllm_key: bytes | None) -> BlockKey | None:
        return None if vllm_key is None else self.key(vllm_key)

    def vllm_key(self, key: BlockKey) -> bytes:
        return self._to_vllm[key.digest] + key.group.to_bytes(4, "big")
