"""TransferEngine: spills and restores move the right rows on every layer; reports."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax.ops import mirror_rows, mirror_rows_group, restore_rows
from host_tier.plan import (
    PageRestore,
    PageSpill,
    StepPlan,
    TableRows,
    TableUpdate,
    TransferReport,
)
from host_tier.testing import mirror_rows_reference, restore_rows_reference
from host_tier.worker.host_pool import HostPool
from host_tier.worker.transfer import TransferEngine

B, W, LAYERS = 4, 3, 2

# The engine's copies: the jnp references, and the data plane's ops when `hisparse_jax` has them.
COPY_FNS = pytest.mark.parametrize("mirror_fn,restore_fn", [
    pytest.param(mirror_rows_reference, restore_rows_reference, id="reference"),
    pytest.param(mirror_rows, restore_rows, id="data_plane"),
])


def _empty_tables():
    empty = TableRows(np.zeros(0, np.int32), np.zeros((0, 1), np.int32))
    return TableUpdate(empty, empty, empty)


def _plan(spills=(), restores=(), hot_resets=(), invalidations=()):
    return StepPlan(step=0, writes=(), tables=_empty_tables(), hot_resets=tuple(hot_resets),
                    hot_invalidations=tuple(invalidations), restores=tuple(restores),
                    spills=tuple(spills))


def _caches(num_blocks=6):
    return [jnp.asarray(np.arange(num_blocks * B * W, dtype=np.float32).reshape(num_blocks, B, W)
                        + 1000 * layer) for layer in range(LAYERS)]


@pytest.fixture
def pool():
    with HostPool(num_layers=LAYERS, block_size=B, row_width=W, dtype=np.float32,
                  num_blocks=8) as pool:
        yield pool


@COPY_FNS
def test_spills_copy_whole_pages_on_every_layer_and_report(pool, mirror_fn, restore_fn):
    engine = TransferEngine(pool, mirror_fn=mirror_fn, restore_fn=restore_fn)
    kv = _caches()
    want = [np.array(k) for k in kv]
    engine.after_forward(_plan(spills=[PageSpill(7, device_block=2, host_block=5),
                                       PageSpill(8, device_block=4, host_block=1)]), kv)
    report = engine.poll(wait=True)
    assert report.enqueued == (7, 8) and report.completed == (7, 8)
    assert not engine.poll()  # each id is reported once
    for layer in range(LAYERS):
        host = pool.read_rows(layer, np.arange(8 * B)).reshape(8, B, W)
        np.testing.assert_array_equal(host[5], want[layer][2])
        np.testing.assert_array_equal(host[1], want[layer][4])
        untouched = [b for b in range(8) if b not in (1, 5)]
        assert not host[untouched].any()
        assert pool.layer(layer).sharding.memory_kind == "pinned_host"


@COPY_FNS
def test_spills_donate_the_pool_instead_of_copying_it(pool, mirror_fn, restore_fn):
    engine = TransferEngine(pool, mirror_fn=mirror_fn)
    before = pool.arrays
    engine.after_forward(_plan(spills=[PageSpill(0, 1, 1)]), _caches())
    assert all(a.is_deleted() for a in before)


def test_completion_is_reported_only_once_the_pool_arrays_are_ready(pool, monkeypatch):
    engine = TransferEngine(pool, mirror_fn=mirror_rows)
    engine.after_forward(_plan(spills=[PageSpill(3, 1, 2)]), _caches())
    array_type = type(pool.layer(0))
    real_is_ready = array_type.is_ready
    copy_running = {"layer0": True}

    def is_ready(array):  # layer 0's copy is still running
        if array is pool.layer(0) and copy_running["layer0"]:
            return False
        return real_is_ready(array)

    monkeypatch.setattr(array_type, "is_ready", is_ready)
    first = engine.poll()
    assert first.enqueued == (3,) and first.completed == ()
    assert engine.num_in_flight == 1
    copy_running["layer0"] = False
    jax.block_until_ready(pool.arrays)  # the real copies, too
    second = engine.poll()
    assert second.completed == (3,) and second.enqueued == ()
    assert engine.num_in_flight == 0


@COPY_FNS
def test_restores_copy_the_leading_rows_before_the_forward(pool, mirror_fn, restore_fn):
    engine = TransferEngine(pool, mirror_fn=mirror_fn, restore_fn=restore_fn)
    kv = _caches()
    engine.after_forward(_plan(spills=[PageSpill(0, device_block=1, host_block=6)]), kv)
    engine.poll(wait=True)
    before = [np.array(k) for k in kv]
    out = engine.before_forward(_plan(restores=[PageRestore(9, host_block=6, device_block=3,
                                                            num_rows=3)]), kv)
    assert engine.poll().enqueued == (9,)
    for layer in range(LAYERS):
        got = np.array(out[layer])
        np.testing.assert_array_equal(got[3, :3], before[layer][1, :3])
        np.testing.assert_array_equal(got[3, 3], before[layer][3, 3])  # row 3 untouched
        np.testing.assert_array_equal(np.delete(got, 3, 0), np.delete(before[layer], 3, 0))


def test_engine_errors_are_clear(pool):
    engine = TransferEngine(pool, mirror_fn=mirror_rows)
    with pytest.raises(ValueError, match="built without restore_fn"):
        engine.before_forward(_plan(restores=[PageRestore(0, 1, 1, 1)]), _caches())
    with pytest.raises(ValueError, match=r"one cache per host pool layer \(2\), got 1"):
        engine.after_forward(_plan(spills=[PageSpill(0, 1, 1)]), _caches()[:1])
    with pytest.raises(ValueError, match="mirror_fn must be callable"):
        TransferEngine(pool, mirror_fn=None)
    assert engine.before_forward(_plan(), _caches())  # nothing to restore: no restore_fn needed


# ------------------------------------------------------------------ failed copies


class _Faulty:
    """A copy function that raises on the calls named in `fail_on` (0-based call index); with
    `consume`, it deletes the array it was donated before raising (nothing recoverable)."""

    def __init__(self, copy_fn, fail_on, *, consume=None):
        self.copy_fn, self.fail_on, self.consume, self.calls = copy_fn, set(fail_on), consume, 0

    def __call__(self, *args):
        call, self.calls = self.calls, self.calls + 1
        if call in self.fail_on:
            if self.consume is not None:
                args[self.consume].delete()
            raise RuntimeError(f"copy fault on call {call}")
        return self.copy_fn(*args)


@pytest.mark.parametrize("failing_layer", [0, 1])
def test_a_raising_mirror_is_reported_failed_and_leaves_the_pool_usable(pool, failing_layer):
    mirror = _Faulty(mirror_rows_reference, fail_on=[failing_layer])
    engine = TransferEngine(pool, mirror_fn=mirror)
    kv = _caches()
    want = [np.array(k) for k in kv]
    before = pool.arrays
    engine.after_forward(_plan(spills=[PageSpill(4, 1, 2), PageSpill(5, 3, 6)]), kv)  # no raise
    report = engine.poll(wait=True)
    assert report.failed == (4, 5) and report.enqueued == () and report.completed == ()
    assert engine.num_in_flight == 0 and not engine.poll()
    # The failing layer keeps its old pool array, intact; the layers before it were copied.
    assert pool.layer(failing_layer) is before[failing_layer]
    assert not any(a.is_deleted() for a in pool.arrays)
    for layer in range(LAYERS):
        host = pool.read_rows(layer, np.arange(8 * B)).reshape(8, B, W)
        copied = layer < failing_layer
        assert np.array_equal(host[2], want[layer][1]) == copied and host[2].any() == copied
    # The engine goes on: the next spills run and complete on every layer.
    engine.after_forward(_plan(spills=[PageSpill(6, 1, 2)]), kv)
    report = engine.poll(wait=True)
    assert report.enqueued == (6,) and report.completed == (6,) and report.failed == ()
    for layer in range(LAYERS):
        np.testing.assert_array_equal(pool.read_rows(layer, np.arange(2 * B, 3 * B)),
                                      want[layer][1])


def test_a_raising_restore_is_reported_failed_and_returns_usable_caches(pool):
    restore = _Faulty(restore_rows_reference, fail_on=[1])
    engine = TransferEngine(pool, mirror_fn=mirror_rows_reference, restore_fn=restore)
    kv = _caches()
    engine.after_forward(_plan(spills=[PageSpill(0, device_block=1, host_block=6)]), kv)
    engine.poll(wait=True)
    before = [np.array(k) for k in kv]
    out = engine.before_forward(_plan(restores=[PageRestore(9, 6, 3, 3)]), kv)
    assert engine.poll().failed == (9,)
    assert out[1] is kv[1] and not kv[1].is_deleted()  # the caller's own cache, untouched
    np.testing.assert_array_equal(np.array(out[1]), before[1])
    np.testing.assert_array_equal(np.array(out[0])[3, :3], before[0][1, :3])  # layer 0 ran


def test_a_copy_that_consumed_its_array_raises_a_clear_error(pool):
    from host_tier.worker.transfer import TransferLostError

    engine = TransferEngine(pool, mirror_fn=_Faulty(mirror_rows_reference, [0], consume=1))
    with pytest.raises(TransferLostError, match="host pool array of layer 0; the pool's rows "
                                                "are lost"):
        engine.after_forward(_plan(spills=[PageSpill(0, 1, 1)]), _caches())
    assert pool.layer(0).is_deleted()
    with HostPool(num_layers=LAYERS, block_size=B, row_width=W, dtype=np.float32,
                  num_blocks=8) as fresh:
        engine = TransferEngine(fresh, mirror_fn=mirror_rows_reference,
                                restore_fn=_Faulty(restore_rows_reference, [1], consume=1))
        with pytest.raises(TransferLostError, match="KV cache of layer 1"):
            engine.before_forward(_plan(restores=[PageRestore(0, 1, 1, 1)]), _caches())


def test_spills_of_a_plan_whose_forward_did_not_run_are_reported_failed(pool):
    engine = TransferEngine(pool, mirror_fn=mirror_rows_reference)
    before = pool.arrays
    engine.fail_spills(_plan(spills=[PageSpill(3, 1, 2), PageSpill(4, 2, 3)]))
    assert engine.poll() == TransferReport(failed=(3, 4))
    assert pool.arrays == before and not any(a.is_deleted() for a in before)


@pytest.mark.parametrize("spills", [[(2, 5), (4, 1)], [(0, 3)], [(5, 0), (1, 7), (3, 2)]])
def test_one_call_for_every_layer_copies_what_one_call_per_layer_copies(spills):
    """`mirror_group_fn` (the data plane's `mirror_rows_group`: one dispatch per plan) and
    `mirror_fn` per layer leave equal pools, and the group function runs once per plan."""
    calls = []

    def group(kvs, pools, device_rows, host_rows):
        calls.append(len(kvs))
        return mirror_rows_group(kvs, pools, device_rows, host_rows)

    pools = {}
    for name, kwargs in (("per_layer", {}), ("group", {"mirror_group_fn": group})):
        with HostPool(num_layers=LAYERS, block_size=B, row_width=W, dtype=np.float32,
                      num_blocks=8) as pool:
            engine = TransferEngine(pool, mirror_fn=mirror_rows, **kwargs)
            engine.after_forward(_plan(spills=[PageSpill(i, device_block=d, host_block=h)
                                               for i, (d, h) in enumerate(spills)]), _caches())
            assert engine.poll(wait=True).completed == tuple(range(len(spills)))
            pools[name] = [np.array(pool.layer(i)) for i in range(LAYERS)]
            assert all(pool.layer(i).sharding.memory_kind == pool.sharding.memory_kind
                       for i in range(LAYERS))
    assert calls == [LAYERS]
    kv = _caches()
    for layer in range(LAYERS):
        np.testing.assert_array_equal(pools["group"][layer], pools["per_layer"][layer])
        for d, h in spills:  # and the rows are the device pages', not zeros
            np.testing.assert_array_equal(pools["group"][layer][h], np.array(kv[layer][d]))


def test_a_raising_group_mirror_fails_the_plan_and_keeps_the_pool():
    def group(kvs, pools, device_rows, host_rows):
        raise RuntimeError("injected")

    with HostPool(num_layers=LAYERS, block_size=B, row_width=W, dtype=np.float32,
                  num_blocks=8) as pool:
        before = [np.array(pool.layer(i)) for i in range(LAYERS)]
        engine = TransferEngine(pool, mirror_fn=mirror_rows, mirror_group_fn=group)
        engine.after_forward(_plan(spills=[PageSpill(3, device_block=1, host_block=2)]),
                             _caches())
        report = engine.poll()
        assert report.failed == (3,) and not report.completed
        for i in range(LAYERS):
            np.testing.assert_array_equal(np.array(pool.layer(i)), before[i])
    with pytest.raises(ValueError, match="mirror_group_fn must be callable"):
        TransferEngine(pool, mirror_fn=mirror_rows, mirror_group_fn=3)


@pytest.mark.parametrize("grouped", [False, True], ids=["per_layer_fn", "group_fn"])
@pytest.mark.parametrize("layers, per_array", [(2, 2), (4, 2)])
def test_a_packed_pool_holds_what_one_array_per_layer_holds(grouped, layers, per_array):
    """Spills (one call per layer, or one group call) and restores through a packed pool
    (`layers_per_array`) leave every layer's host rows and restored device rows equal to
    those of a pool with one array per layer."""
    spills = [PageSpill(0, device_block=2, host_block=5), PageSpill(1, device_block=4,
                                                                  host_block=1)]
    restores = [PageRestore(2, host_block=5, device_block=0, num_rows=3)]
    caches = [jnp.asarray(np.arange(6 * B * W, dtype=np.float32).reshape(6, B, W) + 1000 * i)
              for i in range(layers)]
    got = {}
    for g in (1, per_array):
        with HostPool(num_layers=layers, block_size=B, row_width=W, dtype=np.float32,
                      num_blocks=8, layers_per_array=g) as pool:
            extra = {"mirror_group_fn": mirror_rows_group} if grouped else {}
            engine = TransferEngine(pool, mirror_fn=mirror_rows, restore_fn=restore_rows,
                                    **extra)
            engine.after_forward(_plan(spills=spills), [jnp.array(c) for c in caches])
            assert engine.poll(wait=True).completed == (0, 1)
            restored = engine.before_forward(_plan(restores=restores),
                                             [jnp.array(c) for c in caches])
            got[g] = ([pool.read_rows(i, np.arange(8 * B)) for i in range(layers)],
                      [np.array(c) for c in restored])
    for layer in range(layers):
        np.testing.assert_array_equal(got[per_array][0][layer], got[1][0][layer])
        np.testing.assert_array_equal(got[per_array][1][layer], got[1][1][layer])
        # and the rows are the spilled pages' (not zeros): block 2 went to host block 5
        np.testing.assert_array_equal(got[per_array][0][layer][5 * B:6 * B],
                                      np.array(caches[layer][2]))
        np.testing.assert_array_equal(got[per_array][1][layer][0, :3],
                                      np.array(caches[layer][2][:3]))
