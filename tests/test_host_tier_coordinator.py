"""Coordinator: one scenario per upstream responsibility, with exact expectations."""

import types

import pytest

from host_tier.scheduler import NULL_BLOCK, Admitted, CapacityError, Coordinator, Wait

B = 4


def make(**kwargs):
    sizes = dict(block_size=B, num_gpu_blocks=16, num_host_blocks=20, hot_blocks=2,
                 max_num_reqs=4, max_model_len=32)
    sizes.update(kwargs)
    return Coordinator(**sizes)


def complete_all(coord, plan):
    ids = [s.transfer_id for s in plan.spills]
    coord.on_transfers(enqueued=ids + [r.transfer_id for r in plan.restores], completed=ids)
    coord.check_invariants()


def decode(coord, rid, steps, token=1):
    """`steps` decode passes of one token each, completing every spill at once."""
    for _ in range(steps):
        assert coord.schedule(rid, new_token_ids=[token]) is None
        complete_all(coord, coord.build_plan())


def test_admission_allocates_and_the_first_plan_writes_and_spills_sealed_pages():
    coord = make()
    result = coord.admit("a", list(range(10)))
    assert result == Admitted("a", 0, 0, 10)
    plan = coord.build_plan()
    view = coord.view("a")
    assert len(view.host_blocks) == 3 and len(view.resident_blocks) == 3 and not view.hot_blocks
    assert [(w.request_id, w.start, w.num_tokens) for w in plan.writes] == [("a", 0, 10)]
    # Pages 0 and 1 are sealed (10 // 4): both are written back eagerly, page 2 is not.
    assert [(s.device_block, s.host_block) for s in plan.spills] == [
        (view.resident_blocks[0], view.host_blocks[0]),
        (view.resident_blocks[1], view.host_blocks[1])]
    assert plan.tables.src.rows.tolist() == [0]
    assert plan.tables.src.values[0, :3].tolist() == list(view.host_blocks)
    assert plan.tables.res.values[0, :3].tolist() == list(view.resident_blocks)
    assert plan.hot_resets == (0,)  # a new request starts with an empty hot state
    assert plan.hot_invalidations[0].host_blocks == tuple(sorted(view.host_blocks))
    coord.check_invariants()


def test_a_spill_pins_the_resident_block_until_enqueued_and_the_host_block_until_completed():
    coord = make()
    coord.admit("a", list(range(5)))
    plan = coord.build_plan()
    (spill,) = plan.spills
    dev, host = coord.device_pool, coord.host_pool
    assert dev.ref_count(spill.device_block) == 2 and host.ref_count(spill.host_block) == 2
    coord.on_transfers(enqueued=[spill.transfer_id])
    assert dev.ref_count(spill.device_block) == 1 and host.ref_count(spill.host_block) == 2
    assert coord.view("a").pending_pages == {0}
    coord.on_transfers(completed=[spill.transfer_id])
    assert host.ref_count(spill.host_block) == 1
    assert coord.view("a").valid_pages == {0} and not coord.view("a").pending_pages
    coord.check_invariants()


def test_reports_may_arrive_out_of_order_but_never_twice_or_unknown():
    coord = make()
    coord.admit("a", list(range(12)))
    plan = coord.build_plan()
    t0, t1, t2 = (s.transfer_id for s in plan.spills)
    coord.on_transfers(completed=[t2])  # completion before its enqueue notice
    coord.on_transfers(enqueued=[t1, t2])
    coord.on_transfers(enqueued=[t0], completed=[t0, t1])
    assert coord.view("a").valid_pages == {0, 1, 2} and not coord.has_pending_transfers()
    coord.check_invariants()
    with pytest.raises(ValueError, match=f"completed transfer id {t0} is not a pending spill"):
        coord.on_transfers(completed=[t0])
    with pytest.raises(ValueError, match="enqueued transfer id 99 is unknown"):
        coord.on_transfers(enqueued=[99])
    with pytest.raises(ValueError, match="names a transfer id twice"):
        coord.on_transfers(enqueued=[5, 5])
    coord.check_invariants()


def test_a_bad_report_changes_nothing():
    coord = make()
    coord.admit("a", list(range(8)))
    plan = coord.build_plan()
    t0, t1 = (s.transfer_id for s in plan.spills)
    with pytest.raises(ValueError):
        coord.on_transfers(enqueued=[t0], completed=[t1, 1234])
    assert coord.view("a").pending_pages == {0, 1} and not coord.view("a").valid_pages
    coord.check_invariants()  # t0 was not half-applied


def test_spill_budget_caps_queued_write_backs_at_max_model_len_over_block_size():
    coord = make(max_model_len=16, num_host_blocks=30)  # budget: 16 // 4 = 4 queued spills
    assert coord.spill_planner.max_spill_pages == 4
    coord.admit("a", list(range(12)))
    coord.admit("b", list(range(100, 112)))
    plan = coord.build_plan()
    assert len(plan.spills) == 4  # a's 3 sealed pages, then b's first; the rest waits
    coord.schedule("b", new_token_ids=[1])
    assert coord.build_plan().spills == ()  # nothing enqueued yet: the budget is spent
    coord.on_transfers(enqueued=[s.transfer_id for s in plan.spills[:2]])
    coord.schedule("b", new_token_ids=[1])
    plan3 = coord.build_plan()
    b = coord.view("b")
    assert [s.host_block for s in plan3.spills] == list(b.host_blocks[1:3])
    assert b.pending_pages == {0, 1, 2}
    coord.check_invariants()


def test_below_the_watermark_a_request_asks_for_a_hot_region_granted_on_its_next_schedule():
    coord = make(num_gpu_blocks=16)  # 15 usable, watermark max(2, 16 // 10) = 2
    assert coord.residency_policy.watermark == 2
    coord.admit("a", list(range(24)))  # 6 pages
    coord.admit("b", list(range(100, 128)))  # 7 pages: 2 free left
    complete_all(coord, coord.build_plan())
    assert coord.device_pool.num_free == 2
    assert not coord.view("a").hot_required  # 2 >= watermark: pages stay pinned
    assert coord.view("a").unpinned_pages == frozenset()
    # Next pass: b takes its 8th page, leaving 1 free block: both requests ask for hot regions.
    assert coord.schedule("b", new_token_ids=[1]) is None
    complete_all(coord, coord.build_plan())
    assert coord.view("b").hot_required and not coord.view("b").hot_blocks
    # The grant needs 2 blocks and only 1 is free: scheduling waits, saying why.
    wait = coord.schedule("b", new_token_ids=[1])
    assert isinstance(wait, Wait) and wait.resource == "device_blocks"
    assert wait.needed == 2 and wait.available == 1 and "device pool full" in wait.reason
    coord.preempt("a")
    assert coord.schedule("b", new_token_ids=[1]) is None
    plan = coord.build_plan()
    view = coord.view("b")
    assert len(view.hot_blocks) == 2 and plan.hot_resets == (view.state_row,)
    # With a hot region, every clean page but the last 2 is unpinned, still read until reused.
    assert view.unpinned_pages == frozenset(range(len(view.resident_blocks) - 2))
    assert all(b != NULL_BLOCK for b in view.resident_blocks)
    coord.check_invariants()


def test_an_unpinned_page_whose_block_is_reused_is_lost_and_read_from_host():
    coord = make(num_gpu_blocks=16, num_host_blocks=40, max_model_len=64)  # 15 usable
    coord.admit("a", list(range(24)))  # 6 pages
    coord.admit("b", list(range(100, 132)))  # 8 pages: 1 block left, below the watermark
    complete_all(coord, coord.build_plan())
    assert coord.view("a").hot_required
    coord.finish("b")
    assert coord.schedule("a", new_token_ids=[1]) is None  # hot region granted, page 6 added
    complete_all(coord, coord.build_plan())
    a = coord.view("a")
    assert len(a.hot_blocks) == 2
    assert a.unpinned_pages == {0, 1, 2, 3, 4}  # clean; pages 5 and 6 are the pinned tail
    unpinned = {p: a.resident_blocks[p] for p in a.unpinned_pages}
    # c takes every free block, a's unpinned ones included: they count as free.
    free = coord.device_pool.num_free
    assert set(unpinned.values()) <= set(coord.device_pool.free_queue())
    assert isinstance(coord.admit("c", list(range(200, 200 + free * B))), Admitted)
    plan = coord.build_plan()
    a_after = coord.view("a")
    c = coord.view("c")
    assert set(unpinned.values()) <= set(c.resident_blocks)
    for p in unpinned:
        assert a_after.resident_blocks[p] == NULL_BLOCK  # lost: read from host from now on
    assert a_after.unpinned_pages == frozenset() and a_after.hot_blocks == a.hot_blocks
    assert a_after.resident_blocks[5:] == a.resident_blocks[5:]
    assert coord.stats["lost_pages"] == 5
    # The nulled entries reach the worker in the same plan as c's writes into those blocks.
    row = plan.tables.res.rows.tolist().index(a_after.state_row)
    assert plan.tables.res.values[row, :5].tolist() == [NULL_BLOCK] * 5
    coord.check_invariants()


def test_host_pages_are_published_only_once_a_contiguous_prefix_completed():
    coord = make()
    coord.admit("a", list(range(12)))
    plan = coord.build_plan()
    t0, t1, t2 = (s.transfer_id for s in plan.spills)
    host = coord.host_pool
    coord.on_transfers(enqueued=[t0, t1, t2], completed=[t1, t2])
    assert host.published_blocks() == {}  # page 0 is not durable yet
    assert coord.view("a").ready_prefix_pages == 0
    coord.on_transfers(completed=[t0])
    view = coord.view("a")
    assert view.published_pages == 3 == view.ready_prefix_pages
    assert set(host.published_blocks()) == set(view.host_blocks[:3])
    coord.check_invariants()


def test_prefix_hit_shares_host_pages_and_adopts_their_device_copies():
    coord = make()
    prompt = list(range(8))
    coord.admit("a", prompt)
    complete_all(coord, coord.build_plan())
    a = coord.view("a")
    coord.finish("a")  # clean pages stay readable device copies until reused
    result = coord.admit("b", prompt + [50, 51, 52])
    assert result.num_cached_tokens == 8 and result.num_scheduled_tokens == 3
    b = coord.view("b")
    assert b.host_blocks[:2] == a.host_blocks[:2]
    assert b.resident_blocks[:2] == a.resident_blocks[:2]  # adopted, not recomputed
    assert coord.stats["adopted_pages"] == 2
    assert len(b.hot_blocks) == 2  # a prefix hit reads host pages: it gets a hot region
    assert b.valid_pages == {0, 1} and b.num_computed_tokens == 8
    plan = coord.build_plan()
    assert [(w.start, w.num_tokens) for w in plan.writes] == [(8, 3)]
    coord.check_invariants()


def test_partial_prefix_hit_copies_on_write_instead_of_writing_the_shared_page():
    coord = make()
    prompt = list(range(8))
    coord.admit("a", prompt)
    complete_all(coord, coord.build_plan())
    a = coord.view("a")
    shared = a.host_blocks[1]
    result = coord.admit("b", prompt)  # fully cached: the last token is recomputed
    assert result.num_cached_tokens == 7
    b = coord.view("b")
    assert b.host_blocks[0] == a.host_blocks[0]
    assert b.host_blocks[1] != shared, "b must get a private host block for the page it writes"
    assert coord.host_pool.block_hash(shared) is not None
    plan = coord.build_plan()
    (restore,) = plan.restores
    assert (restore.host_block, restore.device_block, restore.num_rows) == (
        shared, b.resident_blocks[1], 3)
    assert coord.host_pool.ref_count(shared) == 2  # a, plus the restore until enqueued
    (spill,) = plan.spills  # the recomputed page goes to the private block
    assert spill.host_block == b.host_blocks[1] != shared
    coord.on_transfers(enqueued=[restore.transfer_id])
    assert coord.host_pool.ref_count(shared) == 1
    coord.on_transfers(enqueued=[spill.transfer_id], completed=[spill.transfer_id])
    assert coord.view("b").valid_pages == {0, 1}
    assert coord.host_pool.lookup(coord.host_pool.block_hash(shared)) == shared  # untouched
    coord.check_invariants()


def test_resident_prefix_hits_restore_the_hit_pages_without_a_device_copy():
    coord = make(resident_prefix_hits=True)
    prompt = list(range(12))
    coord.admit("a", prompt)
    complete_all(coord, coord.build_plan())
    a = coord.view("a")
    coord.finish("a")
    # Handing out every free block evicts the device copies of a's pages.
    grabbed = coord.device_pool.allocate(coord.device_pool.num_free)
    coord.device_pool.free(grabbed)
    result = coord.admit("b", prompt[:10] + [70, 71])
    assert result.num_cached_tokens == 8 and result.num_scheduled_tokens == 4
    b = coord.view("b")
    assert b.host_blocks[:2] == a.host_blocks[:2] and coord.stats["adopted_pages"] == 0
    assert NULL_BLOCK not in b.resident_blocks and not b.hot_blocks  # all resident
    plan = coord.build_plan()
    assert [(r.host_block, r.device_block, r.num_rows) for r in plan.restores] == [
        (a.host_blocks[p], b.resident_blocks[p], B) for p in (0, 1)]
    assert coord.stats["prefix_restores"] == 2 and coord.stats["copy_on_write"] == 0
    assert [(w.start, w.num_tokens) for w in plan.writes] == [(8, 4)]  # pages 2.. only
    assert all(coord.host_pool.ref_count(a.host_blocks[p]) == 2 for p in (0, 1))
    complete_all(coord, plan)  # the restores' references go when they are enqueued
    assert all(coord.host_pool.ref_count(a.host_blocks[p]) == 1 for p in (0, 1))
    assert coord.view("b").valid_pages >= {0, 1}


@pytest.mark.parametrize("resident_prefix_hits", [False, True])
@pytest.mark.parametrize("second", [list(range(10)) + [70, 71], list(range(12)), [9, 9, 9]],
                         ids=["hit-2-pages", "whole-prompt", "miss"])
def test_admission_need_is_what_admitting_the_whole_prompt_takes(resident_prefix_hits,
                                                                 second):
    """`admission_need` reports the tokens admit reuses and the device blocks it takes for the
    whole prompt (no device copy to adopt): a staged hit takes its uncached pages and a hot
    region, a resident hit a block per page, a miss a block per page; it changes nothing."""
    coord = make(resident_prefix_hits=resident_prefix_hits)
    first = list(range(12))
    assert coord.admission_need(first) == (0, 3)
    coord.admit("a", first)
    complete_all(coord, coord.build_plan())
    coord.finish("a")
    grabbed = coord.device_pool.allocate(coord.device_pool.num_free)  # evicts a's copies
    coord.device_pool.free(grabbed)
    cached, need = coord.admission_need(second)
    assert coord.admission_need(second) == (cached, need)            # changes nothing
    assert cached == coord.cached_tokens(second)
    free = coord.device_pool.num_free
    result = coord.admit("b", second)
    assert result.num_cached_tokens == cached
    assert free - coord.device_pool.num_free == need
    full_hit = cached // B
    pages = -(-len(second) // B)
    staged = full_hit > 0 and not resident_prefix_hits
    assert need == (pages - full_hit + coord.hot_blocks if staged else pages)
    coord.check_invariants()


def test_admission_need_without_prefix_caching_counts_every_page():
    coord = make(enable_prefix_caching=False)
    coord.admit("a", list(range(12)))
    complete_all(coord, coord.build_plan())
    coord.finish("a")
    assert coord.admission_need(list(range(10))) == (0, 3)


def test_listeners_hear_publications_and_evictions():
    coord = make(num_host_blocks=6)
    published, evicted = [], []
    coord.listen(on_publish=lambda rid, page, h: published.append((rid, page, h)),
                 on_unpublish=evicted.append)
    assert coord.cached_tokens(list(range(8))) == 0
    coord.admit("a", list(range(8)))
    complete_all(coord, coord.build_plan())
    assert [(rid, page) for rid, page, _ in published] == [("a", 0), ("a", 1)]
    assert coord.cached_tokens(list(range(8))) == 7 and coord.cached_tokens([0, 1, 2, 3, 9]) == 4
    assert coord.publishes("a")
    coord.finish("a")
    assert not coord.publishes("a")
    coord.admit("b", list(range(50, 70)))  # 5 host blocks: a's pages are evicted
    assert sorted(evicted) == sorted(h for _, _, h in published)
    assert coord.cached_tokens(list(range(8))) == 0
    complete_all(coord, coord.build_plan())
    coord.finish("b")
    assert coord.cached_tokens(list(range(50, 70))) == 19
    coord.drop_prefix_cache()  # forgets b's published pages and their device copies
    assert coord.cached_tokens(list(range(50, 70))) == 0 and len(evicted) == 2 + 5
    assert not coord.host_pool.published_blocks()
    coord.check_invariants()


def test_finish_with_spills_in_flight_publishes_once_they_complete():
    coord = make()
    coord.admit("a", list(range(9)))
    plan = coord.build_plan()
    t0, t1 = (s.transfer_id for s in plan.spills)
    host_blocks = coord.view("a").host_blocks
    coord.finish("a")
    coord.check_invariants()
    assert coord.host_pool.published_blocks() == {}
    assert coord.host_pool.ref_count(host_blocks[0]) == 2  # finished record + spill
    assert coord.host_pool.is_free(host_blocks[2])  # the partial page is not kept
    coord.on_transfers(enqueued=[t0, t1], completed=[t1])
    assert coord.host_pool.published_blocks() == {}
    coord.on_transfers(completed=[t0])
    assert set(coord.host_pool.published_blocks()) == set(host_blocks[:2])
    assert coord.host_pool.is_free(host_blocks[0])  # published, cached, evictable
    coord.check_invariants()
    assert coord.admit("b", list(range(9))).num_cached_tokens == 8


def test_preempt_drops_pending_publications_and_keeps_published_pages():
    coord = make()
    coord.admit("a", list(range(12)))
    plan = coord.build_plan()
    t0, t1, t2 = (s.transfer_id for s in plan.spills)
    coord.on_transfers(enqueued=[t0, t1, t2], completed=[t0])
    host_blocks = coord.view("a").host_blocks
    assert set(coord.host_pool.published_blocks()) == {host_blocks[0]}
    coord.preempt("a")
    coord.on_transfers(completed=[t1, t2])
    assert set(coord.host_pool.published_blocks()) == {host_blocks[0]}
    assert all(coord.host_pool.is_free(b) for b in host_blocks)
    coord.check_invariants()
    # Re-admitted, the preempted request resumes from its durable prefix.
    assert coord.admit("a", list(range(12))).num_cached_tokens == 4


def test_capacity_limits_are_waits_with_reasons_and_impossible_requests_errors():
    coord = make(num_host_blocks=6, max_num_reqs=2)  # 5 usable host blocks
    with pytest.raises(CapacityError, match="more than max_model_len=32"):
        coord.admit("x", list(range(33)))
    with pytest.raises(CapacityError, match="needs 6 host blocks, the host pool has only 5"):
        coord.admit("x", list(range(24)))
    with pytest.raises(CapacityError, match="smaller num_new_tokens"):
        make(num_gpu_blocks=8, max_model_len=64).admit("x", list(range(40)))
    assert isinstance(coord.admit("a", list(range(12))), Admitted)
    wait = coord.admit("b", list(range(100, 112)))
    assert isinstance(wait, Wait) and wait.resource == "host_blocks"
    assert (wait.needed, wait.available) == (3, 2)
    assert "host pool full" in wait.reason and "finish or preempt" in wait.reason
    assert "b" not in coord and coord.host_pool.num_free == 2  # nothing allocated
    assert isinstance(coord.admit("c", [1]), Admitted)
    wait = coord.admit("d", [1])
    assert wait.resource == "state_rows" and "max_num_reqs" in wait.reason
    plan = coord.build_plan()
    coord.finish("c")
    coord.on_transfers(enqueued=[s.transfer_id for s in plan.spills])
    wait = coord.admit("b", list(range(100, 112)))
    assert wait.resource == "host_blocks" and "3 transfers in flight" in wait.reason
    coord.on_transfers(completed=[s.transfer_id for s in plan.spills])
    coord.finish("a")
    assert isinstance(coord.admit("b", list(range(100, 112))), Admitted)
    coord.check_invariants()


def test_device_shortage_at_admission_waits():
    coord = make(num_gpu_blocks=8)  # 7 usable
    coord.admit("a", list(range(20)))  # 5 pages
    wait = coord.admit("b", list(range(100, 112)))
    assert wait.resource == "device_blocks" and (wait.needed, wait.available) == (3, 2)
    assert "preempt a request" in wait.reason
    plan = coord.build_plan()
    wait = coord.admit("b", list(range(100, 112)))
    assert "5 pages are pinned until the worker enqueues their spills" in wait.reason
    coord.on_transfers(enqueued=[s.transfer_id for s in plan.spills])
    assert coord.admit("b", list(range(100, 112))).resource == "device_blocks"
    coord.check_invariants()


def test_a_page_without_host_block_stays_pinned_until_one_is_bound_late():
    coord = make(num_host_blocks=5, num_gpu_blocks=20)  # 4 usable host blocks
    coord.admit("a", list(range(12)))
    assert isinstance(coord.admit("b", [9]), Admitted)  # takes the last free host block
    complete_all(coord, coord.build_plan())
    decode(coord, "a", 4)  # page 3 is sealed but no host block is free
    view = coord.view("a")
    assert view.host_blocks[3] == NULL_BLOCK and 3 not in view.valid_pages
    assert view.resident_blocks[3] != NULL_BLOCK and 3 not in view.unpinned_pages
    assert 3 not in view.pending_pages  # nothing to write it back into: not spilled
    freed = coord.view("b").host_blocks[0]
    coord.finish("b")
    assert coord.schedule("a", new_token_ids=[1]) is None
    plan = coord.build_plan()
    view = coord.view("a")
    assert view.host_blocks[3] == freed
    assert [s.host_block for s in plan.spills] == [freed]
    assert [(i.state_row, i.host_blocks) for i in plan.hot_invalidations] == [
        (view.state_row, (freed,))]
    complete_all(coord, plan)


def test_releasing_a_request_in_its_admission_pass_drops_its_restore():
    coord = make()
    coord.admit("a", list(range(8)))
    complete_all(coord, coord.build_plan())
    shared = coord.view("a").host_blocks[1]
    coord.admit("b", list(range(8)))  # partial hit: restore planned
    assert coord.host_pool.ref_count(shared) == 2
    coord.cancel("b")
    plan = coord.build_plan()
    assert plan.restores == () and plan.writes == ()
    assert coord.host_pool.ref_count(shared) == 1
    coord.check_invariants()


def test_bad_arguments_are_rejected_with_the_argument_named():
    coord = make()
    with pytest.raises(ValueError, match="num_gpu_blocks=5 leaves 4 usable blocks; one decoding"):
        make(num_gpu_blocks=5)
    with pytest.raises(ValueError, match="Coordinator.block_size must be a positive int"):
        make(block_size=0)
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] must be an int64 token id"):
        coord.admit("a", [1, "x"])
    with pytest.raises(ValueError, match="must not be empty"):
        coord.admit("a", [])
    with pytest.raises(ValueError, match=r"num_new_tokens must be in \[1, 3\]"):
        coord.admit("a", [1, 2, 3], num_new_tokens=4)
    coord.admit("a", [1, 2, 3], num_new_tokens=2)
    with pytest.raises(ValueError, match="already admitted"):
        coord.admit("a", [1])
    with pytest.raises(ValueError, match="already scheduled in this pass"):
        coord.schedule("a")
    coord.build_plan()
    with pytest.raises(ValueError, match=r"num_tokens must be in \[1, 1\]"):
        coord.schedule("a", 2)
    with pytest.raises(ValueError, match="schedule: request_id 'zz' is not admitted"):
        coord.schedule("zz")
    with pytest.raises(ValueError, match="more than max_model_len=32"):
        coord.schedule("a", new_token_ids=[0] * 30)
    with pytest.raises(ValueError, match="finish: request_id 'zz' is not admitted"):
        coord.finish("zz")
    assert coord.schedule("a") is None  # the rest of the chunked prompt
    assert [(w.start, w.num_tokens) for w in coord.build_plan().writes] == [(2, 1)]
    coord.check_invariants()


def test_from_config_takes_sizes_from_a_hisparse_config():
    config_module = pytest.importorskip("hisparse_jax.config")
    cfg = config_module.HiSparseConfig(top_k=8, hot_size=16, block_size=4, max_num_reqs=3)
    coord = Coordinator.from_config(cfg, num_gpu_blocks=32, num_host_blocks=64,
                                    max_model_len=128)
    assert (coord.block_size, coord.hot_blocks, coord.tables.max_num_reqs) == (4, 4, 3)
    assert coord.residency_policy.watermark == max(4, 32 // 10)
    assert coord.spill_planner.max_spill_pages == 32


def test_request_room_moves_running_requests_to_hot_regions_and_unpins_their_pages():
    # Without pressure a request keeps every page pinned; a waiting admission that asks for
    # room makes it take a hot region and unpin its clean pages, whose blocks count as free.
    coord = make(num_gpu_blocks=32, max_model_len=64)
    coord.admit("a", list(range(20)))  # 5 sealed pages
    complete_all(coord, coord.build_plan())
    decode(coord, "a", 2)  # page 5 opens
    assert not coord.view("a").hot_blocks and not coord.view("a").unpinned_pages
    free_before = coord.device_pool.num_free
    coord.request_room(free_before)  # more than is free: pressure
    decode(coord, "a", 2)  # hot region granted, then the clean pages unpin
    view = coord.view("a")
    assert len(view.hot_blocks) == 2
    assert view.unpinned_pages == {0, 1, 2, 3}  # every page but the 2 tail pages
    assert coord.device_pool.num_free == free_before - 2 + 4
    coord.request_room(0)
    with pytest.raises(ValueError, match="num_blocks"):
        coord.request_room(-1)


def test_offload_all_reads_every_sealed_page_but_the_tail_from_host():
    coord = make(num_gpu_blocks=32, max_model_len=64, offload_all=True)
    coord.admit("a", list(range(20)))
    complete_all(coord, coord.build_plan())
    decode(coord, "a", 2)
    view = coord.view("a")
    assert len(view.hot_blocks) == 2 and not view.unpinned_pages
    # Lost at once (their host copies completed): only the 2 tail pages stay resident.
    assert view.resident_blocks[:4] == (NULL_BLOCK,) * 4
    assert all(b != NULL_BLOCK for b in view.resident_blocks[4:])
    assert all(b != NULL_BLOCK for b in view.host_blocks[:5])
    assert not coord.all_pages_resident("a")
    assert coord.stats["lost_pages"] == 4
    coord.check_invariants()


def _sizes(**overrides):
    sizes = dict(block_size=B, hot_blocks=2, max_num_reqs=3, max_model_len=40, max_pages=10,
                 num_gpu_blocks=24, num_host_blocks=30, row_width=8, kv_dtype="float32")
    sizes.update(overrides)
    return types.SimpleNamespace(**sizes)


def test_from_config_reads_every_size_from_the_sizes_object():
    coord = Coordinator.from_config(_sizes(), offload_all=True)
    assert (coord.block_size, coord.hot_blocks, coord.tables.max_num_reqs) == (B, 2, 3)
    assert (coord.device_pool.num_blocks, coord.host_pool.num_blocks) == (24, 30)
    assert (coord.max_model_len, coord.max_pages) == (40, 10) and coord.residency_policy.offload_all
    # The keyword sizes of the old signature still win over the config.
    coord = Coordinator.from_config(_sizes(max_model_len=None), num_gpu_blocks=16,
                                    max_model_len=8)
    assert (coord.device_pool.num_blocks, coord.max_model_len) == (16, 8)
    with pytest.raises(ValueError, match=r"Coordinator.from_config: config.max_model_len is "
                                         r"None or missing; .* or pass max_model_len="):
        Coordinator.from_config(_sizes(max_model_len=None))
    with pytest.raises(ValueError, match="from_config: config.hot_blocks is None or missing; "
                                         "set it on the SimpleNamespace$"):
        Coordinator.from_config(_sizes(hot_blocks=None))
    with pytest.raises(ValueError, match="config.num_gpu_blocks is None or missing"):
        Coordinator.from_config(types.SimpleNamespace(block_size=4))
    with pytest.raises(TypeError, match="block_size comes from the config"):
        Coordinator.from_config(_sizes(), block_size=8)
    with pytest.raises(ValueError, match="Coordinator.max_num_reqs must be a positive int"):
        Coordinator.from_config(_sizes(max_num_reqs=0))


def _busy_coordinator():
    """A coordinator with an unpinned page, an indexed device copy and a spill not enqueued."""
    coord = make(num_gpu_blocks=32, max_model_len=64)
    coord.admit("a", list(range(8)))
    complete_all(coord, coord.build_plan())
    coord.finish("a")  # its clean pages become indexed device copies
    coord.admit("b", list(range(20)))
    complete_all(coord, coord.build_plan())
    coord.request_room(32)
    decode(coord, "b", 2)
    coord.admit("c", list(range(100, 106)))
    coord.build_plan()  # c's page 0 spill is planned, not enqueued
    assert coord.view("b").unpinned_pages and coord.prefix_cache.copies
    assert coord.spill_planner.num_unenqueued == 1
    coord.check_invariants()
    return coord


@pytest.mark.parametrize("corrupt,message", [
    (lambda c: c.prefix_cache.copy_of_block.clear(), "device copy index disagrees"),
    (lambda c: c.residency_policy.readers.clear(), "is not registered as a reader"),
    (lambda c: setattr(c.spill_planner, "num_unenqueued", 0), "unenqueued spill count drifted"),
    (lambda c: c.spill_planner.spills.clear(), "has no matching spill"),
    (lambda c: c._requests["b"].pinned_clean.clear(), "pinned_clean out of date"),
    (lambda c: c._free_rows.append(c._requests["b"].state_row), "a used state row is also free"),
])
def test_check_invariants_sees_a_broken_part(corrupt, message):
    coord = _busy_coordinator()
    corrupt(coord)
    with pytest.raises(AssertionError, match=message):
        coord.check_invariants()
