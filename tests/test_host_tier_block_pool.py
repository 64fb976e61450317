"""BlockPool: every operation, the null block, eviction order, reuse watchers, content hashes."""

import pytest

from host_tier.scheduler.block_pool import NULL_BLOCK, BlockPool, PoolExhaustedError


def test_null_block_is_never_handed_out_and_not_counted():
    pool = BlockPool(4)
    assert pool.num_usable == 3
    assert pool.num_free == 3
    blocks = pool.allocate(3)
    assert sorted(blocks) == [1, 2, 3]
    assert NULL_BLOCK not in blocks
    with pytest.raises(PoolExhaustedError, match="only 0 are free"):
        pool.allocate(1)
    # The null block is skipped by free / touch / unpin: tables may hold it freely.
    pool.free([NULL_BLOCK])
    pool.touch([NULL_BLOCK])
    pool.unpin([NULL_BLOCK], lambda b: None)
    assert pool.ref_count(NULL_BLOCK) == 0 and not pool.is_free(NULL_BLOCK)
    with pytest.raises(ValueError, match="null block cannot be published"):
        pool.cache(NULL_BLOCK, b"h")
    pool.check_invariants({1: 1, 2: 1, 3: 1})


def test_allocate_takes_the_head_and_free_appends_in_eviction_order():
    pool = BlockPool(6)
    a = pool.allocate(5)
    assert a == [1, 2, 3, 4, 5]
    pool.free([4, 2])  # 4 is evicted before 2
    pool.free([5])
    assert pool.free_queue() == [4, 2, 5]
    assert pool.allocate(2) == [4, 2]
    assert pool.free_queue() == [5]
    pool.check_invariants({1: 1, 2: 1, 3: 1, 4: 1})


def test_reference_counts_touch_and_double_free():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.touch([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert not pool.is_free(b) and pool.ref_count(b) == 1
    pool.free([b])
    assert pool.is_free(b)
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    # Touching a free block takes it out of the queue (a prefix hit on a cached block).
    pool.touch([b])
    assert not pool.is_free(b) and pool.ref_count(b) == 1
    assert b not in pool.free_queue()
    pool.check_invariants({b: 1})


def test_allocate_failure_hands_out_nothing():
    pool = BlockPool(4)
    pool.allocate(2)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(2)
    assert pool.num_free == 1
    pool.check_invariants({1: 1, 2: 1})


def test_unpin_counts_as_free_keeps_readable_and_fires_on_reuse_once():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    fired = []
    pool.unpin([blocks[1]], fired.append)
    assert pool.is_free(blocks[1]) and pool.num_free == 1
    assert fired == []  # still readable: nothing handed out yet
    pool.free([blocks[0]])
    # Queue order: the unpinned block first (it was released first).
    assert pool.allocate(1) == [blocks[1]]
    assert fired == [blocks[1]]
    pool.free([blocks[1]])
    pool.allocate(2)  # reuse again: the watcher was consumed, it must not fire twice
    assert fired == [blocks[1]]
    pool.check_invariants({1: 1, 2: 1, 3: 1})


def test_unpin_watchers_survive_touch_and_fire_on_the_eventual_reuse():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    fired = []
    pool.unpin([a], fired.append)
    pool.touch([a])  # e.g. another request adopts the readable copy
    assert not pool.is_free(a) and fired == []
    pool.unpin([a], fired.append)  # same watcher twice: registered once
    pool.free([b])
    pool.allocate(2)
    assert fired == [a]


def test_unpin_with_other_holders_only_drops_one_reference():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    pool.touch([a])
    pool.unpin([a], lambda block: None)
    assert pool.ref_count(a) == 1 and not pool.is_free(a)
    assert pool.has_watchers(a)
    pool.unpin([a], lambda block: None)
    assert pool.is_free(a)
    with pytest.raises(ValueError, match="double free"):
        pool.unpin([a], lambda block: None)


def test_content_hashes_publish_lookup_and_evict_on_reuse():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    assert pool.cache(a, b"page0")
    assert pool.lookup(b"page0") == a and pool.block_hash(a) == b"page0"
    assert pool.cache(a, b"page0")  # idempotent
    assert not pool.cache(b, b"page0")  # first published copy wins
    assert pool.lookup(b"page0") == a and pool.block_hash(b) is None
    with pytest.raises(ValueError, match="another hash"):
        pool.cache(a, b"other")
    pool.free([a])
    assert pool.lookup(b"page0") == a  # a free block keeps its hash: a cached page
    pool.touch([a])  # a prefix hit takes it back
    pool.free([a])
    pool.free([c])
    assert pool.allocate(1) == [a]  # reused: the cached page is evicted
    assert pool.lookup(b"page0") is None and pool.block_hash(a) is None
    with pytest.raises(ValueError, match="is free"):
        pool.cache(c, b"x")
    pool.check_invariants({a: 1, b: 1})


def test_bad_arguments_name_the_argument_and_the_rule():
    with pytest.raises(ValueError, match="num_blocks must be an int >= 2"):
        BlockPool(1)
    pool = BlockPool(4, name="device pool")
    with pytest.raises(ValueError,
                       match=r"device pool: free\(blocks\) must be a block id in \[0, 4\)"):
        pool.free([4])
    with pytest.raises(ValueError, match=r"touch\(blocks\)"):
        pool.touch([-1])
    with pytest.raises(ValueError, match=r"allocate\(num\) needs an int >= 0"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="on_reuse"):
        pool.unpin([1], None)


def test_check_invariants_detects_leaks_and_missing_references():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.check_invariants({a: 1, b: 1})
    with pytest.raises(AssertionError, match="leak"):
        pool.check_invariants({a: 1})
    with pytest.raises(AssertionError, match="double free or missing pin"):
        pool.check_invariants({a: 1, b: 2})


def test_numpy_integer_ids_are_accepted():
    np = pytest.importorskip("numpy")
    pool = BlockPool(4)
    (a,) = pool.allocate(1)
    pool.touch([np.int32(a)])
    pool.free([np.int64(a)])
    assert pool.ref_count(a) == 1
    pool.free(np.array([a], np.int32))
    assert pool.free_queue().count(a) == 1 and all(type(x) is int for x in pool.free_queue())
