"""The engine's parts on their own: the derived `HiSparseConfig`, the static residency
manager, the scheduler's admission and preemption, sampling and the metrics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from hisparse_jax import models
from hisparse_jax.cache import AllResident, HiSparse, NaiveOffload
from hisparse_jax.engine import EngineConfig, Metrics, Request, Sizes
from hisparse_jax.engine.metrics import StepClock, summarise
from hisparse_jax.engine.sampler import base_key, sample, token_keys
from hisparse_jax.engine.scheduler import Scheduler
from hisparse_jax.engine.static_residency import NoTransfers, StaticResidency
from host_tier import Coordinator, TransferReport, Wait

TINY = models.get_config("tiny")  # top_k 16


def test_engine_config_gives_one_hisparse_config_per_mode():
    ec = EngineConfig(sizes=Sizes(max_seats=3, max_model_len=100, block_size=8))
    cfg = ec.hisparse_config(TINY)
    assert (cfg.top_k, cfg.hot_size, cfg.block_size, cfg.max_num_reqs) == (16, 32, 8, 3)
    assert (cfg.row_width, cfg.kv_dtype) == (TINY.row_width, jnp.dtype(TINY.kv_dtype))
    assert (cfg.max_model_len, cfg.max_pages, cfg.hot_blocks) == (100, 13, 4)
    assert cfg.num_gpu_blocks == 1 + 3 * (13 + 4) and cfg.num_host_blocks == 1 + 4 * 13
    assert isinstance(ec.residency, HiSparse)
    naive = EngineConfig(sizes=Sizes(max_seats=3, max_model_len=100, block_size=8),
                         residency=NaiveOffload())
    assert naive.hisparse_config(TINY).hot_size == 16 and isinstance(naive.residency,
                                                                      NaiveOffload)
    full = EngineConfig(sizes=Sizes(max_seats=3, max_model_len=100, block_size=8, num_gpu_blocks=7,
                                    num_host_blocks=9), residency=AllResident())
    cfg = full.hisparse_config(TINY)
    assert cfg.num_gpu_blocks == 1 + 3 * 13 and cfg.num_host_blocks is None
    assert cfg.host_rows == 0 and isinstance(full.residency, AllResident)
    sized = EngineConfig(sizes=Sizes(num_gpu_blocks=50, num_host_blocks=60, hot_size=48))
    assert sized.hisparse_config(TINY).num_gpu_blocks == 50
    assert sized.hisparse_config(TINY, num_host_blocks=70).num_host_blocks == 70  # a pool's
    assert sized.hisparse_config(TINY).hot_size == 48


def _static(seats=2):
    cfg = EngineConfig(sizes=Sizes(max_seats=seats, max_model_len=16, block_size=4),
                       residency=AllResident()).hisparse_config(TINY)
    return StaticResidency(cfg), cfg


def test_static_residency_gives_every_row_its_own_full_length_blocks():
    manager, cfg = _static()
    assert manager.hot_blocks == 0 and manager.device_pool.num_free == 2 * 4
    a = manager.admit("a", [1, 2, 3, 4, 5])
    b = manager.admit("b", [1])
    assert (a.state_row, b.state_row, a.num_scheduled_tokens) == (0, 1, 5)
    assert isinstance(manager.admit("c", [1]), Wait)  # a request waits for a state row only
    plan = manager.build_plan()
    assert [(w.request_id, w.start, w.num_tokens) for w in plan.writes] == [("a", 0, 5),
                                                                           ("b", 0, 1)]
    np.testing.assert_array_equal(plan.tables.res.values, [[1, 2, 3, 4], [5, 6, 7, 8]])
    assert not (plan.hot_resets or plan.hot_invalidations or plan.restores or plan.spills)
    assert manager.view("b").resident_blocks == (5, 6, 7, 8)
    assert manager.all_pages_resident("a") and not manager.has_pending_transfers()
    assert manager.schedule("a", new_token_ids=[7]) is None
    plan = manager.build_plan()
    assert [(w.start, w.num_tokens) for w in plan.writes] == [(5, 1)] and not len(plan.tables)
    manager.finish("a")
    assert manager.device_pool.num_free == 4
    assert manager.admit("c", [1]).state_row == 0  # the lowest free row
    manager.on_transfers(TransferReport())
    worker = NoTransfers()
    caches = [jnp.zeros(2)]
    assert worker.before_forward(plan, caches) == caches and not worker.poll(wait=True)
    assert worker.num_in_flight == 0


def _request(rid, n, gen=()):
    req = Request(rid, tuple(range(1, n + 1)), max_new_tokens=5)
    req.generated.extend(gen)
    return req


def test_scheduler_admits_runs_finishes_and_takes_the_fast_path():
    manager, cfg = _static()
    metrics = Metrics()
    sched = Scheduler(manager, NoTransfers(), cfg, AllResident(), metrics)
    for i in range(3):
        sched.waiting.append(_request(i, 3))
    step = sched.schedule()
    assert [r.request_id for r in step.admitted] == [0, 1] and not step.decode
    assert [r.seat for r in step.admitted] == [0, 1] and len(sched.waiting) == 1
    for req in step.admitted:
        sched.start(req)
        assert not sched.record(req, 9)
    step = sched.schedule()
    assert [r.request_id for r in step.decode] == [0, 1] and not step.admitted
    assert isinstance(step.residency, AllResident)
    req = step.decode[0]
    req.stop_token_ids = frozenset({4})
    assert sched.record(req, 4) and req.finish_reason == "stop"
    assert list(sched.finished) == [0] and metrics.generated_tokens == 3
    step = sched.schedule()  # request 2 takes the freed seat 0
    assert [r.request_id for r in step.admitted] == [2] and step.admitted[0].seat == 0


def test_scheduler_on_a_coordinator_keeps_hot_room_and_preempts_when_stalled():
    ec = EngineConfig(sizes=Sizes(max_seats=2, max_model_len=64, block_size=4, num_gpu_blocks=14,
                                  hot_size=16))
    cfg = ec.hisparse_config(TINY)
    manager = Coordinator.from_config(cfg, num_gpu_blocks=cfg.num_gpu_blocks,
                                      num_host_blocks=cfg.num_host_blocks,
                                      max_model_len=cfg.max_model_len,
                                      enable_prefix_caching=False)
    metrics = Metrics()
    sched = Scheduler(manager, NoTransfers(), cfg, HiSparse(), metrics)
    sched.waiting.extend([_request("a", 20), _request("b", 20)])
    step = sched.schedule()
    # 13 usable blocks: "a" takes 5 and "b" (5 more) would leave fewer than a hot region (4)
    # free, so it waits (and the running requests are asked to make room).
    assert [r.request_id for r in step.admitted] == ["a"] and metrics.waits == 1
    assert [r.request_id for r in sched.waiting] == ["b"]
    req = step.admitted[0]
    sched.start(req)
    assert not sched.record(req, 7)
    step = sched.schedule()
    assert step.decode == [req] and isinstance(step.residency, AllResident)  # all resident
    assert not sched.record(req, 8)
    # Recompute preemption: the last sampled token is dropped (the prefill samples it again).
    sched.preempt(req)
    assert req.generated == [7] and req.num_preemptions == 1 and metrics.preemptions == 1
    assert [r.request_id for r in sched.waiting] == ["a", "b"] and "a" not in manager


def test_sampling_is_greedy_at_zero_temperature_and_draws_otherwise():
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((4, 50)), jnp.float32)
    key = base_key(0)
    greedy = sample(logits, jnp.zeros(4), key)
    np.testing.assert_array_equal(np.asarray(greedy), np.argmax(np.asarray(logits), -1))
    drawn = [np.asarray(sample(logits, jnp.full(4, 5.0), jax.random.fold_in(key, i)))
             for i in range(8)]
    assert any((d != np.asarray(greedy)).any() for d in drawn)


def test_sampling_keys_depend_on_the_request_and_token_only():
    # Row n draws with the key of (seed, sampling seed, token index): the same request's token
    # comes out the same in any row, beside any other rows, alone or in a batch.
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((4, 50)), jnp.float32)
    key = base_key(3)
    seeds, index = jnp.array([7, 8, 9, 7], jnp.int32), jnp.array([0, 0, 0, 5], jnp.int32)
    hot = jnp.full(4, 2.0)
    batch = np.asarray(sample(logits, hot, token_keys(key, seeds, index)))
    for n in range(4):
        alone = sample(logits[n:n + 1], hot[:1], token_keys(key, seeds[n:n + 1], index[n:n + 1]))
        assert int(alone[0]) == batch[n]
    moved = np.asarray(sample(logits[::-1], hot, token_keys(key, seeds[::-1], index[::-1])))
    np.testing.assert_array_equal(moved, batch[::-1])
    # Greedy rows ignore their keys; other seeds, token indices or engine seeds draw others.
    np.testing.assert_array_equal(
        np.asarray(sample(logits, jnp.zeros(4), token_keys(key, seeds, index))),
        np.argmax(np.asarray(logits), -1))
    draws = {tuple(np.asarray(sample(logits, hot, token_keys(base_key(s), seeds + d, index))))
             for s in (3, 4) for d in (0, 1)}
    assert len(draws) == 4


def test_metrics_summary_figures():
    m = Metrics()
    clock = StepClock(m)
    assert not clock.account("decode_hot", 5.0, "decode_seconds")  # compile
    assert clock.account("decode_hot", 0.5, "decode_seconds")
    assert not clock.account(("prefill", 16), 2.0, "prefill_seconds")
    clock.decode_tokens = 4
    m.record_decode(fast=False, hits=6, misses=2, index_group_size=2, row_bytes=10)
    m.record_decode(fast=True, hits=0, misses=0, index_group_size=2, row_bytes=10)
    s = summarise(m, clock, mode="hisparse", requests_finished=1,
                  stats={"spills": 3, "hot_grants": 1}, device_bytes=1, device_allocator_bytes=None,
                  host_bytes=2, gpu_blocks=9)
    assert s["compile_seconds"] == 7.0 and s["decode_step_ms"] == 500.0
    assert s["decode_tokens_per_s"] == 8.0 and s["fast_path_steps"] == 1
    assert s["hot_hit_rate"] == 0.75 and s["rows_moved_h2d"] == 4 and s["bytes_moved_h2d"] == 40
    assert s["spilled_pages"] == 3 and s["lost_pages"] == 0 and m.rows_moved_per_step == [4, 0]
