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

_INT64 = (1 << 64) - 1  # vLLM's events carry a hash's low 64 bits as an int


class KeyMap:
    def __init__(self, hash_block_size: int) -> None:
        self.hash_block_size = hash_block_size
        self._to_model: dict[bytes, tuple[str, int]] = {}
        self._to_model_int: dict[int, tuple[str, int]] = {}
        self._to_vllm: dict[str, bytes] = {}

    def learn(self, digests: Sequence[str], hashes: Sequence[bytes]) -> None:
        """Pair vLLM's ``hashes`` of a token sequence with the model's ``digests`` of it."""
        for j, (digest, block_hash) in enumerate(zip(digests, hashes, strict=True)):
            pair = (digest, (j + 1) * self.hash_block_size)
            self._to_model.setdefault(bytes(block_hash), pair)
            self._to_model_int.setdefault(int.from_bytes(block_hash, "big") & _INT64, pair)
            self._to_vllm.setdefault(digest, bytes(block_hash))

    def external_digest(self, block_hash: bytes | int) -> str:
        """The model's digest for a hash as vLLM's kv-cache events carry it: the bytes, or
        (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``, the default) their last 64 bits as an
        int."""
        if isinstance(block_hash, int):
            return self._to_model_int[block_hash][0]
        return self._to_model[bytes(block_hash)][0]

    def external_key(self, block_hash: bytes | int, group: int) -> BlockKey:
        """The model's key for a hash of a kv-cache event and its group."""
        if isinstance(block_hash, int):
            digest, num_tokens = self._to_model_int[block_hash]
        else:
            digest, num_tokens = self._to_model[bytes(block_hash)]
        return BlockKey(group, num_tokens, digest)

    def key(self, vllm_key: bytes) -> BlockKey:
        """The model's key for a vLLM key (hash and group)."""
        digest, num_tokens = self._to_model[bytes(vllm_key[:-4])]
        return BlockKey(int.from_bytes(vllm_key[-4:], "big"), num_tokens, digest)

    def model_key(self, vllm_key: bytes | None) -> BlockKey | None:
        return None if vllm_key is None else self.key(vllm_key)

    def vllm_key(self, key: BlockKey) -> bytes:
        return self._to_vllm[key.digest] + key.group.to_bytes(4, "big")
