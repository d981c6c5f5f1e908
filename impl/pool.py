"""The block pool of the implementation: O(1) queue operations, the hash map, and
registration with vLLM's ``_insert_block_hash`` guards.

The free queue is an intrusive doubly linked list threaded through the blocks, with
sentinel head and tail, so that touch, free, eviction and allocation are O(1) per block
(the model uses a plain list). A key maps to an ordered dict of blocks.

Invariants kept (the same as the model's, see ``docs/spec.md``): POOL-QUEUE, POOL-MAP,
POOL-PRIMARY for every block the pool itself registers, POOL-NULL, POOL-FRESH.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Iterator, Sequence

from kvoffload.model.keys import BlockKey


class PoolBlock:
    """A block and its free-list links; ``prev``/``next`` are None when not queued."""

    __slots__ = ("block_id", "is_null", "key", "key_tokens", "next", "prev", "ref")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref = 0
        self.key: BlockKey | None = None
        self.key_tokens: int | None = None
        self.is_null = False
        self.prev: PoolBlock | None = None
        self.next: PoolBlock | None = None


class FreeList:
    """Doubly linked free queue; the head is taken first."""

    def __init__(self) -> None:
        self._head = PoolBlock(-1)
        self._tail = PoolBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.size = 0

    def _link(self, block: PoolBlock, after: PoolBlock) -> None:
        nxt = after.next
        assert nxt is not None
        block.prev, block.next = after, nxt
        after.next = block
        nxt.prev = block
        self.size += 1

    def push_back(self, block: PoolBlock) -> None:
        prev = self._tail.prev
        assert prev is not None
        self._link(block, prev)

    def push_front_all(self, blocks: Sequence[PoolBlock]) -> None:
        """Insert ``blocks`` before the head, keeping their order."""
        anchor = self._head
        for block in blocks:
            self._link(block, anchor)
            anchor = block

    def unlink(self, block: PoolBlock) -> None:
        prev, nxt = block.prev, block.next
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next, nxt.prev = nxt, prev
        block.prev = block.next = None
        self.size -= 1

    def pop_front(self) -> PoolBlock:
        first = self._head.next
        if first is None or first is self._tail:
            raise ValueError("the free queue is empty")
        self.unlink(first)
        return first

    def __iter__(self) -> Iterator[PoolBlock]:
        node = self._head.next
        while node is not None and node is not self._tail:
            yield node
            node = node.next


class Pool:
    """A block pool with prefix caching. Block 0 is the null block."""

    def __init__(self, num_blocks: int, name: str) -> None:
        self.name = name
        self.blocks = [PoolBlock(i) for i in range(num_blocks)]
        self.free = FreeList()
        for block in self.blocks[1:]:
            self.free.push_back(block)
        self.null = self.blocks[0]
        self.null.is_null = True
        self.index: dict[BlockKey, dict[int, PoolBlock]] = {}
        self.extra_keys: dict[int, set[BlockKey]] = {}

    @property
    def num_free(self) -> int:
        return self.free.size

    def find(self, key: BlockKey, skip: Container[int] = ()) -> PoolBlock | None:
        """The first block registered under ``key`` (by insertion), ``skip``'s ids aside."""
        holders = self.index.get(key)
        if not holders:
            return None
        if not skip:
            return next(iter(holders.values()))
        return next((b for i, b in holders.items() if i not in skip), None)

    def has(self, key: BlockKey, block_id: int) -> bool:
        holders = self.index.get(key)
        return holders is not None and block_id in holders

    def register(self, key: BlockKey, block: PoolBlock, tokens: int | None) -> None:
        """vLLM's ``_insert_block_hash``: a no-op when the block is stamped with ``key``
        (guard 1) or already mapped by it (guard 2); primary if unkeyed, else secondary."""
        if block.key == key or self.has(key, block.block_id):
            return
        if block.key is None:
            block.key, block.key_tokens = key, tokens
        else:
            self.extra_keys.setdefault(block.block_id, set()).add(key)
        self.index.setdefault(key, {})[block.block_id] = block

    def drop_keys(self, block: PoolBlock) -> None:
        """Unmap every key of ``block`` and clear its primary."""
        keys = self.extra_keys.pop(block.block_id, set())
        if block.key is not None:
            keys.add(block.key)
        for key in keys:
            holders = self.index.get(key)
            if holders is not None and block.block_id in holders:
                del holders[block.block_id]
                if not holders:
                    del self.index[key]
        block.key = block.key_tokens = None

    def allocate(self, n: int) -> list[PoolBlock]:
        if n > self.free.size:
            raise ValueError(f"{self.name} pool: cannot get {n} free blocks, {self.free.size} free")
        taken = [self.free.pop_front() for _ in range(n)]
        for block in taken:
            self.drop_keys(block)
            block.ref = 1
        return taken

    def pin(self, blocks: Iterable[PoolBlock]) -> None:
        for block in blocks:
            if block.ref == 0 and not block.is_null:
                self.free.unlink(block)
            block.ref += 1

    def release(self, blocks: Iterable[PoolBlock]) -> None:
        reuse_first: list[PoolBlock] = []
        for block in blocks:
            block.ref -= 1
            if block.ref == 0 and not block.is_null:
                if block.key is None:
                    reuse_first.append(block)
                else:
                    self.free.push_back(block)
        self.free.push_front_all(reuse_first)

    def clear_cache(self) -> bool:
        if self.free.size != len(self.blocks) - 1:
            return False
        self.index = {}
        self.extra_keys = {}
        for block in self.blocks:
            block.key = block.key_tokens = None
        return True

    def ids(self, blocks: Iterable[PoolBlock]) -> list[int]:
        return [b.block_id for b in blocks]

    def at(self, ids: Iterable[int]) -> list[PoolBlock]:
        return [self.blocks[i] for i in ids]
