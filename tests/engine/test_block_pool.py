"""Block pool on tiny shapes: reference counts, prefix sharing and exact LRU eviction order."""

from __future__ import annotations

import pytest

from omnivox.engine.block_pool import BlockPool, hash_block


def test_allocate_release_and_integrity():
    pool = BlockPool(4, block_size=2)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    pool.release(list(reversed(a)))
    assert pool.num_free == 4
    pool.check_integrity()
    with pytest.raises(AssertionError):
        pool.release([0])


def test_cached_blocks_are_shared_and_evicted_least_recently_freed_first():
    pool = BlockPool(4, block_size=2)
    h = [hash_block(None, [1, 2]), hash_block(None, [3, 4]), hash_block(None, [5, 6])]
    blocks = pool.allocate(3)
    for b, bh in zip(blocks, h, strict=True):
        pool.register(b, bh)
    # Freed tail-first: block 2, then 1, then 0 join the free queue after the never-used block 3.
    pool.release(list(reversed(blocks)))
    assert pool.lookup(h[0]) == 0
    pool.acquire_cached(0)  # a new request shares block 0
    pool.acquire_cached(0)
    assert pool.blocks[0].ref_count == 2 and pool.num_free == 3
    # Eviction order: block 3 (never cached), then 2, then 1; block 0 is in use and survives.
    assert pool.allocate(1) == [3]
    assert pool.lookup(h[2]) == 2
    assert pool.allocate(1) == [2]
    assert pool.lookup(h[2]) is None and pool.lookup(h[1]) == 1
    assert pool.allocate(1) == [1]
    assert pool.lookup(h[1]) is None and pool.lookup(h[0]) == 0
    pool.check_integrity()


def test_chained_hash_depends_on_parent_and_segments():
    a = hash_block(None, [1, 2])
    assert hash_block(a, [3, 4]) != hash_block(None, [3, 4])
    assert hash_block(None, [1, 2], (("img-a", 0),)) != hash_block(None, [1, 2], (("img-b", 0),))


def test_disabled_prefix_cache_never_hits():
    pool = BlockPool(2, block_size=2, enable_prefix_caching=False)
    (b,) = pool.allocate(1)
    pool.register(b, hash_block(None, [1, 2]))
    assert pool.lookup(hash_block(None, [1, 2])) is None
