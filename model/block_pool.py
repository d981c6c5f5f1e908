"""The block pool with prefix caching, as vLLM's ``BlockPool`` (GPU and CPU alike).

State: a list of blocks (block 0 is the null block), a free queue of block ids whose head is
allocated and evicted first, the key map (a key may map to several blocks, in insertion
order) and the secondary keys of each block. A block's primary key lives on the block.

Invariants kept (checked by :mod:`kvoffload.model.invariants`):

- POOL-QUEUE: a non-null block is in the free queue iff its ref count is 0; the queue holds
  no duplicates and never the null block; no ref count is negative.
- POOL-MAP: every ``(key, id)`` in the map is the block's primary or one of its secondary
  keys; every secondary key is in the map under its block, the block has a primary, and a
  secondary is never the primary; no key maps to an empty list.
- POOL-PRIMARY: the primary key of a free hashed block is in the map under that block.
- POOL-NULL: the null block never holds a key.
- POOL-FRESH: a block returned by ``get_new_blocks`` has ref count 1, no primary, no
  secondary keys and no key in the map.

A pool that publishes kv-cache events (``events`` is a list) adds a ``removed`` event for
each key an eviction takes out of the map, and a ``cleared`` event when its prefix cache is
reset.

This is the readable reference: lists and dicts, linear scans, no optimisation.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass

from kvoffload.model.keys import BlockKey
from kvoffload.model.types import CLEARED, REMOVED, KVEvent


@dataclass
class Block:
    """One KV block: its id, holders, and primary key with the prefix length it covers."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockKey | None = None
    block_hash_num_tokens: int | None = None
    is_null: bool = False

    def set_block_hash(self, key: BlockKey, num_tokens: int | None) -> None:
        # vLLM's KVCacheBlock.set_block_hash asserts the block is unstamped.
        assert self.block_hash is None and self.block_hash_num_tokens is None, (
            f"block {self.block_id} already has primary {self.block_hash}"
        )
        self.block_hash = key
        self.block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self.block_hash = None
        self.block_hash_num_tokens = None


@dataclass(frozen=True)
class FreshRecord:
    """What a block looked like right after ``get_new_blocks`` returned it (for POOL-FRESH)."""

    block_id: int
    ref_cnt: int
    block_hash: BlockKey | None
    secondary: frozenset[BlockKey]
    mapped_keys: frozenset[BlockKey]


class BlockPool:
    """A pool of ``num_blocks`` blocks with prefix caching enabled."""

    def __init__(self, num_blocks: int, name: str) -> None:
        self.name = name
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: list[int] = list(range(num_blocks))
        # Block 0 is popped from the head once and never queued again.
        self.null_block = self.blocks[self.free_queue.pop(0)]
        self.null_block.is_null = True
        self.cached: dict[BlockKey, list[int]] = {}
        self.secondary: dict[int, set[BlockKey]] = {}
        # kvoffload's integrity contract (not vLLM's, whose scheduler reads no bytes): the
        # blocks whose bytes were damaged after they were registered. A block leaves the set
        # when it loses its keys (eviction, reset) or is handed out for new bytes.
        self.damaged: set[int] = set()
        self.allocation_log: list[FreshRecord] = []
        # The kv-cache events this pool publishes (None: it publishes none), drained by the
        # connector's take_events().
        self.events: list[KVEvent] | None = None

    # -- the key map (vLLM's BlockHashToBlockMap) ---------------------------------------

    def get_one_block(self, key: BlockKey, skip: Container[int] = ()) -> Block | None:
        """The first block cached under ``key``, passing over the ids in ``skip``."""
        ids = [i for i in self.cached.get(key, []) if i not in skip]
        return self.blocks[ids[0]] if ids else None

    def contain(self, key: BlockKey, block_id: int) -> bool:
        return block_id in self.cached.get(key, [])

    def _map_insert(self, key: BlockKey, block: Block) -> None:
        ids = self.cached.setdefault(key, [])
        if block.block_id not in ids:
            ids.append(block.block_id)

    def _map_pop(self, key: BlockKey, block_id: int) -> bool:
        ids = self.cached.get(key, [])
        if block_id not in ids:
            return False
        ids.remove(block_id)
        if not ids:
            del self.cached[key]
        return True

    # -- registration ---------------------------------------------------------------------

    def insert_block_hash(self, key: BlockKey, block: Block, num_tokens: int | None) -> None:
        """vLLM's ``_insert_block_hash``, early-return guards included."""
        # Guard 1: a block already stamped with this key is left alone. This is the trap of
        # vLLM #53498: a CPU block stamped at allocation never gets its map entry.
        if block.block_hash == key:
            return
        # Guard 2: the exact (key, block) pair is already registered.
        if self.contain(key, block.block_id):
            return
        if block.block_hash is None:
            block.set_block_hash(key, num_tokens)
        else:
            self.secondary.setdefault(block.block_id, set()).add(key)
        self._map_insert(key, block)

    def remove_cached_block_hashes(self, block: Block) -> list[BlockKey]:
        """Remove the block's primary and secondary keys from the map; return those removed."""
        candidates = [] if block.block_hash is None else [block.block_hash]
        candidates += sorted(self.secondary.pop(block.block_id, set()))
        if not candidates:
            return []
        removed = [key for key in candidates if self._map_pop(key, block.block_id)]
        block.reset_hash()
        return removed

    def keys_of(self, block_id: int) -> list[BlockKey]:
        """Every key the map holds for this block (a linear scan: the reference, not fast)."""
        return sorted(key for key, ids in self.cached.items() if block_id in ids)

    # -- allocation and ref counting ------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the queue head, evicting every key they hold."""
        if n > self.num_free_blocks:
            raise ValueError(
                f"{self.name} pool: cannot get {n} free blocks, {self.num_free_blocks} free"
            )
        taken = [self.blocks[i] for i in self.free_queue[:n]]
        del self.free_queue[:n]
        for block in taken:
            self.publish_removed(self.remove_cached_block_hashes(block))
            assert block.ref_cnt == 0, f"{self.name} block {block.block_id} was queued in use"
            block.ref_cnt = 1
            self.damaged.discard(block.block_id)
        for block in taken:
            self.allocation_log.append(
                FreshRecord(
                    block.block_id,
                    block.ref_cnt,
                    block.block_hash,
                    frozenset(self.secondary.get(block.block_id, set())),
                    frozenset(self.keys_of(block.block_id)),
                )
            )
        return taken

    def touch(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_queue.remove(block.block_id)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[Block], evict_first: bool = False) -> None:
        """Drop one ref of each block; hashless ones go to the head, hashed to the tail, or
        to the head too with ``evict_first`` (blocks another tier holds: vLLM 0.34.0)."""
        to_head: list[int] = []
        to_tail: list[int] = []
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                first = block.block_hash is None or evict_first
                (to_head if first else to_tail).append(block.block_id)
        self.free_queue[:0] = to_head
        self.free_queue.extend(to_tail)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Remove the keys of the given blocks, whatever their ref count; queue unchanged."""
        for block_id in block_ids:
            self.publish_removed(self.remove_cached_block_hashes(self.blocks[block_id]))
            self.damaged.discard(block_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every key, but only when nothing but the null block is in use."""
        if len(self.blocks) - self.num_free_blocks != 1:
            return False
        self.cached = {}
        self.secondary.clear()
        self.damaged.clear()
        for block in self.blocks:
            block.reset_hash()
        if self.events is not None:
            self.events.append(KVEvent(CLEARED))
        return True

    def publish_removed(self, keys: list[BlockKey]) -> None:
        """A ``removed`` event for each key no longer reachable (an eviction)."""
        if self.events is not None:
            self.events.extend(KVEvent(REMOVED, key) for key in keys)

    # -- caching of computed GPU blocks (vLLM's cache_full_blocks / cache_partial_block) ---

    def cache_full_blocks(
        self, blocks: Sequence[Block], keys: Sequence[BlockKey], start: int, end: int
    ) -> None:
        """Register ``keys[i]`` as the primary of ``blocks[i]`` for ``start <= i < end``."""
        for i in range(start, end):
            block, key = blocks[i], keys[i]
            if block.is_null:
                continue
            if block.block_hash is not None:
                # A partial-tail block that filled up: its partial keys make way.
                self.remove_cached_block_hashes(block)
            self.insert_block_hash(key, block, num_tokens=key.num_tokens)

    def cache_partial_block(self, block: Block, key: BlockKey) -> None:
        """Make ``block`` reachable from a fine-grained boundary inside it."""
        if block.is_null:
            return
        already = block.block_hash == key or self.contain(key, block.block_id)
        if (
            not already
            and block.block_hash is not None
            and block.block_hash_num_tokens is not None
            and block.block_hash_num_tokens < key.num_tokens
        ):
            self.remove_cached_block_hashes(block)
        self.insert_block_hash(key, block, num_tokens=key.num_tokens)


class AppendingBlockPool(BlockPool):
    """vLLM's ``BlockPool`` before 0.24.0: ``free_blocks`` appends every block that becomes
    free to the tail of the queue, in the order given, hashed or not (0.24.0 puts hashless
    blocks at the head, to be reused first)."""

    def free_blocks(self, ordered: Iterable[Block], evict_first: bool = False) -> None:
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                self.free_queue.append(block.block_id)
