"""Block pool semantics, as vLLM's BlockPool with caching."""

from __future__ import annotations

import pytest

from kvoffload.model.block_pool import BlockPool
from kvoffload.model.keys import BlockKey

K1 = BlockKey(0, 16, "a" * 16)
K2 = BlockKey(0, 32, "b" * 16)
S1 = BlockKey(0, 8, "c" * 16)


def test_null_block_is_never_queued_and_capacity_is_one_less() -> None:
    pool = BlockPool(5, "cpu")
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.free_queue == [1, 2, 3, 4]
    assert pool.num_free_blocks == 4


def test_get_new_blocks_takes_from_the_head_and_sets_ref_one() -> None:
    pool = BlockPool(5, "cpu")
    blocks = pool.get_new_blocks(2)
    assert [b.block_id for b in blocks] == [1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1]
    assert pool.free_queue == [3, 4]


def test_get_new_blocks_beyond_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(3, "cpu")
    with pytest.raises(ValueError, match="cannot get 3 free blocks"):
        pool.get_new_blocks(3)
    assert pool.free_queue == [1, 2]
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_free_puts_hashless_blocks_at_head_and_hashed_at_tail_in_order() -> None:
    pool = BlockPool(7, "gpu")
    a, b, c, d = pool.get_new_blocks(4)
    pool.insert_block_hash(K1, b, 16)
    pool.insert_block_hash(K2, d, 32)
    pool.free_blocks([a, b, c, d])
    # Hashless a, c go to the head in order; hashed b, d go to the tail in order.
    assert pool.free_queue == [a.block_id, c.block_id, 5, 6, b.block_id, d.block_id]


def test_touch_removes_a_free_block_from_the_queue_and_free_returns_it() -> None:
    pool = BlockPool(4, "gpu")
    (a,) = pool.get_new_blocks(1)
    pool.insert_block_hash(K1, a, 16)
    pool.free_blocks([a])
    assert a.block_id in pool.free_queue
    pool.touch([a])
    pool.touch([a])
    assert a.ref_cnt == 2 and a.block_id not in pool.free_queue
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and a.block_id not in pool.free_queue
    pool.free_blocks([a])
    assert pool.free_queue[-1] == a.block_id


def test_touch_and_free_of_the_null_block_never_queue_it() -> None:
    pool = BlockPool(3, "gpu")
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert 0 not in pool.free_queue


def test_allocation_evicts_primary_and_secondary_keys() -> None:
    pool = BlockPool(2, "cpu")
    (a,) = pool.get_new_blocks(1)
    pool.insert_block_hash(K1, a, 16)
    pool.insert_block_hash(S1, a, None)
    assert pool.secondary[a.block_id] == {S1}
    pool.free_blocks([a])
    (again,) = pool.get_new_blocks(1)
    assert again is a
    assert a.block_hash is None and a.block_hash_num_tokens is None
    assert pool.cached == {} and pool.secondary == {}
    assert pool.allocation_log[-1].mapped_keys == frozenset()


def test_one_key_may_map_to_several_blocks_and_the_first_is_returned() -> None:
    pool = BlockPool(4, "cpu")
    a, b = pool.get_new_blocks(2)
    pool.insert_block_hash(K1, a, 16)
    pool.insert_block_hash(K1, b, 16)
    assert pool.cached[K1] == [a.block_id, b.block_id]
    assert pool.get_one_block(K1) is a
    pool.remove_cached_block_hashes(a)
    assert pool.get_one_block(K1) is b


def test_stamped_primary_then_insert_is_a_no_op_guard_one() -> None:
    """vLLM #53498: a block stamped with K is never mapped by insert_block_hash(K)."""
    pool = BlockPool(3, "cpu")
    (a,) = pool.get_new_blocks(1)
    a.block_hash = K1  # stamped directly, as vLLM <= 0.29.0 did at allocation
    pool.insert_block_hash(K1, a, 16)
    pool.insert_block_hash(S1, a, None)
    assert pool.get_one_block(K1) is None  # the phantom primary
    assert pool.get_one_block(S1) is a  # the secondary still lands
    assert a.block_hash_num_tokens is None


def test_reset_hash_then_insert_maps_every_key() -> None:
    pool = BlockPool(3, "cpu")
    (a,) = pool.get_new_blocks(1)
    a.block_hash = K1
    a.reset_hash()
    pool.insert_block_hash(K1, a, 16)
    pool.insert_block_hash(S1, a, None)
    assert pool.get_one_block(K1) is a and pool.get_one_block(S1) is a
    assert a.block_hash == K1 and a.block_hash_num_tokens == 16
    assert pool.secondary[a.block_id] == {S1}


def test_secondary_inserted_first_on_a_hashless_block_becomes_the_primary() -> None:
    pool = BlockPool(3, "cpu")
    (a,) = pool.get_new_blocks(1)
    pool.insert_block_hash(S1, a, None)
    pool.insert_block_hash(K1, a, 16)
    assert a.block_hash == S1
    assert pool.secondary[a.block_id] == {K1}


def test_guard_two_makes_a_repeated_insert_idempotent() -> None:
    pool = BlockPool(3, "cpu")
    (a,) = pool.get_new_blocks(1)
    pool.insert_block_hash(K1, a, 16)
    pool.insert_block_hash(S1, a, None)
    pool.insert_block_hash(S1, a, None)
    assert pool.cached[S1] == [a.block_id]


def test_reset_prefix_cache_needs_an_idle_pool_then_forgets_every_key() -> None:
    pool = BlockPool(4, "cpu")
    a, b = pool.get_new_blocks(2)
    pool.insert_block_hash(K1, a, 16)
    pool.insert_block_hash(S1, a, None)
    pool.free_blocks([a])
    order = list(pool.free_queue)
    assert pool.reset_prefix_cache() is False
    assert pool.get_one_block(K1) is a
    pool.free_blocks([b])
    order = list(pool.free_queue)
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and pool.secondary == {} and a.block_hash is None
    assert pool.free_queue == order


def test_evict_blocks_removes_keys_even_when_in_use() -> None:
    pool = BlockPool(3, "gpu")
    (a,) = pool.get_new_blocks(1)
    pool.insert_block_hash(K1, a, 16)
    pool.evict_blocks([a.block_id])
    assert a.ref_cnt == 1 and a.block_hash is None and pool.cached == {}


def test_partial_block_is_promoted_when_the_block_fills() -> None:
    pool = BlockPool(3, "gpu")
    (a,) = pool.get_new_blocks(1)
    pool.cache_partial_block(a, S1)
    assert a.block_hash == S1  # a partial block: the boundary key is its primary
    pool.cache_full_blocks([a], [K1], 0, 1)
    assert a.block_hash == K1 and pool.get_one_block(S1) is None
    pool.cache_partial_block(a, S1)
    assert pool.secondary[a.block_id] == {S1}  # once full, the boundary key is secondary
