"""Index groups of unequal size (`hisparse_jax.index_groups`, the KV-cache handle's
`group_layers`): the layout functions, the handle's per-group lookups, hot states and host
pool slices, and the engine's rows-moved count."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.cache import AllResident, CacheBatch, HiSparse, HiSparseKVCache, NaiveOffload
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.index_groups import (
    checked_group_layers,
    group_slice,
    layer_group,
    layer_rows,
    layers_per_pool_array,
    packed_layers,
)
from host_tier import memory_sharding

S, B, P, HB, W = 2, 4, 6, 4, 8
CFG = HiSparseConfig(top_k=6, hot_size=HB * B, block_size=B, max_num_reqs=S, row_width=W,
                     kv_dtype="float32", max_model_len=P * B, num_gpu_blocks=1 + S * (P + HB),
                     num_host_blocks=1 + S * P)
STATE_ROWS = np.array([1, 0], np.int32)
RESIDENT_PAGES = (0, 5)  # the other pages are read from host


def test_layout_functions_place_layers_in_groups_of_unequal_size():
    groups = (1, 2, 2)  # GLM-5: full, full, shared, full, shared
    assert [group_slice(groups, g) for g in range(3)] == [slice(0, 1), slice(1, 3),
                                                          slice(3, 5)]
    assert [layer_group(groups, layer) for layer in range(5)] == [
        (0, 0), (1, 0), (1, 1), (2, 0), (2, 1)]
    with pytest.raises(ValueError, match="layer 5 is out of range: there are 5 layers"):
        layer_group(groups, 5)
    with pytest.raises(ValueError, match="index group 3 is out of range"):
        group_slice(groups, 3)
    assert packed_layers(groups) == 1 and packed_layers((2, 4)) == 2
    assert packed_layers((2, 2)) == 2
    assert layers_per_pool_array(5, 5, groups) == 1
    assert layers_per_pool_array(3, 6, (2, 4)) == 2
    with pytest.raises(ValueError, match=r"1 arrays for 5 layers in index groups of "
                                         r"\(1, 2, 2\) layers.*dividing every index group"):
        layers_per_pool_array(1, 5, groups)
    with pytest.raises(ValueError, match="2 arrays for 6 layers in index groups of"):
        layers_per_pool_array(2, 6, (2, 4))  # 3 layers per array would straddle groups
    assert checked_group_layers(4, 2) == (2, 2)
    assert checked_group_layers(5, group_layers=(1, 2, np.int64(2))) == groups
    for bad in ((1, 2), (0, 5), (1.0, 4), ()):
        with pytest.raises(ValueError, match="group_layers must be positive ints adding up "
                                             "to num_layers=5"):
            checked_group_layers(5, group_layers=bad)
    with pytest.raises(ValueError, match="index_group_size must be a positive int dividing"):
        checked_group_layers(5, 2)
    with pytest.raises(ValueError, match="differs from group_layers"):
        checked_group_layers(4, 2, (1, 3))


def test_layer_rows_weigh_each_groups_counts_by_its_layers():
    assert int(layer_rows(np.array([3, 5, 1]), (1, 2, 2))) == 3 + 10 + 2
    assert int(layer_rows(jnp.array([[1, 2], [3, 4]]), (1, 3))) == 3 + 21  # [G, ...]
    assert int(layer_rows(7, (2, 2))) == 14  # equal groups: any shape, a total will do
    assert int(layer_rows(np.ones((3, 4), np.int32), (2, 2))) == 24
    with pytest.raises(ValueError, match=r'aux\["misses"\] must be counted per index group '
                                         r"\(leading dim 2\).*got shape \(\)"):
        layer_rows(5, (1, 2), what='aux["misses"]')
    from hisparse_jax.engine.metrics import Metrics  # the engine's counters (needs flax)

    m = Metrics()
    m.record_decode(fast=False, hits=1, misses=4, rows=int(layer_rows(np.array([1, 3]), (1, 2))),
                    row_bytes=10)
    assert (m.hot_misses, m.rows_moved, m.bytes_moved) == (4, 7, 70)
    m.record_staged(4, 1, row_bytes=10, host_layer_rows=7)
    assert (m.staged_rows_host, m.staged_bytes_host) == (4, 70)


def test_create_builds_a_hot_state_per_group_and_keeps_one_representation():
    cache = HiSparseKVCache.create(CFG, num_layers=5, residency=HiSparse(),
                                   group_layers=(1, 2, 2))
    assert len(cache.caches) == 5 and len(cache.hot) == cache.num_groups == 3
    assert cache.group_sizes == (1, 2, 2) and cache.index_group_size == 0
    assert cache.group_slice(2) == slice(3, 5) and cache.layer_group(2) == (1, 1)
    # Equal counts are the index_group_size layout: the same static fields, the same trace.
    equal = HiSparseKVCache.create(CFG, num_layers=4, residency=HiSparse(), group_layers=(2, 2))
    old = HiSparseKVCache.create(CFG, num_layers=4, residency=HiSparse(), index_group_size=2)
    assert jax.tree.structure(equal) == jax.tree.structure(old)
    assert (equal.group_layers, equal.index_group_size, equal.group_sizes) == (None, 2, (2, 2))
    assert old.layer_group(3) == (1, 1) and old.group_slice(1) == slice(2, 4)
    # A handle rebuilt with other groups takes its layout from them.
    uneven = dataclasses.replace(old, group_layers=(1, 3), hot=old.hot)
    assert (uneven.index_group_size, uneven.group_sizes) == (0, (1, 3))
    assert jax.tree.structure(uneven) != jax.tree.structure(old)
    with pytest.raises(ValueError, match="group_layers must be positive ints adding up to "
                                         "num_layers=5"):
        HiSparseKVCache.create(CFG, num_layers=5, residency=HiSparse(), group_layers=(2, 2))


def _setup(groups, residency, *, pack=1):
    """A handle over layers in index groups of `groups` layers whose resident pages hold the
    host rows of the same pages, host pools of `pack` layers per array, and a batch that
    writes on the last (resident) page."""
    num_layers = sum(groups)
    rng = np.random.default_rng(3)
    host = [rng.standard_normal((CFG.num_host_blocks, B, W)).astype(np.float32)
            for _ in range(num_layers)]
    pinned = memory_sharding(jax.devices()[0], "pinned_host")
    arrays = [np.concatenate(host[a:a + pack], -1) for a in range(0, num_layers, pack)]
    pools = tuple(jax.device_put(a, pinned) for a in arrays)
    s = np.arange(S)[:, None]
    pages = (1 + s * P + np.arange(P)).astype(np.int32)
    src, res = pages.copy(), pages.copy()
    res[:, [p for p in range(P) if p not in RESIDENT_PAGES]] = 0
    hot = (1 + S * P + s * HB + np.arange(HB)).astype(np.int32)
    cache = HiSparseKVCache.create(CFG, num_layers=num_layers, residency=residency,
                                   group_layers=groups)
    rows = (pages.ravel()[:, None] * B + np.arange(B)).ravel()
    for layer in range(num_layers):
        cache = cache.write_rows(layer, jnp.asarray(rows, jnp.int32),
                                 jnp.asarray(host[layer].reshape(-1, W)[rows]))
    batch = CacheBatch.from_tables(jnp.asarray(STATE_ROWS), jnp.asarray([21, 22], jnp.int32),
                                   src=jnp.asarray(src), res=jnp.asarray(res),
                                   hot=jnp.asarray(hot), host_pools=pools)
    return cache, batch, host, src


def _topk(seed):
    """Distinct causal positions per batch row (row positions 21, 22), a -1 at the end."""
    rng = np.random.default_rng(seed)
    topk = np.stack([rng.permutation(21)[:CFG.top_k] for _ in range(S)]).astype(np.int32)
    topk[:, -1] = -1
    return jnp.asarray(topk)


def _check(cache, found, topk, host, src, layers):
    """Every layer of `layers` reads, at the lookup's rows, the host rows of the selected
    positions (which the resident pages also hold)."""
    rows, topk = np.asarray(found.attention_rows), np.asarray(topk)
    np.testing.assert_array_equal(rows >= 0, topk >= 0)
    for layer in layers:
        got = np.asarray(cache.caches[layer]).reshape(-1, W)
        for i, s in enumerate(STATE_ROWS):
            for k, t in enumerate(topk[i]):
                if t >= 0:
                    want = host[layer].reshape(-1, W)[src[s][t // B] * B + t % B]
                    np.testing.assert_array_equal(got[rows[i, k]], want,
                                                  err_msg=f"layer {layer}, row {i}, pos {t}")


@pytest.mark.parametrize("groups,pack", [((1, 2), 1), ((2, 1, 1), 1), ((2, 4), 2)],
                         ids=["1-2", "2-1-1", "2-4-packed"])
def test_lookups_of_uneven_groups_copy_into_their_own_layers(groups, pack):
    cache, batch, host, src = _setup(groups, HiSparse(), pack=pack)
    assert cache.group_pools(len(groups) - 1, batch) == batch.host_pools[
        (sum(groups) - groups[-1]) // pack:]
    for g in reversed(range(len(groups))):
        before = cache
        topk = _topk(g)
        cache, found = cache.lookup(g, topk, batch)
        assert int(found.misses.sum()) > 0
        layers = range(sum(groups))[cache.group_slice(g)]
        _check(cache, found, topk, host, src, layers)
        for other in range(len(groups)):  # only this group's hot state moved
            moved = not np.array_equal(np.asarray(cache.hot[other].slot_rows),
                                       np.asarray(before.hot[other].slot_rows))
            assert moved == (other == g), (g, other)
        for layer in set(range(sum(groups))) - set(layers):  # no other layer was written
            np.testing.assert_array_equal(np.asarray(cache.caches[layer]),
                                          np.asarray(before.caches[layer]))
        # The group's hot state serves the next step: the same selection hits.
        cache, again = cache.lookup(g, topk, batch)
        np.testing.assert_array_equal(np.asarray(again.hits), np.asarray(found.misses))
        _check(cache, again, topk, host, src, layers)


@pytest.mark.parametrize("residency", [AllResident(), NaiveOffload()], ids=lambda r: r.name)
def test_other_residencies_read_the_same_rows_in_uneven_groups(residency):
    cache, batch, host, src = _setup((1, 2), residency)
    if not residency.reads_host:
        batch = dataclasses.replace(batch, res=batch.src)  # every page resident
    for g in (1, 0):
        cache, found = cache.lookup(g, _topk(g), batch)
        _check(cache, found, _topk(g), host, src, range(3)[cache.group_slice(g)])


def test_copies_beside_an_attention_land_in_the_pending_groups_layers():
    # copy_with_attention: group 1 (layers 1, 2) is looked up ahead; its copies run in the
    # launch of layer 0's attention (group 0), and layer 1 may not attend before it lands.
    groups = (1, 2)
    cache, batch, host, src = _setup(groups, HiSparse())
    cache = dataclasses.replace(cache, copy_with_attention=True)
    cache, first = cache.lookup(0, _topk(0), batch)
    cache, pending = cache.lookup_ahead(1, _topk(1), batch)
    assert pending.plan is not None
    q = jnp.ones((S, 2, W), jnp.float32)
    with pytest.raises(ValueError, match="layer 1 attends while its own index group 1"):
        cache.attend(1, q, first.attention_rows, batch, sm_scale=1.0, v_width=W,
                     pending=pending)
    cache, _, _, pending = cache.attend(0, q, first.attention_rows, batch, sm_scale=1.0,
                                        v_width=W, pending=pending)
    cache, found = cache.land(pending, batch)
    _check(cache, found, _topk(1), host, src, (1, 2))
    _check(cache, first, _topk(0), host, src, (0,))
