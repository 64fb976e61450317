"""Block tables: only changed rows travel, and the device copy equals the scheduler's."""

import functools
import types

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host_tier.scheduler.block_tables import BlockTables
from host_tier.worker.device_tables import DeviceBlockTables, set_rows


def test_only_rows_that_changed_are_in_the_update():
    tables = BlockTables(max_num_reqs=4, max_pages=3, hot_blocks=2)
    tables.set_row("src", 1, [5, 6])
    tables.set_row("res", 1, [7])
    tables.set_row("res", 2, [])  # unchanged (already zeros): not re-sent
    update = tables.take_update()
    assert update.src.rows.tolist() == [1] and update.src.values.tolist() == [[5, 6, 0]]
    assert update.res.rows.tolist() == [1] and update.res.values.tolist() == [[7, 0, 0]]
    assert len(update.hot) == 0 and len(update) == 2
    assert len(tables.take_update()) == 0
    tables.set_row("src", 1, [5, 6])  # same content: nothing to send
    tables.set_row("src", 3, [1])
    tables.clear_row(1)
    update = tables.take_update()
    assert update.src.rows.tolist() == [1, 3]
    assert update.res.rows.tolist() == [1]
    assert update.src.values.tolist() == [[0, 0, 0], [1, 0, 0]]


def test_table_bad_input():
    tables = BlockTables(max_num_reqs=2, max_pages=2, hot_blocks=1)
    with pytest.raises(ValueError, match="group must be one of"):
        tables.set_row("hbm", 0, [])
    with pytest.raises(ValueError, match=r"state_row must be in \[0, 2\)"):
        tables.set_row("src", 2, [])
    with pytest.raises(ValueError, match="src table rows hold 2 blocks, got 3"):
        tables.set_row("src", 0, [1, 2, 3])
    with pytest.raises(ValueError, match="max_pages must be a positive int"):
        BlockTables(2, 0, 1)


def test_device_tables_follow_random_updates_sending_only_changed_rows():
    rng = np.random.default_rng(0)
    S, P, H = 9, 5, 2
    host = BlockTables(S, P, H)
    device = DeviceBlockTables(S, P, H)
    sent = 0
    for _ in range(30):
        for _ in range(rng.integers(0, 4)):
            group = ["src", "res", "hot"][rng.integers(3)]
            width = P if group != "hot" else H
            host.set_row(group, int(rng.integers(S)),
                         rng.integers(0, 50, rng.integers(0, width + 1)).tolist())
        update = host.take_update()
        sent += len(update)
        device.apply(update)
        got = device.as_numpy()
        for group in ("src", "res", "hot"):
            want = np.stack([host.row(group, s) for s in range(S)])
            np.testing.assert_array_equal(got[group], want)
            assert got[group].dtype == np.int32
    assert device.rows_sent == sent < 30 * 3 * S
    assert device.src.shape == (S, P) and device.hot.shape == (S, H)


def test_device_tables_reject_mismatched_updates():
    host = BlockTables(2, 3, 1)
    device = DeviceBlockTables(2, 4, 1)
    host.set_row("src", 0, [1])
    with pytest.raises(ValueError, match=r"src update values must have shape \(1, 4\)"):
        device.apply(host.take_update())


def test_device_tables_from_config_read_max_num_reqs_max_pages_and_hot_blocks():
    config = types.SimpleNamespace(max_num_reqs=3, max_pages=5, hot_blocks=2, block_size=4)
    device = DeviceBlockTables.from_config(config)
    assert device.src.shape == device.res.shape == (3, 5) and device.hot.shape == (3, 2)
    assert device.src.dtype == np.int32
    with pytest.raises(ValueError, match="DeviceBlockTables.from_config: config.max_pages is "
                                         "None or missing"):
        DeviceBlockTables.from_config(types.SimpleNamespace(max_num_reqs=3, hot_blocks=2))
    with pytest.raises(ValueError, match="DeviceBlockTables.hot_blocks must be a positive int"):
        DeviceBlockTables.from_config(types.SimpleNamespace(max_num_reqs=3, max_pages=5,
                                                            hot_blocks=0))


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_deferred_updates_reach_every_reader_in_order(data):
    """`defer` / `take_deferred` / `adopt` (a caller folding the update into its own jitted
    call) and the readers that apply a deferred update themselves, mixed at random with
    `apply`: the device tables always equal the scheduler's after each step, big updates
    are never folded partially, and every row is counted once."""
    S, P, H, fold = 6, 4, 2, 2
    host = BlockTables(S, P, H)
    device = DeviceBlockTables(S, P, H)
    fold_call = jax.jit(functools.partial(set_rows, size=fold), donate_argnums=(0,))
    sent = folded = 0
    for _ in range(data.draw(st.integers(1, 12))):
        for _ in range(data.draw(st.integers(0, 5))):
            group = data.draw(st.sampled_from(["src", "res", "hot"]))
            width = P if group != "hot" else H
            row = data.draw(st.integers(0, S - 1))
            host.set_row(group, row, data.draw(st.lists(st.integers(0, 50), max_size=width)))
        update = host.take_update()
        sent += len(update)
        how = data.draw(st.sampled_from(["apply", "defer_then_fold", "defer_then_read",
                                         "defer_twice"]))
        if how == "apply":
            device.apply(update)
        elif how == "defer_then_fold":
            device.defer(update, max_rows=fold)
            arrays, packed = device.take_deferred(fold)
            assert packed.shape == (device.packed_size(fold),)
            small = max(len(update.src), len(update.res), len(update.hot)) <= fold
            if small:
                folded += len(update)
            device.adopt(fold_call(arrays, jax.numpy.asarray(packed)))
        elif how == "defer_then_read":
            device.defer(update, max_rows=fold)
        else:  # a second update deferred before the first was taken: both, in order
            device.defer(update, max_rows=fold)
            host.set_row("res", 0, [7, 7])
            second = host.take_update()
            sent += len(second)
            device.defer(second, max_rows=fold)
        got = device.as_numpy()  # a reader: applies what is still deferred
        for group in ("src", "res", "hot"):
            np.testing.assert_array_equal(got[group],
                                          np.stack([host.row(group, s) for s in range(S)]))
    assert device.rows_sent == sent
    assert device.rows_folded == folded
