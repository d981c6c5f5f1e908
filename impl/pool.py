"""The block pool of the implementation, in array state: block ids are ints, ref counts,
keys and key lengths are lists indexed by block id, the free queue is a linked list of
ids in two int lists, and every operation takes a batch of ids.

Keys are strings (:func:`make_key`), whose hash Python caches, so an index lookup costs a
string comparison; :func:`block_key` turns one back into the shared
:class:`~kvoffload.model.keys.BlockKey` for snapshots and messages. The free queue
(:class:`FreeQueue`) is a linked list held in two int lists: touch, free, evict and allocate
are O(1) per block, as vLLM's ``FreeKVCacheBlockQueue``, without a Python object per link,
and a batch is taken or linked in one pass. The key
index maps a key to its first holder; keys held by several blocks keep every holder, in
registration order, in ``dups`` (as vLLM 0.34's ``_dup_ids``).

Invariants kept (the same as the model's, see ``docs/spec.md``): POOL-QUEUE (a block is in
the free queue exactly when its ref count is 0, the null block never), POOL-MAP (the index
and ``dups`` hold exactly the keys registered on each block), POOL-PRIMARY for every block
the pool itself registers, POOL-NULL (block 0 never takes a key), POOL-FRESH (an allocated
block holds no key).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Container, Iterable, Iterator, Sequence

from kvoffload.model.keys import BlockKey
from kvoffload.model.types import CLEARED, REMOVED, KVEvent

NULL = 0  # the null block's id in every pool


def make_key(group: int, num_tokens: int, digest: str) -> str:
    """The implementation's key for ``BlockKey(group, num_tokens, digest)``."""
    return f"{group}:{num_tokens}:{digest}"


@functools.lru_cache(maxsize=1 << 16)
def block_key(key: str) -> BlockKey:
    """The shared key a key string stands for."""
    group, num_tokens, digest = key.split(":", 2)
    return BlockKey(int(group), int(num_tokens), digest)


class FreeQueue:
    """The free queue: a doubly linked list of block ids held in two int lists (``nxt`` and
    ``prv``, indexed by block id, with sentinel slots for the head and the tail), so that a
    batch is taken from the head or linked at either end in one pass over plain lists, and
    a block leaves the middle in O(1). Which blocks are queued is the pool's business (those
    whose ref count is 0, the null block aside): the queue keeps no flags of its own."""

    def __init__(self, num_blocks: int) -> None:
        self.head, self.tail = num_blocks, num_blocks + 1
        # blocks 1 .. num_blocks - 1 in order, between the head and the tail
        order = [self.head, *range(1, num_blocks), self.tail]
        self.nxt = [-1] * (num_blocks + 2)
        self.prv = [-1] * (num_blocks + 2)
        for a, b in itertools.pairwise(order):
            self.nxt[a] = b
            self.prv[b] = a
        self.size = num_blocks - 1

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        return self.after(None)

    def after(self, block: int | None) -> Iterator[int]:
        """The queue from the block after ``block`` (a queued block), or from the front."""
        nxt = self.nxt
        b = nxt[self.head if block is None else block]
        while b != self.tail:
            yield b
            b = nxt[b]

    def take(self, n: int) -> list[int]:
        """The first ``n`` blocks, unlinked."""
        nxt = self.nxt
        taken: list[int] = []
        append = taken.append
        b = nxt[self.head]
        for _ in range(n):
            append(b)
            b = nxt[b]
        nxt[self.head] = b
        self.prv[b] = self.head
        self.size -= n
        return taken

    def remove(self, block: int) -> None:
        before, after = self.prv[block], self.nxt[block]
        self.nxt[before] = after
        self.prv[after] = before
        self.size -= 1

    def append(self, blocks: Sequence[int]) -> None:
        """Link ``blocks`` at the tail, in order."""
        self._link(self.prv[self.tail], blocks, self.tail)

    def prepend(self, blocks: Sequence[int]) -> None:
        """Link ``blocks`` at the head, in order (the first is taken first)."""
        self._link(self.head, blocks, self.nxt[self.head])

    def _link(self, before: int, blocks: Sequence[int], after: int) -> None:
        nxt, prv = self.nxt, self.prv
        for b in blocks:
            nxt[before] = b
            prv[b] = before
            before = b
        nxt[before] = after
        prv[after] = before
        self.size += len(blocks)


class Pool:
    """A block pool with prefix caching. Block 0 is the null block."""

    def __init__(self, num_blocks: int, name: str) -> None:
        self.name = name
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.key: list[str | None] = [None] * num_blocks  # the primary key
        self.key_tokens: list[int | None] = [None] * num_blocks
        self.free = FreeQueue(num_blocks)
        self.index: dict[str, int] = {}  # key -> its first holder
        self.dups: dict[str, dict[int, None]] = {}  # key -> every holder, when several
        self.extra_keys: dict[int, set[str]] = {}  # block -> its secondary keys
        self.events: list[KVEvent] | None = None  # kv-cache events, when it publishes them

    @property
    def num_free(self) -> int:
        return len(self.free)

    # -- the key index --------------------------------------------------------------------

    def find(self, key: str, skip: Container[int] = ()) -> int | None:
        """The first block registered under ``key`` (by registration), ``skip``'s aside."""
        if not skip or key not in self.dups:
            found = self.index.get(key)
            return None if found is None or found in skip else found
        return next((b for b in self.dups[key] if b not in skip), None)

    def holders(self, key: str) -> tuple[int, ...]:
        """Every block registered under ``key``, in registration order."""
        several = self.dups.get(key)
        if several is not None:
            return tuple(several)
        found = self.index.get(key)
        return () if found is None else (found,)

    def has(self, key: str, block: int) -> bool:
        several = self.dups.get(key)
        if several is not None:
            return block in several
        return self.index.get(key) == block

    def register(self, key: str, block: int, tokens: int | None) -> None:
        """vLLM's ``_insert_block_hash``: a no-op when the block is stamped with ``key``
        (guard 1) or already mapped by it (guard 2); primary if unkeyed, else secondary."""
        own = self.key[block]
        if own is None and block not in self.extra_keys:  # a block with no key at all
            self.key[block] = key
            self.key_tokens[block] = tokens
            if key not in self.index:
                self.index[key] = block
                return
        elif own == key or self.has(key, block):
            return
        elif own is None:
            self.key[block] = key
            self.key_tokens[block] = tokens
        else:
            self.extra_keys.setdefault(block, set()).add(key)
        self._map(key, block)

    def register_all(
        self, keys: Sequence[str | None], blocks: Sequence[int], tokens: Sequence[int | None]
    ) -> None:
        """:meth:`register` of ``keys[i]`` on ``blocks[i]`` with ``tokens[i]``, in order; a
        block with no key yet taking a key no block holds (a store into fresh CPU blocks,
        the common case) without the call."""
        own, own_tokens, index, extra = self.key, self.key_tokens, self.index, self.extra_keys
        for key, block, count in zip(keys, blocks, tokens, strict=True):
            assert key is not None, f"{self.name} pool: block {block} registered without a key"
            if own[block] is None and key not in index and not (extra and block in extra):
                own[block] = key
                own_tokens[block] = count
                index[key] = block
            else:
                self.register(key, block, count)

    def register_full(
        self, keys: Sequence[str], blocks: Sequence[int], first_tokens: int, size: int
    ) -> None:
        """A request's consecutive full blocks: ``keys[i]`` becomes the primary of
        ``blocks[i]``, covering ``first_tokens + i * size`` tokens; a block still holding
        keys (a partial block's prompt-boundary key) drops them first. The null block (a
        sliding window's skipped position) takes no key."""
        own, own_tokens, index, extra = self.key, self.key_tokens, self.index, self.extra_keys
        tokens = first_tokens - size
        for key, block in zip(keys, blocks, strict=True):
            tokens += size
            if block == NULL:
                continue
            if own[block] is not None or (extra and block in extra):
                self.drop_keys(block)
            own[block] = key
            own_tokens[block] = tokens
            if key in index:
                self._map(key, block)
            else:
                index[key] = block

    def _map(self, key: str, block: int) -> None:
        first = self.index.get(key)
        if first is None:
            self.index[key] = block
        else:
            self.dups.setdefault(key, {first: None})[block] = None

    def _unmap(self, key: str, block: int) -> None:
        several = self.dups.get(key)
        if several is None:
            if self.index.get(key) == block:
                del self.index[key]
            return
        several.pop(block, None)
        if len(several) == 1:
            del self.dups[key]
        self.index[key] = next(iter(several))

    def drop_keys(self, block: int) -> None:
        """Unmap every key of ``block`` and clear its primary; publish a ``removed`` event
        for each key it unmapped, when the pool publishes events."""
        keys = self.extra_keys.pop(block, set())
        primary = self.key[block]
        if primary is not None:
            keys.add(primary)
        events = self.events
        for key in keys:
            if events is not None and self.has(key, block):
                events.append(KVEvent(REMOVED, block_key(key)))
            self._unmap(key, block)
        self.key[block] = self.key_tokens[block] = None

    # -- the free queue -------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks from the head of the free queue, their keys dropped, ref count 1."""
        if n > len(self.free):
            raise ValueError(f"{self.name} pool: cannot get {n} free blocks, {len(self.free)} free")
        taken = self.free.take(n)
        key, ref, extra = self.key, self.ref, self.extra_keys
        for block in taken:
            ref[block] = 1
            if key[block] is not None or (extra and block in extra):
                self.drop_keys(block)  # an evicted block leaves the index
        return taken

    def pin(self, blocks: Iterable[int]) -> None:
        """Take one ref of each block; a free block leaves the free queue (vLLM's touch)."""
        ref = self.ref
        nxt, prv = self.free.nxt, self.free.prv
        unlinked = 0
        for block in blocks:
            count = ref[block]
            if count == 0 and block != NULL:
                before, after = prv[block], nxt[block]  # FreeQueue.remove, inlined
                nxt[before] = after
                prv[after] = before
                unlinked += 1
            ref[block] = count + 1
        self.free.size -= unlinked

    def release(self, blocks: Iterable[int], evict_first: bool = False) -> None:
        """Drop one ref of each block; a block whose count reaches 0 goes to the back of the
        free queue, or to the front, in order, when it holds no key (reused first) or with
        ``evict_first`` (another tier holds its data)."""
        ref, key = self.ref, self.key
        back: list[int] = []
        reuse_first: list[int] = []
        for block in blocks:
            count = ref[block] - 1
            ref[block] = count
            if count == 0 and block != NULL:
                first = evict_first or key[block] is None
                (reuse_first if first else back).append(block)
        if back:
            self.free.append(back)
        if reuse_first:
            self.free.prepend(reuse_first)

    def clear_cache(self) -> bool:
        if len(self.free) != self.num_blocks - 1:
            return False
        self.index = {}
        self.dups = {}
        self.extra_keys = {}
        self.key = [None] * self.num_blocks
        self.key_tokens = [None] * self.num_blocks
        if self.events is not None:
            self.events.append(KVEvent(CLEARED))
        return True

    # -- reading --------------------------------------------------------------------------

    def keyed(self) -> list[int]:
        """The blocks holding a primary key, in id order."""
        return [b for b, key in enumerate(self.key) if key is not None]
