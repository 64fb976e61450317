"""Hot state: a plan's hot resets and invalidations (`hisparse_jax.state`)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.state import (
    HotState,
    apply_hot_updates,
    hot_updates,
    init_hot_state,
    invalidate_host_blocks,
    pack_hot_updates,
)
from host_tier.plan import HotInvalidation, StepPlan, TableRows, TableUpdate


def _plan(hot_resets=(), invalidations=()):
    empty = TableRows(np.zeros(0, np.int32), np.zeros((0, 1), np.int32))
    return StepPlan(step=0, writes=(), tables=TableUpdate(empty, empty, empty),
                    hot_resets=tuple(hot_resets), hot_invalidations=tuple(invalidations),
                    restores=(), spills=())


def test_invalidate_host_blocks_drops_only_that_rows_entries():
    slot_rows = jnp.array([[0, 5, 9, -1, 13],
                           [4, 5, 8, 12, 2],
                           [5, 6, 7, 8, 9]], jnp.int32)
    # state row 0 drops blocks 1 and 3 (rows 4..7, 12..15); row 2 drops block 2; row 1 keeps all.
    out = invalidate_host_blocks(slot_rows, jnp.array([0, 2, -1], jnp.int32),
                                 jnp.array([[1, 3], [2, -1], [1, 2]], jnp.int32), block_size=4)
    np.testing.assert_array_equal(np.array(out), [[0, -1, 9, -1, -1],
                                                  [4, 5, 8, 12, 2],
                                                  [5, 6, 7, -1, -1]])


def test_apply_hot_updates_resets_then_invalidates_every_hot_state():
    hot = HotState(slot_rows=jnp.array([[1, 9, 4], [8, 5, 11]], jnp.int32),
                   lru=jnp.array([[2, 0, 1], [1, 2, 0]], jnp.int16))
    other = HotState(slot_rows=jnp.array([[2, 3, 4], [10, 9, 1]], jnp.int32),
                     lru=jnp.array([[0, 1, 2], [2, 1, 0]], jnp.int16))
    plan = _plan(hot_resets=[0], invalidations=[HotInvalidation(1, (2,))])
    out, out2 = apply_hot_updates(plan, (hot, other), block_size=4)
    np.testing.assert_array_equal(np.array(out.slot_rows), [[-1, -1, -1], [-1, 5, -1]])
    np.testing.assert_array_equal(np.array(out.lru), [[0, 1, 2], [1, 2, 0]])
    np.testing.assert_array_equal(np.array(out2.slot_rows), [[-1, -1, -1], [-1, -1, 1]])
    np.testing.assert_array_equal(np.array(out2.lru), [[0, 1, 2], [2, 1, 0]])
    # The inputs are not donated, and an empty plan leaves the states as they are.
    again, _ = apply_hot_updates(plan, (hot, other), block_size=4)
    np.testing.assert_array_equal(np.array(again.slot_rows), np.array(out.slot_rows))
    states = (out, out2)
    assert apply_hot_updates(_plan(), states, block_size=4) is states


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_apply_hot_updates_equals_resetting_then_invalidating_row_by_row(data):
    S, H, B = 5, 6, 4
    slot_rows = np.array(data.draw(st.lists(st.integers(-1, 47), min_size=S * H,
                                            max_size=S * H)), np.int32).reshape(S, H)
    lru = np.tile(np.arange(H, dtype=np.int16)[::-1], (S, 1))
    resets = data.draw(st.lists(st.integers(0, S - 1), unique=True, max_size=S))
    inv_rows = data.draw(st.lists(st.integers(0, S - 1), unique=True, max_size=S))
    invalidations = [HotInvalidation(r, tuple(data.draw(st.lists(st.integers(0, 11), min_size=1,
                                                                  max_size=70, unique=True))))
                     for r in inv_rows]
    (out,) = apply_hot_updates(_plan(resets, invalidations),
                               (HotState(jnp.asarray(slot_rows), jnp.asarray(lru)),),
                               block_size=B)
    want_rows, want_lru = slot_rows.copy(), lru.copy()
    for r in resets:
        want_rows[r], want_lru[r] = -1, np.arange(H)
    for inv in invalidations:
        stale = np.isin(want_rows[inv.state_row] // B, inv.host_blocks) & (
            want_rows[inv.state_row] >= 0)
        want_rows[inv.state_row][stale] = -1
    np.testing.assert_array_equal(np.array(out.slot_rows), want_rows)
    np.testing.assert_array_equal(np.array(out.lru), want_lru)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_a_small_packed_update_equals_apply_hot_updates_and_a_large_one_does_not_pack(data):
    """`pack_hot_updates` + `hot_updates` with R rows of width W (what a decode step folds
    into its executable) apply exactly what `apply_hot_updates` applies; a plan that does not
    fit R x W packs to None, and no plan packs to padding that changes nothing."""
    S, H, B, R, W = 6, 5, 4, 3, 2
    slot_rows = np.array(data.draw(st.lists(st.integers(-1, 47), min_size=S * H,
                                            max_size=S * H)), np.int32).reshape(S, H)
    lru = np.tile(np.arange(H, dtype=np.int16)[::-1], (S, 1))
    states = (HotState(jnp.asarray(slot_rows), jnp.asarray(lru)),
              HotState(jnp.asarray(slot_rows[::-1].copy()), jnp.asarray(lru)))
    resets = data.draw(st.lists(st.integers(0, S - 1), unique=True, max_size=S))
    inv_rows = data.draw(st.lists(st.integers(0, S - 1), unique=True, max_size=S))
    invalidations = [HotInvalidation(r, tuple(data.draw(st.lists(st.integers(0, 11), min_size=1,
                                                                  max_size=3, unique=True))))
                     for r in inv_rows]
    plan = _plan(resets, invalidations)
    packed = pack_hot_updates(plan, R, W)
    fits = (len(resets) <= R and len(inv_rows) <= R
            and all(len(inv.host_blocks) <= W for inv in invalidations))
    assert (packed is not None) == fits
    if packed is not None:
        got = hot_updates(states, jnp.asarray(packed), block_size=B, num_rows=R)
        want = apply_hot_updates(plan, states, block_size=B)
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.array(g.slot_rows), np.array(w.slot_rows))
            np.testing.assert_array_equal(np.array(g.lru), np.array(w.lru))
    none = hot_updates(states, jnp.asarray(pack_hot_updates(None, R, W)), block_size=B,
                       num_rows=R)
    for g, w in zip(none, states, strict=True):
        np.testing.assert_array_equal(np.array(g.slot_rows), np.array(w.slot_rows))


def test_hot_state_of_a_config_is_empty():
    state = init_hot_state(HiSparseConfig(top_k=2, hot_size=8, block_size=4, max_num_reqs=3,
                                          row_width=8))
    assert state.slot_rows.shape == (3, 8) and (np.array(state.slot_rows) == -1).all()
    np.testing.assert_array_equal(np.array(state.lru), np.tile(np.arange(8), (3, 1)))
