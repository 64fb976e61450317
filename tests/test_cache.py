"""The KV-cache handle (`hisparse_jax.cache`): write and lookup per residency type against a
direct NumPy computation, donation at a jit boundary, and the residencies' agreement."""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.cache import (
    AllResident,
    CacheBatch,
    HiSparse,
    HiSparseKVCache,
    NaiveOffload,
)
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.ops import _registry
from host_tier import memory_sharding
from pallas_kernels._rows import flat_rows

S, B, P, HB, W, LAYERS = 3, 4, 6, 4, 16, 2
CFG = HiSparseConfig(top_k=8, hot_size=HB * B, block_size=B, max_num_reqs=S, row_width=W,
                     kv_dtype="float32", max_model_len=P * B, num_gpu_blocks=1 + S * (P + HB),
                     num_host_blocks=1 + S * P)
STATE_ROWS = np.array([2, -1, 0], np.int32)  # batch rows: state row 2, padding, state row 0
RESIDENT_PAGES = (0, 5)  # HiSparse: the other pages are read from host
RESIDENCIES = [AllResident(), HiSparse(), NaiveOffload()]


def _tables(residency):
    """Per state row: src (host blocks), res (device blocks; every page when all-resident),
    hot (hot-region device blocks)."""
    s = np.arange(S)[:, None]
    pages = (1 + s * P + np.arange(P)).astype(np.int32)
    src, res = pages.copy(), pages.copy()
    if residency.reads_host:
        res[:, [p for p in range(P) if p not in RESIDENT_PAGES]] = 0
    else:
        src[:] = 0
    hot = (1 + S * P + s * HB + np.arange(HB)).astype(np.int32)
    return src, res, hot


def _pools(packed=False):
    """Per layer, host pool content (NumPy) and the same in pinned host memory: one array
    per layer, or (packed) one array with every layer side by side."""
    rng = np.random.default_rng(1)
    host = [rng.standard_normal((CFG.num_host_blocks, B, W)).astype(np.float32)
            for _ in range(LAYERS)]
    pinned = memory_sharding(jax.devices()[0], "pinned_host")
    arrays = [np.concatenate(host, axis=-1)] if packed else host
    return host, tuple(jax.device_put(h, pinned) for h in arrays)


def _setup(residency, positions=(20, 0, 21), packed=False):
    """A cache whose resident pages hold the host rows of the same pages, and a batch that
    writes on the last (resident) page."""
    host, pools = _pools(packed)
    src, res, hot = _tables(residency)
    cache = HiSparseKVCache.create(CFG, num_layers=LAYERS, residency=residency,
                                   index_group_size=LAYERS)
    pages = (1 + np.arange(S)[:, None] * P + np.arange(P)).ravel()
    rows = (pages[:, None] * B + np.arange(B)).ravel()
    for layer in range(LAYERS):
        values = host[layer].reshape(-1, W)[rows]
        cache = cache.write_rows(layer, jnp.asarray(rows, jnp.int32), jnp.asarray(values))
    batch = CacheBatch.from_tables(jnp.asarray(STATE_ROWS), jnp.asarray(positions, jnp.int32),
                                   src=jnp.asarray(src), res=jnp.asarray(res),
                                   hot=jnp.asarray(hot), host_pools=pools)
    return cache, batch, host, (src, res, hot)


def _flat(table_row, t):
    block = table_row[t // B] if 0 <= t < P * B else 0
    return int(block * B + t % B) if t >= 0 and block > 0 else -1


def test_flat_rows_and_batch_gather():
    table = jnp.asarray([[0, 3, 5], [7, 0, 2]], jnp.int32)
    pos = jnp.asarray([[0, 4, 9, 12, -1], [1, 5, 11, 3, 8]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(flat_rows(table, pos, 4)),
                                  [[-1, 12, 21, -1, -1], [29, -1, 11, 31, 8]])
    _, batch, _, (src, res, hot) = _setup(HiSparse())
    live = STATE_ROWS >= 0
    np.testing.assert_array_equal(np.asarray(batch.res)[live], res[STATE_ROWS[live]])
    np.testing.assert_array_equal(np.asarray(batch.hot)[live], hot[STATE_ROWS[live]])
    np.testing.assert_array_equal(np.asarray(batch.live), live)


@pytest.mark.parametrize("residency", RESIDENCIES, ids=lambda r: r.name)
def test_write_stores_each_live_row_at_its_position_through_the_resident_table(residency):
    cache, batch, _, (_, res, _) = _setup(residency, positions=(9, 0, 20))
    before = [np.asarray(c).reshape(-1, W).copy() for c in cache.caches]
    values = jnp.asarray(np.random.default_rng(2).standard_normal((3, W)), jnp.float32)
    cache = cache.write(1, values, batch)
    after = [np.asarray(c).reshape(-1, W) for c in cache.caches]
    expected = before[1].copy()
    for n, s in enumerate(STATE_ROWS):
        row = _flat(res[s], int(batch.positions[n])) if s >= 0 else -1
        if row >= 0:  # padding rows (and positions on a page read from host) write nothing
            expected[row] = np.asarray(values[n])
    np.testing.assert_array_equal(after[1], expected)
    np.testing.assert_array_equal(after[0], before[0])  # other layers untouched
    assert cache.residency == residency


def _topk():
    # Per batch row: positions on resident pages (0..3, 20..23) and on host pages, -1 padding.
    return jnp.asarray([[1, 6, 21, 9, 14, -1, 17, 3],
                        [0, 1, 2, 3, 4, 5, 6, 7],
                        [22, 5, 10, -1, -1, 0, 15, 19]], jnp.int32)


def _check_lookup(cache, found, topk, host, tables, layers=range(LAYERS)):
    """Every selected row: resident -> its resident row; from host -> a hot-region row that
    holds the host row in every layer of the group (`layers`). Returns the host entries per
    batch row."""
    src, res, hot = tables
    rows = np.asarray(found.attention_rows)
    caches = [np.asarray(c).reshape(-1, W) for c in cache.caches]
    from_host = np.zeros(len(STATE_ROWS), np.int64)
    for n, s in enumerate(STATE_ROWS):
        for k, t in enumerate(np.asarray(topk)[n]):
            if s < 0 or t < 0:
                assert rows[n, k] == -1
                continue
            resident = _flat(res[s], t)
            if resident >= 0:
                assert rows[n, k] == resident
                continue
            from_host[n] += 1
            assert rows[n, k] // B in hot[s], (n, k, rows[n, k])
            for layer in layers:
                np.testing.assert_array_equal(
                    caches[layer][rows[n, k]], host[layer].reshape(-1, W)[_flat(src[s], t)])
    return from_host


def test_all_resident_lookup_maps_positions_through_the_resident_table():
    cache, batch, _, (_, res, _) = _setup(AllResident())
    topk = _topk()
    new, found = cache.lookup(0, topk, batch)
    expected = [[_flat(res[s], int(t)) if s >= 0 else -1 for t in np.asarray(topk)[n]]
                for n, s in enumerate(STATE_ROWS)]
    np.testing.assert_array_equal(np.asarray(found.attention_rows), expected)
    assert not np.asarray(found.hits).any() and not np.asarray(found.misses).any()
    assert new is cache


@pytest.mark.parametrize("packed", [False, True], ids=["pool_per_layer", "packed_pool"])
@pytest.mark.parametrize("residency", [HiSparse(), NaiveOffload()], ids=lambda r: r.name)
def test_host_lookups_copy_misses_into_every_layer_and_reuse_only_with_hisparse(residency,
                                                                                packed):
    cache, batch, host, tables = _setup(residency, packed=packed)
    topk = _topk()
    cache, found = cache.lookup(0, topk, batch)
    from_host = _check_lookup(cache, found, topk, host, tables)
    assert from_host.sum() > 0
    np.testing.assert_array_equal(np.asarray(found.misses), from_host)
    assert not np.asarray(found.hits).any()
    # The same selection again: HiSparse finds every host row in the hot region; the naive
    # baseline empties the hot state and copies them all again.
    cache, again = cache.lookup(0, topk, batch)
    _check_lookup(cache, again, topk, host, tables)
    hits, misses = np.asarray(again.hits), np.asarray(again.misses)
    if isinstance(residency, HiSparse):
        np.testing.assert_array_equal(hits, from_host)
        assert not misses.any()
    else:
        np.testing.assert_array_equal(misses, from_host)
        assert not hits.any()


def test_group_pools_picks_each_groups_arrays_and_names_a_bad_split():
    _, batch, _, _ = _setup(HiSparse())
    pools = batch.host_pools
    four = dataclasses.replace(batch, host_pools=pools * 2)        # 4 arrays, 4 layers
    assert four.group_pools(1, 2, 4) == pools                         # layers 2, 3
    two = dataclasses.replace(batch, host_pools=pools)                # 2 arrays: G = 2
    assert two.group_pools(1, 2, 4) == pools[1:]
    assert two.group_pools(0, 4, 4) == pools
    with pytest.raises(ValueError, match="2 arrays for 4 layers in index groups of 1"):
        two.group_pools(0, 1, 4)
    with pytest.raises(ValueError, match="2 arrays for 3 layers"):
        two.group_pools(0, 3, 3)


def test_hisparse_lookup_drops_the_hot_copy_of_a_rewritten_row():
    cache, batch, host, tables = _setup(HiSparse())
    topk = _topk()
    cache, first = cache.lookup(0, topk, batch)
    src = tables[0]
    assert _flat(src[2], 9) in np.asarray(cache.hot[0].slot_rows)[2]  # position 9 is hot
    # The next step rewrites position 9 of batch row 0 (state row 2): its hot copy is stale,
    # so selecting it again is a miss; every other host row is still a hit.
    batch = dataclasses.replace(batch, positions=jnp.asarray([9, 0, 0], jnp.int32))
    cache, found = cache.lookup(0, topk, batch)
    _check_lookup(cache, found, topk, host, tables)
    np.testing.assert_array_equal(np.asarray(found.misses), [1, 0, 0])
    np.testing.assert_array_equal(np.asarray(found.hits),
                                  np.asarray(first.misses) - [1, 0, 0])


def test_all_resident_and_hisparse_read_the_same_rows_when_every_row_is_on_host():
    # The same context: all-resident on the device, HiSparse only in the host pools.
    base, base_batch, _, _ = _setup(AllResident())
    cache, batch, _, _ = _setup(HiSparse())
    batch = dataclasses.replace(batch, res=jnp.zeros_like(batch.res))  # nothing resident
    topk = _topk()
    base, want = base.lookup(0, topk, base_batch)
    cache, got = cache.lookup(0, topk, batch)
    assert int(got.misses.sum()) == int((topk[STATE_ROWS >= 0] >= 0).sum())
    for layer in range(LAYERS):
        a = np.asarray(base.caches[layer]).reshape(-1, W)[np.asarray(want.attention_rows)]
        b = np.asarray(cache.caches[layer]).reshape(-1, W)[np.asarray(got.attention_rows)]
        valid = np.asarray(want.attention_rows) >= 0
        np.testing.assert_array_equal(valid, np.asarray(got.attention_rows) >= 0)
        np.testing.assert_array_equal(a[valid], b[valid])


def test_the_cache_is_donated_at_a_jit_boundary_and_the_host_pools_are_not():
    cache, batch, _, _ = _setup(HiSparse())

    def _step(cache, batch, values, topk):
        cache = cache.write(0, values, batch)
        return cache.lookup(0, topk, batch)

    step = jax.jit(_step, donate_argnums=0)
    leaves = jax.tree.leaves(cache)
    new, found = step(cache, batch, jnp.ones((3, W), jnp.float32), _topk())
    assert all(x.is_deleted() for x in leaves)  # KV caches and hot states
    assert not any(p.is_deleted() for p in batch.host_pools)
    assert all(p.sharding.memory_kind == "pinned_host" for p in batch.host_pools)
    assert found.attention_rows.shape == (3, 8)
    # Residency and layout are static: another residency is another trace of the same code.
    assert jax.tree.structure(new) == jax.tree.structure(cache)
    assert jax.tree.structure(new.with_residency(AllResident())) != jax.tree.structure(new)
    assert jax.tree.leaves(new.with_residency(AllResident()))[0] is jax.tree.leaves(new)[0]


def _two_groups(residency, backend, copy_programs=None, copy_with_attention=False):
    """The setup's two layers as two index groups of one layer each, one pool per layer."""
    cache, batch, host, tables = _setup(residency)
    cache = dataclasses.replace(cache, index_group_size=1, hot=cache.hot * 2,
                                ops_backend=backend, copy_programs=copy_programs,
                                copy_with_attention=copy_with_attention)
    return cache, batch, host, tables


def _ahead_steps(cache, batch, topk):
    """Lookups in both groups, twice, group 1 first, each made ahead and then landed."""
    found = []
    for group in (1, 0, 1, 0):
        cache, pending = cache.lookup_ahead(group, topk if group else topk[::-1], batch)
        cache, f = cache.land(pending, batch)
        found.append(f)
    return cache, found


def _assert_same_runs(runs, residency, host, tables):
    """Every run (cache, the found lookups of groups 1, 0, 1, 0, then any more outputs)
    equals the first; the last run's lookups are right against the host pools and tables."""
    want_cache, *want = runs[0]
    for got_cache, *got in runs[1:]:
        chex.assert_trees_all_equal(got, want)
        chex.assert_trees_all_equal(got_cache.caches, want_cache.caches)
        chex.assert_trees_all_equal(got_cache.hot, want_cache.hot)
    found = got[0]
    if residency.reads_host:
        _check_lookup(got_cache, found[2], _topk(), host, tables, layers=[1])
        _check_lookup(got_cache, found[3], _topk()[::-1], host, tables, layers=[0])
        assert int(sum(f.misses.sum() for f in found)) > 0


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("residency", RESIDENCIES, ids=lambda r: r.name)
def test_lookups_made_ahead_equal_lookups_in_model_order(residency, backend):
    # The same four lookups by `lookup` and by lookup_ahead / land (with the copies on the
    # kernel's grid, then moved by 3 or 2 looping programs): every cache, hot state and found
    # row is the same.
    def in_order(cache, batch, topk):
        found = []
        for group in (1, 0, 1, 0):
            cache, f = cache.lookup(group, topk if group else topk[::-1], batch)
            found.append(f)
        return cache, found

    runs = []
    for steps, programs in ((in_order, None), (in_order, 3), (_ahead_steps, None),
                            (_ahead_steps, 2)):
        cache, batch, host, tables = _two_groups(residency, backend, programs)
        runs.append(jax.jit(steps)(cache, batch, _topk()))
    _assert_same_runs(runs, residency, host, tables)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("residency", RESIDENCIES, ids=lambda r: r.name)
def test_copies_run_beside_an_attention_equal_lookups_in_model_order(residency, backend):
    # copy_with_attention: lookup_ahead resolves and copies nothing; the copies run in the
    # call of the other group's attention (`attend(pending=...)`), or in `land` when no
    # attention took them. Each way the caches, hot states and found rows equal `lookup`'s in
    # model order, and the attention outputs equal a plain attention's. The float32 caches of
    # this setup run the reference attention; the kernel of the joint call has its own tests.
    q = jnp.asarray(np.random.default_rng(5).standard_normal((3, 2, W)), jnp.float32)

    def steps(cache, batch, topk, beside):
        found, outs = [], []
        for group in (1, 0, 1, 0):
            cache, pending = cache.lookup_ahead(group, topk if group else topk[::-1], batch)
            if cache.copy_with_attention and residency.reads_host:
                assert pending.plan is not None
            other = 1 - group
            rows = found[-1].attention_rows if found else jnp.full((3, 8), -1, jnp.int32)
            cache, out, _, left = cache.attend(other, q, rows, batch, sm_scale=0.5,
                                               v_width=W, backend="reference",
                                               pending=pending if beside else None)
            assert left is None if not beside else left.plan is None
            cache, f = cache.land(pending if not beside else left, batch)
            found.append(f)
            outs.append(out)
        return cache, found, outs

    runs = []
    for with_attention, beside in ((False, False), (True, False), (True, True)):
        cache, batch, host, tables = _two_groups(residency, backend,
                                                 copy_with_attention=with_attention)
        runs.append(jax.jit(steps, static_argnums=3)(cache, batch, _topk(), beside))
    _assert_same_runs(runs, residency, host, tables)  # attention outputs included
    cache, batch, _, _ = _two_groups(residency, backend, copy_with_attention=True)
    cache, pending = cache.lookup_ahead(0, _topk(), batch)
    if pending.plan is not None:
        with pytest.raises(ValueError, match="its own index group 0's copies are pending"):
            cache.attend(0, q, jnp.full((3, 8), -1, jnp.int32), batch, sm_scale=0.5,
                         v_width=W, pending=pending)


def test_attend_asks_the_registry_whether_the_copies_join_the_attention(monkeypatch):
    # Where the registry says the attention's backend has no joint op (`runs_fused` False),
    # attend runs the pending copies, then the attention alone: the same caches, outputs and
    # left-over pending as the joint op gives.
    q = jnp.asarray(np.random.default_rng(6).standard_normal((3, 2, W)), jnp.float32)
    cache, batch, _, _ = _two_groups(HiSparse(), "reference", copy_with_attention=True)
    cache, found = cache.lookup(0, _topk()[::-1], batch)
    cache, pending = cache.lookup_ahead(1, _topk(), batch)
    assert pending.plan is not None

    def attend(cache):
        return cache.attend(0, q, found.attention_rows, batch, sm_scale=0.5, v_width=W,
                            backend="reference", pending=pending)

    want = attend(cache)
    asked = []

    def no_joint_op(op, backend, *part_args, **part_kwargs):
        asked.append((op, backend, [a.shape for a in part_args], part_kwargs))
        return False

    monkeypatch.setattr(_registry, "runs_fused", no_joint_op)
    got = attend(cache)
    # Asked with the attention's flat operands (q [T, h, W], rows [R, W], ids [T, K]).
    rows = cache.caches[0].shape[0] * cache.caches[0].shape[1]
    assert asked == [("sparse_mla_decode_with_copies", "reference",
                      [q.shape, (rows, W), found.attention_rows.shape],
                      {"sm_scale": 0.5, "v_width": W, "kv_format": "bf16"})]
    chex.assert_trees_all_equal(got[0].caches, want[0].caches)
    chex.assert_trees_all_equal(got[1:], want[1:])
    assert got[3].plan is None


def test_create_follows_the_config():
    cache = HiSparseKVCache.create(CFG, num_layers=4, residency=HiSparse(), index_group_size=2,
                                   ops_backend="reference")
    assert [c.shape for c in cache.caches] == [(CFG.num_gpu_blocks, B, W)] * 4
    assert len(cache.hot) == 2 and cache.hot[0].slot_rows.shape == (S, CFG.hot_size)
    assert (cache.host_rows, cache.block_size, cache.ops_backend) == (
        CFG.num_host_blocks * B, B, "reference")
    assert CFG.max_pages == P and CFG.hot_blocks == HB
    no_sizes = dataclasses.replace(CFG, num_gpu_blocks=None, num_host_blocks=None,
                                   max_model_len=None)
    assert no_sizes.host_rows == 0
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="copy_programs must be None or an int >= 1"):
            HiSparseKVCache.create(CFG, num_layers=1, residency=HiSparse(), copy_programs=bad)
    assert HiSparseKVCache.create(CFG, num_layers=1, residency=HiSparse(),
                                  copy_programs=4).copy_programs == 4
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="copy_with_attention must be a bool"):
            HiSparseKVCache.create(CFG, num_layers=1, residency=HiSparse(),
                                   copy_with_attention=bad)
    with pytest.raises(ValueError, match="num_gpu_blocks is unknown"):
        HiSparseKVCache.create(no_sizes, num_layers=1, residency=AllResident())
    with pytest.raises(ValueError, match="max_model_len is unknown"):
        _ = no_sizes.max_pages
