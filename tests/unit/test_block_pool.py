"""BlockPool: block 0 reserved, ref counts, and least-recently-freed eviction of cached blocks."""

import pytest

from llmq.worker.engine.block_pool import NULL_BLOCK_ID, BlockPool


def test_block_zero_is_never_handed_out():
    # Given a pool of 5 blocks
    pool = BlockPool(5)
    # When every free block is taken
    blocks = pool.get_new_blocks(pool.get_num_free_blocks())
    # Then there were 4 of them, and block 0 (the runner's padding block) is not among them
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert NULL_BLOCK_ID not in [b.block_id for b in blocks]
    assert pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_freed_blocks_are_reused_least_recently_freed_first():
    # Given two blocks freed one after the other, both cached
    pool = BlockPool(3)
    first, second = pool.get_new_blocks(2)
    pool.cache_block(first, 111)
    pool.cache_block(second, 222)
    pool.free_blocks([first, second])
    # When one block is needed
    (taken,) = pool.get_new_blocks(1)
    # Then the one freed first is evicted: its hash is forgotten, the other is still cached
    assert taken is first
    assert pool.get_cached_block(111) is None
    assert pool.get_cached_block(222) is second


def test_a_cached_free_block_hit_again_leaves_the_free_queue():
    # Given three cached free blocks
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    for i, block in enumerate(blocks):
        pool.cache_block(block, 1000 + i)
    pool.free_blocks(blocks)
    # When the middle one is hit by a new request
    pool.touch([pool.get_cached_block(1001)])
    # Then it is in use, and allocation takes the other two, never it
    assert blocks[1].ref_cnt == 1
    assert pool.get_num_free_blocks() == 2
    assert pool.get_new_blocks(2) == [blocks[0], blocks[2]]
    assert pool.get_cached_block(1001) is blocks[1]


def test_shared_block_is_free_only_when_its_last_holder_lets_go():
    # Given a block held by two requests
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    # When one lets go, it stays in use; when the other does, it is free
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 0
    pool.free_blocks([block])
    assert pool.get_num_free_blocks() == 1
    # Then a third free is a bug, caught
    with pytest.raises(AssertionError):
        pool.free_blocks([block])


def test_a_hash_is_cached_once():
    # Given two blocks with the same content (computed at the same time by two requests)
    pool = BlockPool(3)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, 7)
    pool.cache_block(b, 7)
    # Then the first one is the cached copy and the second stays plain
    assert pool.get_cached_block(7) is a
    assert b.block_hash is None


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_block(block, 5)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([block])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(5) is None
