"""BlockPool: every operation, the null block, eviction order, reuse watchers, content hashes."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


# ------------------------------------------------------------------ size and the lazy free queue


def test_construction_is_constant_in_the_pool_size():
    tracemalloc = pytest.importorskip("tracemalloc")
    tracemalloc.start()
    try:
        pool = BlockPool(10**9, name="host pool")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20  # a list of 10**9 ids would be 8 GB
    assert pool.num_free == pool.num_usable == 10**9 - 1
    # No per-block structure: referenced blocks only, and nothing released yet.
    assert pool._ref == {} and not pool._released and not pool._fresh_taken
    assert pool.allocate(3) == [1, 2, 3]
    pool.free([2])
    pool.touch([10**9 - 1])  # a never-used block taken out of the middle of the range
    assert pool.allocate(2) == [4, 5] and pool.num_free == 10**9 - 1 - 5
    assert len(pool._ref) == 5 and pool.is_free(2) and not pool.is_free(10**9 - 1)
    pool.check_invariants({1: 1, 3: 1, 4: 1, 5: 1, 10**9 - 1: 1})


class _ListPool:
    """The eviction order every `BlockPool` must give: a queue holding every free block, built
    up front (the original implementation, reduced to the order, counts, watchers and hashes)."""

    def __init__(self, num_blocks):
        self.ref = [0] * num_blocks
        self.queue = list(range(1, num_blocks))
        self.watchers, self.hash_of, self.block_of = {}, {}, {}

    def allocate(self, num):
        out, fired = self.queue[:num], []
        del self.queue[:num]
        for b in out:
            self.ref[b] = 1
            h = self.hash_of.pop(b, None)
            if h is not None:
                del self.block_of[h]
            fired += [(b, w) for w in self.watchers.pop(b, [])]
        return out, fired

    def release(self, b):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            self.queue.append(b)

    def unpin(self, b, watcher):
        self.release(b)
        if watcher not in self.watchers.setdefault(b, []):
            self.watchers[b].append(watcher)

    def touch(self, b):
        if self.ref[b] == 0:
            self.queue.remove(b)
        self.ref[b] += 1

    def cache(self, b, h):
        if self.hash_of.get(b) is not None:
            return True
        if h in self.block_of:
            return False
        self.hash_of[b], self.block_of[h] = h, b
        return True


@settings(max_examples=max(150, settings.default.max_examples))
@given(num_blocks=st.integers(2, 12), ops=st.lists(st.tuples(
    st.sampled_from(["allocate", "free", "unpin", "touch", "cache"]), st.integers(0, 11),
    st.integers(0, 3)), max_size=60))
def test_the_lazy_free_queue_gives_the_order_of_a_full_queue(num_blocks, ops):
    """Random allocate / free / unpin / touch / cache sequences (touching never-used, free and
    held blocks alike): the same blocks are handed out in the same order, the free queue,
    counts, hashes and fired watchers equal those of a queue of every block."""
    pool, model = BlockPool(num_blocks), _ListPool(num_blocks)
    fired = []

    def watcher(tag):
        def on_reuse(block):
            fired.append((block, tag))
        return on_reuse

    watchers = [watcher(t) for t in range(2)]
    for op, pick, num in ops:
        held = [b for b in range(1, num_blocks) if model.ref[b] > 0]
        if op == "allocate":
            num = min(num, len(model.queue))
            want, want_fired = model.allocate(num)
            fired.clear()
            assert pool.allocate(num) == want
            assert fired == [(b, watchers.index(w)) for b, w in want_fired]
        elif op in ("free", "unpin") and held:
            block = held[pick % len(held)]
            if op == "free":
                pool.free([block])
                model.release(block)
            else:
                pool.unpin([block], watchers[num % 2])
                model.unpin(block, watchers[num % 2])
        elif op == "touch":
            block = 1 + pick % (num_blocks - 1)
            pool.touch([block])
            model.touch(block)
        elif op == "cache" and held:
            block = held[pick % len(held)]
            if model.hash_of.get(block, num) != num:
                with pytest.raises(ValueError, match="another hash"):
                    pool.cache(block, num)
            else:
                assert pool.cache(block, num) == model.cache(block, num)
        assert pool.free_queue() == model.queue
        assert pool.num_free == len(model.queue)
        assert [pool.ref_count(b) for b in range(num_blocks)] == model.ref
        assert [pool.is_free(b) for b in range(1, num_blocks)] == [
            model.ref[b] == 0 for b in range(1, num_blocks)]
        assert pool.published_blocks() == model.hash_of
        pool.check_invariants({b: r for b, r in enumerate(model.ref) if r})
