"""resolve_residency: every backend against the loop oracle and the canonical facts; the Triton
kernel against the jnp reference exactly (poisoned outputs, tuning variants), its lowering for
CUDA, and the GPU-scale runs."""

from __future__ import annotations

import functools
import re
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.experimental import checkify

import hisparse_jax as hs
from bench.ops.resolve_residency import RESOLVE_VARIANTS
from pallas_kernels.resolve_residency import reference as ref_module
from pallas_kernels.resolve_residency import triton as tk
from pallas_kernels.resolve_residency import union as union_module
from tests.ops import INTERPRET, POISON, backends, examples, lower_for_cuda, sds
from tests.oracle import (
    OVERLAPS,
    host_row,
    oracle_resolve,
    oracle_resolve_union,
    random_case,
    random_union_case,
)

BACKENDS = backends("resolve_residency")
# (K, H / K) pairs of the reference's oracle test: K = 1, K around 32 and 64 and the real K,
# each once, and H = K, 2K and 5K three times each (both block sizes among them). The reference
# is whole-array jnp code whose only branch on K is K = 0 (never drawn), so it needs no
# product of the Ks and multiples; each pair is one compile (~1 s off the GPU).
REFERENCE_SHAPES = [(1, 5), (31, 1), (32, 2), (33, 5), (63, 1), (64, 2), (65, 5), (128, 1),
                    (2048, 2)]
# Kernels run in the interpreter off the GPU (one compile per shape, ~3 s): three (K, H / K)
# pairs that still cover K = H = 1, odd K with H = 5K, and the real K.
KERNEL_SHAPES = [(1, 1), (65, 5), (2048, 2)]
OUTPUT_FIELDS = ("attention_rows", "valid_counts", "swap_src", "swap_dst", "swap_counts",
                 "num_hits")
NAMES = OUTPUT_FIELDS + ("slot_rows", "lru")


def run_public(case, backend="reference", **kw):
    state = hs.HotState(jnp.asarray(case.slot_rows), jnp.asarray(case.lru))
    res_table = None if case.res_table is None else jnp.asarray(case.res_table)
    return hs.resolve_residency(
        state, jnp.asarray(case.topk), state_rows=jnp.asarray(case.state_rows),
        hot_block_table=jnp.asarray(case.hot_table),
        source_block_table=jnp.asarray(case.src_table), resident_block_table=res_table,
        block_size=case.block_size, host_rows=case.host_rows, backend=backend, **kw)


def assert_matches_oracle(case, resolution, state, rows_per_request=1):
    if rows_per_request == 1:
        want, want_rows, want_lru = oracle_resolve(*case.args(), case.block_size,
                                                   case.host_rows)
    else:
        want, want_rows, want_lru = oracle_resolve_union(
            *case.args(), case.block_size, case.host_rows, rows_per_request)
    for field in OUTPUT_FIELDS:
        np.testing.assert_array_equal(np.asarray(getattr(resolution, field)), want[field],
                                      err_msg=field)
    np.testing.assert_array_equal(np.asarray(state.slot_rows), want_rows, err_msg="slot_rows")
    np.testing.assert_array_equal(np.asarray(state.lru), want_lru, err_msg="lru (exact order)")
    assert state.lru.dtype == jnp.int16 and state.slot_rows.dtype == jnp.int32


# ----------------------------------------------------------------------------- loop oracle


@pytest.mark.parametrize("backend", BACKENDS)
@given(seed=st.integers(0, 2**32 - 1), data=st.data(),
       resident_share=st.sampled_from([0.0, 0.4]), corrupt_lru=st.booleans())
def test_matches_oracle(backend, seed, data, resident_share, corrupt_lru):
    # One compiled shape per (k, mult): every example is 4 batch rows, padding included.
    if backend == "reference":
        k, mult = data.draw(st.sampled_from(REFERENCE_SHAPES), label="k, mult")
    else:
        k, mult = data.draw(st.sampled_from(KERNEL_SHAPES), label="k, mult")
    rng = np.random.default_rng(seed)
    block_size = 4 if k < 64 else 16
    src_blocks = max(1, (k + k // 2) // block_size)
    case = random_case(rng, n=4, k=k, hot=k * mult, block_size=block_size,
                       src_blocks=src_blocks, resident_share=resident_share,
                       corrupt_lru=corrupt_lru)
    # A corrupt LRU breaks the permutation rule the default check enforces: unchecked, the
    # op follows `docs/semantics.md` (out-of-range ids are evictable, their misses dropped).
    resolution, state = run_public(case, backend, validate=False if corrupt_lru else None)
    assert_matches_oracle(case, resolution, state)


@pytest.mark.parametrize("backend", BACKENDS)
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(2, 6))
def test_matches_oracle_over_steps(backend, seed, steps):
    """State carried across steps (a realistic LRU) with topk sets drawn from a small pool."""
    rng = np.random.default_rng(seed)
    n, k, hot, b = 3, 32, 64, 8
    case = random_case(rng, n=n, k=k, hot=hot, block_size=b, src_blocks=12)
    for _ in range(steps):
        fresh = random_case(rng, n=n, k=k, hot=hot, block_size=b, src_blocks=12,
                            resident_share=float(rng.choice([0.0, 0.4])))
        case.topk, case.res_table = fresh.topk, fresh.res_table
        resolution, state = run_public(case, backend)
        assert_matches_oracle(case, resolution, state)
        case.slot_rows, case.lru = np.asarray(state.slot_rows), np.asarray(state.lru)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resident_table_is_optional(backend):
    rng = np.random.default_rng(3)
    case = random_case(rng, n=2, k=8, hot=16, block_size=4, src_blocks=4)
    case.res_table = None
    resolution, state = run_public(case, backend)
    assert_matches_oracle(case, resolution, state)


# ----------------------------------------------------------------------------- canonical


def identity_setup(k, hot, b, n=1):
    """Positions 0..K-1 over host blocks 1.. (g = B + t) and hot blocks 100..."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not a multiple of block_size")
        cfg = hs.HiSparseConfig(top_k=k, hot_size=hot, block_size=b, max_num_reqs=n,
                                row_width=8, kv_dtype="float32")
    blocks = -(-4 * k // b)
    src = jnp.tile(jnp.arange(1, blocks + 1, dtype=jnp.int32), (n, 1))
    hot_table = jnp.tile(jnp.arange(100, 100 + cfg.hot_blocks, dtype=jnp.int32), (n, 1))
    kw = dict(state_rows=jnp.arange(n, dtype=jnp.int32), hot_block_table=hot_table,
              source_block_table=src, block_size=b, host_rows=(blocks + 1) * b)
    return cfg, kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k,hot", [(4, 8), (32, 32), (64, 160), (2048, 4096)])
def test_cold_start(k, hot, backend):
    b = 16
    cfg, kw = identity_setup(k, hot, b)
    topk = jnp.arange(k, dtype=jnp.int32)[None]
    res, state = hs.resolve_residency(hs.init_hot_state(cfg), topk, backend=backend, **kw)
    slots = np.arange(k)
    np.testing.assert_array_equal(res.attention_rows[0], 100 * b + slots)   # column i -> slot i
    np.testing.assert_array_equal(res.swap_src[0], b + slots)               # swap_src == g
    np.testing.assert_array_equal(res.swap_dst[0], 100 * b + slots)
    np.testing.assert_array_equal(state.lru[0], np.roll(np.arange(hot), -k))
    assert int(res.swap_counts[0]) == k and int(res.num_hits[0]) == 0
    assert int(res.valid_counts[0]) == k


@pytest.mark.parametrize("backend", BACKENDS)
def test_cold_start_then_replay_is_fixed_point(backend):
    k, hot, block = 8, 12, 4
    cfg = hs.HiSparseConfig(top_k=k, hot_size=hot, block_size=block, max_num_reqs=2)
    state = hs.init_hot_state(cfg)
    topk = jnp.arange(k, dtype=jnp.int32)[None]
    kw = dict(state_rows=jnp.array([1], jnp.int32),
              hot_block_table=jnp.array([[5, 6, 7]], jnp.int32),
              source_block_table=jnp.array([[3, 4]], jnp.int32),
              block_size=block, host_rows=64, backend=backend)
    res, state = hs.resolve_residency(state, topk, **kw)
    g = np.array([3 * 4 + i for i in range(4)] + [4 * 4 + i for i in range(4)])
    np.testing.assert_array_equal(np.asarray(res.swap_src)[0], g)
    np.testing.assert_array_equal(np.asarray(res.attention_rows)[0],
                                  [20, 21, 22, 23, 24, 25, 26, 27])      # slot i -> row
    np.testing.assert_array_equal(np.asarray(state.lru)[1], np.roll(np.arange(hot), -k))
    res2, state2 = hs.resolve_residency(state, topk, **kw)
    assert int(res2.swap_counts[0]) == 0 and int(res2.num_hits[0]) == k
    np.testing.assert_array_equal(np.asarray(res2.attention_rows), np.asarray(res.attention_rows))
    np.testing.assert_array_equal(np.asarray(state2.slot_rows), np.asarray(state.slot_rows))
    np.testing.assert_array_equal(np.asarray(state2.lru), np.asarray(state.lru))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k,hot", [(33, 66), (2048, 4096)])
def test_warm_replay_is_a_fixed_point(k, hot, backend):
    cfg, kw = identity_setup(k, hot, 16)
    rng = np.random.default_rng(0)
    topk = jnp.asarray(rng.permutation(2 * k)[:k][None].astype(np.int32))
    first, state = hs.resolve_residency(hs.init_hot_state(cfg), topk, backend=backend, **kw)
    again, state2 = hs.resolve_residency(state, topk, backend=backend, **kw)
    assert int(again.swap_counts[0]) == 0 and int(again.num_hits[0]) == k
    np.testing.assert_array_equal(again.attention_rows, first.attention_rows)
    np.testing.assert_array_equal(again.swap_src, -1)
    chex.assert_trees_all_equal(state2, state)


@pytest.mark.parametrize("backend", BACKENDS)
def test_drifting_window_evicts_only_the_oldest(backend):
    k, hot, b, drift = 64, 128, 8, 5
    cfg, kw = identity_setup(k, hot, b)
    state = hs.init_hot_state(cfg)
    for step in range(20):
        topk = jnp.arange(step * drift, step * drift + k, dtype=jnp.int32)[None]
        old_lru = np.asarray(state.lru[0])
        old_rows = np.asarray(state.slot_rows[0])
        res, state = hs.resolve_residency(state, topk, backend=backend, **kw)
        misses = int(res.swap_counts[0])
        assert misses == (k if step == 0 else drift)
        assert int(res.num_hits[0]) == k - misses
        changed = np.flatnonzero(np.asarray(state.slot_rows[0]) != old_rows)
        filled = np.asarray(res.swap_dst[0, :misses]) - 100 * b               # slot ids
        # The misses took exactly the oldest `misses` slots, in LRU order.
        np.testing.assert_array_equal(filled, old_lru[:misses])
        new_rows = np.asarray(state.slot_rows[0])
        np.testing.assert_array_equal(np.sort(changed),
                                      np.sort(filled[old_rows[filled] != new_rows[filled]]))
        # Newest positions are the hits, in their old order, after the fresh fills.
        new_lru = np.asarray(state.lru[0])
        np.testing.assert_array_equal(new_lru[hot - k: hot - k + misses], filled)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fully_resident_rows_leave_state_untouched(backend):
    k, hot, b = 32, 64, 8
    cfg, kw = identity_setup(k, hot, b, n=2)
    kw["backend"] = backend
    state0 = hs.init_hot_state(cfg)
    topk = jnp.tile(jnp.arange(k, dtype=jnp.int32), (2, 1))
    _, warm = hs.resolve_residency(state0, topk, **kw)         # some hot content
    resident = jnp.tile(jnp.arange(500, 500 + kw["source_block_table"].shape[1],
                                   dtype=jnp.int32), (2, 1))
    res, state = hs.resolve_residency(warm, topk + k, resident_block_table=resident, **kw)
    chex.assert_trees_all_equal(state, warm)
    want_rows = np.tile(500 * b + np.arange(k, 2 * k), (2, 1))
    np.testing.assert_array_equal(res.attention_rows, want_rows)
    np.testing.assert_array_equal(res.swap_counts, 0)
    np.testing.assert_array_equal(res.num_hits, 0)
    np.testing.assert_array_equal(res.valid_counts, k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_rows_output_nothing_and_keep_state(backend):
    k, hot, b = 8, 16, 4
    cfg, kw = identity_setup(k, hot, b, n=2)
    kw["state_rows"] = jnp.array([-1, 1], jnp.int32)
    topk = jnp.tile(jnp.arange(k, dtype=jnp.int32), (2, 1))
    state0 = hs.init_hot_state(cfg)
    res, state = hs.resolve_residency(state0, topk, backend=backend, **kw)
    np.testing.assert_array_equal(res.attention_rows[0], -1)
    assert int(res.valid_counts[0]) == 0 and int(res.swap_counts[0]) == 0
    np.testing.assert_array_equal(state.slot_rows[0], state0.slot_rows[0])
    np.testing.assert_array_equal(state.lru[0], state0.lru[0])
    assert int(res.swap_counts[1]) == k


# ----------------------------------------------------------------------------- jit / traces


class ReferenceVariantsTest(chex.TestCase):
    """The reference function itself, with and without jit (the kernels are always jitted
    through the op)."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_reference_function_variants(self):
        rng = np.random.default_rng(7)
        case = random_case(rng, n=3, k=16, hot=32, block_size=4, src_blocks=6,
                           resident_share=0.4)
        fn = self.variant(lambda *a: ref_module.resolve_residency(
            *a, block_size=case.block_size, host_rows=case.host_rows))
        out = fn(*[jnp.asarray(x) for x in case.args()])
        chex.assert_shape(out[0], (3, 16))
        chex.assert_shape(out[6], case.slot_rows.shape)
        want, want_rows, want_lru = oracle_resolve(*case.args(), case.block_size,
                                                   case.host_rows)
        for got, field in zip(out[:6], OUTPUT_FIELDS, strict=True):
            np.testing.assert_array_equal(got, want[field])
        np.testing.assert_array_equal(out[6], want_rows)
        np.testing.assert_array_equal(out[7], want_lru)


@pytest.mark.parametrize("backend", BACKENDS)
def test_public_op_traces_once_per_shape(backend):
    cfg, kw = identity_setup(16, 32, 4, n=2)

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(state, topk):
        return hs.resolve_residency(state, topk, backend=backend, **kw)

    state = hs.init_hot_state(cfg)
    for shift in range(3):
        topk = jnp.tile(jnp.arange(shift, shift + 16, dtype=jnp.int32), (2, 1))
        _, state = step(state, topk)
    chex.clear_trace_counter()


@pytest.mark.parametrize("backend", BACKENDS)
def test_usable_under_jit_with_donated_state(backend):
    cfg, kw = identity_setup(16, 32, 4, n=2)
    step = jax.jit(lambda s, t: hs.resolve_residency(s, t, backend=backend, **kw),
                   donate_argnums=0)
    state = hs.init_hot_state(cfg)
    topk = jnp.tile(jnp.arange(16, dtype=jnp.int32), (2, 1))
    res, state = step(state, topk)
    res2, state = step(state, topk)
    np.testing.assert_array_equal(res2.attention_rows, res.attention_rows)
    assert int(res2.num_hits.sum()) == 32


# ----------------------------------------------------------------------------- validation


def _good_args():
    cfg, kw = identity_setup(8, 16, 4, n=2)
    return hs.init_hot_state(cfg), jnp.zeros((2, 8), jnp.int32), kw


@pytest.mark.parametrize("mutate,match", [
    (lambda s, t, kw: (s, t.astype(jnp.float32), kw), "topk must be int32"),
    (lambda s, t, kw: (s, t[0], kw), "topk must have rank 2"),
    (lambda s, t, kw: (s, jnp.zeros((2, 17), jnp.int32), kw), "top_k <= hot_size"),
    (lambda s, t, kw: (s, t, {**kw, "state_rows": jnp.zeros(3, jnp.int32)}),
     "state_rows has 3 entries"),
    (lambda s, t, kw: (s, t, {**kw, "hot_block_table": kw["hot_block_table"][:, :3]}),
     "hot_block_table must be"),
    (lambda s, t, kw: (s, t, {**kw, "source_block_table": kw["source_block_table"][:1]}),
     "source_block_table must be"),
    (lambda s, t, kw: (s, t, {**kw, "block_size": 0}), "block_size must be >= 1"),
    (lambda s, t, kw: (s, t, {**kw, "state_rows": jnp.array([0, 5], jnp.int32)}),
     "state_rows must be < max_num_reqs"),
    (lambda s, t, kw: (s, t, {**kw, "state_rows": jnp.array([1, 1], jnp.int32)}),
     "must not repeat"),
    (lambda s, t, kw: (hs.HotState(s.slot_rows, s.lru.astype(jnp.int32)), t, kw),
     "state.lru must be int16"),
    (lambda s, t, kw: (s, t, {**kw, "backend": "cuda"}), "backend must be one of"),
    (lambda s, t, kw: (s, t, {**kw, "backend": "mosaic_gpu"}),
     "has no implementation of resolve_residency"),
])
def test_bad_input_names_the_argument(mutate, match):
    state, topk, kw = mutate(*_good_args())
    with pytest.raises((ValueError, TypeError), match=match):
        hs.resolve_residency(state, topk, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_columns_is_a_clear_error(backend):
    """K = 0 fails in the argument check (naming topk and the rule), not inside a gather."""
    state, _, kw = _good_args()
    with pytest.raises(ValueError, match=r"topk .*1 <= top_k <= hot_size"):
        hs.resolve_residency(state, jnp.zeros((2, 0), jnp.int32), backend=backend, **kw)


# ------------------------------------------------------------------ validate=True (values)


def _valid_case(seed, k=8, hot=16, block=4):
    """A precondition-respecting random case with at least one live row (one shape)."""
    rng = np.random.default_rng(seed)
    case = random_case(rng, n=3, k=k, hot=hot, block_size=block, src_blocks=4)
    case.hot_table = case.hot_table[:, : -(-hot // block)]
    if (case.state_rows < 0).all():
        case.state_rows[0] = 0
    return case


def _live_row(case, need_host_rows=0):
    """A live batch row with at least `need_host_rows` valid host rows, or None."""
    for n in np.flatnonzero(case.state_rows >= 0):
        g = [host_row(case.src_table, n, int(t), case.block_size, case.host_rows)
             for t in case.topk[n]]
        if sum(x >= 0 for x in g) >= need_host_rows:
            return int(n), g
    return None


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(0.1))
@given(seed=st.integers(0, 2**32 - 1))
def test_validate_accepts_valid_cases(backend, seed):
    """A valid random case passes validate=True and resolves exactly as without it."""
    case = _valid_case(seed)
    resolution, state = run_public(case, backend, validate=True)
    assert_matches_oracle(case, resolution, state)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["duplicate_host_row", "lru_repeat", "lru_out_of_range",
                                  "null_hot_block", "negative_hot_block"])
def test_validate_rejects_each_rule(backend, rule):
    """Each value rule, broken on one live row: a ValueError naming the argument, the batch
    row and the rule, with validate=True and by default; validate=False runs it unchecked."""
    case = _valid_case(5)
    found = _live_row(case, need_host_rows=2)
    assert found is not None
    n, g = found
    s = int(case.state_rows[n])
    if rule == "duplicate_host_row":
        cols = [i for i, x in enumerate(g) if x >= 0]
        case.topk[n, cols[1]] = case.topk[n, cols[0]]
        match = rf"topk row {n}: columns \[{cols[0]}, {cols[1]}\] .* must be unique"
    elif rule == "lru_repeat":
        case.lru[s, 1] = case.lru[s, 0]
        match = rf"state.lru\[{s}\] \(the state row of batch row {n}\) must be a permutation"
    elif rule == "lru_out_of_range":
        case.lru[s, 3] = case.lru.shape[1]
        match = rf"state.lru\[{s}\] \(the state row of batch row {n}\) must be a permutation"
    else:
        case.hot_table[n, 1] = 0 if rule == "null_hot_block" else -3
        match = (rf"hot_block_table\[{n}, 1\] = {case.hot_table[n, 1]} for batch row {n}: "
                 r".* must be > 0")
    for validate in (True, None):
        with pytest.raises(ValueError, match=match):
            run_public(case, backend, validate=validate)
    run_public(case, backend, validate=False)              # opt-out: unchecked, it runs


def test_validate_checks_live_rows_only():
    """Padding rows (state_rows < 0) are not checked: their tables may hold anything."""
    case = _valid_case(6)
    case.state_rows[0] = -1
    case.hot_table[0] = 0
    case.topk[0] = case.topk[0, 0]
    resolution, state = run_public(case, validate=True)
    assert_matches_oracle(case, resolution, state)


def test_validate_needs_concrete_arrays():
    cfg, kw = identity_setup(8, 16, 4, n=2)
    topk = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
    state = hs.init_hot_state(cfg)
    with pytest.raises(ValueError, match="validate=True.*needs concrete arrays.*topk is traced"):
        jax.jit(lambda t: hs.resolve_residency(state, t, validate=True, **kw))(topk)
    hs.resolve_residency(state, topk, validate=True, **kw)          # concrete: fine



# The value rules broken as in the issue (one request, K = 4, H = 8, B = 4): before the default
# check these returned garbage (attention rows -40..-37; four misses in one device row; one
# host row copied into four slots). (mutate(state, topk, hot_table), host-check message,
# checkify message).
ISSUE_CASES = {
    "negative_hot_blocks": (
        lambda st, t, hot: (st, t, jnp.array([[-10, -11]], jnp.int32)),
        r"hot_block_table\[0, 0\] = -10 for batch row 0: .* must be > 0 \(block 0 is the "
        r"null block\)",
        r"hot_block_table of batch row 0 holds a block id <= 0 .* must be > 0"),
    "lru_not_a_permutation": (
        lambda st, t, hot: (hs.HotState(st.slot_rows, jnp.zeros_like(st.lru)), t, hot),
        r"state.lru\[0\] \(the state row of batch row 0\) must be a permutation of 0..7",
        r"state.lru of the state row of batch row 0 must be a permutation of 0..7"),
    "duplicate_topk": (
        lambda st, t, hot: (st, jnp.zeros_like(t), hot),
        r"topk row 0: columns \[0, 1, 2, 3\] all select host row 4; the valid host rows of a "
        r"row must be unique",
        r"topk row 0 selects one host row in two columns; the valid host rows of a row must "
        r"be unique"),
}


def _issue_case(name=None):
    """(state, topk, hot_block_table, the other keywords): the valid case (name None: hits
    none of the rules) or ISSUE_CASES[name]."""
    cfg, kw = identity_setup(4, 8, 4)
    args = (hs.init_hot_state(cfg), jnp.arange(4, dtype=jnp.int32)[None],
            kw.pop("hot_block_table"))
    if name is not None:
        args = ISSUE_CASES[name][0](*args)
    return (*args, kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(ISSUE_CASES))
def test_broken_value_rules_raise_by_default(backend, name):
    """Outside jit the default call raises, naming the argument, the row and the rule."""
    state, topk, hot, kw = _issue_case(name)
    with pytest.raises(ValueError, match=ISSUE_CASES[name][1]):
        hs.resolve_residency(state, topk, hot_block_table=hot, backend=backend, **kw)
    hs.resolve_residency(state, topk, hot_block_table=hot, backend=backend, validate=False,
                         **kw)                                      # opt-out: it runs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(ISSUE_CASES))
def test_broken_value_rules_are_checkify_errors_under_jit(backend, name):
    """Under jit the default call carries the rules as checkify checks: a function run under
    `checkify.checkify` reports the broken rule (and nothing for the valid case);
    validate=False leaves them out."""
    *args, kw = _issue_case(name)

    def attention_rows(st, t, h, validate=None):
        return hs.resolve_residency(st, t, hot_block_table=h, backend=backend,
                                    validate=validate, **kw)[0].attention_rows

    checked = checkify.checkify(jax.jit(attention_rows), errors=checkify.user_checks)
    err, _ = checked(*args)
    assert err.get() is not None and re.search(ISSUE_CASES[name][2], err.get()), err.get()
    assert checked(*_issue_case()[:3])[0].get() is None
    unchecked = checkify.checkify(jax.jit(functools.partial(attention_rows, validate=False)),
                                  errors=checkify.user_checks)
    assert unchecked(*args)[0].get() is None


@pytest.mark.parametrize("rule, match", [
    ("source_block_table", r"source_block_table rows of request 1 differ"),
    ("lru", r"state.lru of the state row of request 1 must be a permutation"),
    ("hot_block_table", r"hot_block_table of request 1 holds a block id <= 0"),
    ("repeated_host_row", r"request 1 .* selects distinct positions with the same host row"),
])
def test_union_rules_are_checkify_errors_under_jit(rule, match):
    """r = 2 under jit: each union rule broken on request 1 is reported by checkify."""
    state, topk, kw = _union_good_args()
    topk = jnp.tile(jnp.arange(8, dtype=jnp.int32), (4, 1))
    if rule == "source_block_table":
        kw["source_block_table"] = kw["source_block_table"].at[3, 0].add(1)
    elif rule == "lru":
        state = hs.HotState(state.slot_rows, state.lru.at[1, 0].set(1))
    elif rule == "hot_block_table":
        kw["hot_block_table"] = kw["hot_block_table"].at[2:, 1].set(0)
    else:
        kw["source_block_table"] = kw["source_block_table"].at[2:, 1].set(1)
    checked = checkify.checkify(jax.jit(lambda st, t: hs.resolve_residency(
        st, t, query_rows_per_request=2, **kw)[0].attention_rows), errors=checkify.user_checks)
    err, _ = checked(state, topk)
    assert err.get() is not None and re.search(match, err.get()), err.get()


def test_config_validation():
    with pytest.raises(ValueError, match="hot_size must be >= top_k"):
        hs.HiSparseConfig(top_k=64, hot_size=32, block_size=16, max_num_reqs=1)
    with pytest.raises(ValueError, match="hot_size must be <= 32768"):
        hs.HiSparseConfig(top_k=64, hot_size=40000, block_size=16, max_num_reqs=1)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        hs.HiSparseConfig(top_k=4, hot_size=8, block_size=0, max_num_reqs=1)
    with pytest.raises(ValueError, match="multiple of 16 bytes"):
        hs.HiSparseConfig(top_k=4, hot_size=8, block_size=4, max_num_reqs=1, row_width=3)
    with pytest.warns(UserWarning, match="not a multiple of block_size"):
        cfg = hs.HiSparseConfig(top_k=4, hot_size=10, block_size=4, max_num_reqs=1,
                                row_width=8)
    assert cfg.hot_blocks == 3 and cfg.row_bytes == 16


def test_reset_rows_empties_only_named_rows():
    cfg, kw = identity_setup(8, 16, 4, n=2)
    topk = jnp.tile(jnp.arange(8, dtype=jnp.int32), (2, 1))
    _, state = hs.resolve_residency(hs.init_hot_state(cfg), topk, **kw)
    cleared = hs.reset_rows(state, jnp.array([1, -1], jnp.int32))
    np.testing.assert_array_equal(cleared.slot_rows[1], -1)
    np.testing.assert_array_equal(cleared.lru[1], np.arange(16))
    np.testing.assert_array_equal(cleared.slot_rows[0], state.slot_rows[0])
    np.testing.assert_array_equal(cleared.lru[0], state.lru[0])


# ------------------------------------------------ Triton kernel against the reference, exactly


@functools.partial(jax.jit, static_argnames=("block_size", "tuning"))
def _resolve_kernel(*args, block_size, host_rows, tuning):
    return tk.resolve_residency(*args, block_size=block_size, host_rows=host_rows,
                                interpret=INTERPRET, tuning=tuning, poison=POISON)


_ref = jax.jit(ref_module.resolve_residency, static_argnames=("block_size",))

# (n, k, hot, block_size, src_blocks, resident_share, tuning): few shapes, each compiled
# once; a share of None runs without a resident table.
RESOLVE_SHAPES = {
    "resident": (4, 8, 12, 4, 4, 0.4, tk.ResolveTuning()),
    # A sparse (8 * Kp) table, the whole LRU in one chunk (walk and reorder fused).
    "no_resident_odd_k": (3, 7, 9, 2, 5, None, tk.ResolveTuning(table_factor=8)),
    # 4-slot chunks: the walk carries ranks across 4 chunks; a 2*Kp table collides often;
    # volatile loads (the default reads the scratch through L1).
    "chunked_walk": (2, 6, 16, 4, 3, 0.3, tk.ResolveTuning(chunk=4, table_factor=2,
                                                           cached_loads=False)),
}


def _case(rng, shape, corrupt=False):
    n, k, hot, block, src_blocks, share, _ = RESOLVE_SHAPES[shape]
    case = random_case(rng, n=n, k=k, hot=hot, block_size=block, src_blocks=src_blocks,
                       resident_share=share or 0.0, corrupt_lru=corrupt)
    if share is None:
        case.res_table = None
    # One hot-table width per shape (one compile); host_rows is a traced scalar.
    case.hot_table = case.hot_table[:, : -(-hot // block)]
    return case


def _check_resolve(case, tuning):
    host_rows = case.host_rows
    args = [None if a is None else jnp.asarray(a) for a in case.args()]
    got = _resolve_kernel(*args, block_size=case.block_size, host_rows=host_rows,
                          tuning=tuning)
    ref = _ref(*args, block_size=case.block_size, host_rows=host_rows)
    for name, g, r in zip(NAMES, got, ref, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)
    return got


@pytest.mark.parametrize("shape", list(RESOLVE_SHAPES))
@settings(max_examples=examples(0.2))
@given(seed=st.integers(0, 2**32 - 1), corrupt=st.booleans())
def test_kernel_matches_reference(shape, seed, corrupt):
    _check_resolve(_case(np.random.default_rng(seed), shape, corrupt),
                   RESOLVE_SHAPES[shape][-1])


def test_kernel_matches_loop_oracle():
    case = _case(np.random.default_rng(3), "resident")
    got = _check_resolve(case, RESOLVE_SHAPES["resident"][-1])
    want, slot_rows, lru = oracle_resolve(*case.args(), case.block_size, case.host_rows)
    for name in NAMES[:6]:
        np.testing.assert_array_equal(np.asarray(got[NAMES.index(name)]), want[name], name)
    np.testing.assert_array_equal(np.asarray(got[6]), slot_rows)
    np.testing.assert_array_equal(np.asarray(got[7]), lru)


def test_tuning_knobs_are_validated():
    with pytest.raises(ValueError, match="chunk"):
        tk.ResolveTuning(chunk=1000)
    with pytest.raises(ValueError, match="table_factor"):
        tk.ResolveTuning(table_factor=3)


# --------------------------------------------------------------------------- Triton lowering


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("n,k,hot,block,resident", [(64, 2048, 4096, 64, True),
                                                     (3, 10, 37, 4, False)])
def test_kernel_lowers_to_triton(n, k, hot, block, resident):
    fn = functools.partial(tk.resolve_residency, block_size=block, host_rows=1 << 20)
    args = [sds((n + 2, hot)), sds((n + 2, hot), jnp.int16), sds((n, k)), sds((n,)),
            sds((n, -(-hot // block))), sds((n, 100))]
    if resident:
        lower_for_cuda(fn, *args, sds((n, 100)))
    else:
        lower_for_cuda(lambda *a: fn(*a, None), *args)


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("name", list(RESOLVE_VARIANTS))
def test_sweep_variants_lower_to_triton(name):
    """Every candidate of the benchmark's resolve sweep lowers at the benchmark's size."""
    n, k, hot, block = 64, 2048, 4096, 64
    fn = functools.partial(tk.resolve_residency, block_size=block, host_rows=1 << 20,
                           tuning=RESOLVE_VARIANTS[name])
    lower_for_cuda(fn, sds((n, hot)), sds((n, hot), jnp.int16), sds((n, k)), sds((n,)),
                   sds((n, hot // block)), sds((n, 96)), sds((n, 96)))


# --------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["reference", None])
def test_gpu_public_op_matches_oracle(backend):
    rng = np.random.default_rng(5)
    for k, mult in [(64, 2), (2048, 2)]:
        case = random_case(rng, n=8, k=k, hot=k * mult, block_size=64,
                           src_blocks=max(1, 3 * k // 128), resident_share=0.3,
                           corrupt_lru=True)
        resolution, state = run_public(case, backend=backend)
        assert_matches_oracle(case, resolution, state)


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 64])
def test_gpu_kernel_realistic(n):
    rng = np.random.default_rng(n)
    k, hot, block = 2048, 4096, 64
    case = random_case(rng, n=n, k=k, hot=hot, block_size=block, src_blocks=48,
                       resident_share=0.3, corrupt_lru=True)
    _check_resolve(case, tk.ResolveTuning())


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(RESOLVE_VARIANTS))
def test_gpu_kernel_sweep_variants(name):
    """Each tuning the benchmark may pick, compiled, at the real K and H."""
    case = random_case(np.random.default_rng(11), n=4, k=2048, hot=4096, block_size=64,
                       src_blocks=48, resident_share=0.3, corrupt_lru=True)
    _check_resolve(case, RESOLVE_VARIANTS[name])


@pytest.mark.gpu
def test_gpu_sequence_via_public_op():
    """Several decode steps through the public op (compiled kernel) vs the reference."""
    rng = np.random.default_rng(1)
    n, k, hot, block = 8, 256, 512, 16
    cfg = hs.HiSparseConfig(top_k=k, hot_size=hot, block_size=block, max_num_reqs=n)
    state_p = state_r = hs.init_hot_state(cfg)
    src_table = jnp.asarray(1 + rng.permutation(n * 64).reshape(n, 64).astype(np.int32))
    hot_table = jnp.asarray(1 + rng.permutation(n * 32).reshape(n, 32).astype(np.int32))
    kw = dict(state_rows=jnp.arange(n, dtype=jnp.int32), hot_block_table=hot_table,
              source_block_table=src_table, block_size=block, host_rows=(n * 64 + 1) * block)
    for _ in range(5):
        topk = jnp.asarray(np.stack([rng.choice(64 * block, k, replace=False)
                                     for _ in range(n)]).astype(np.int32))
        res_p, state_p = hs.resolve_residency(state_p, topk, backend="triton", **kw)
        res_r, state_r = hs.resolve_residency(state_r, topk, backend="reference", **kw)
        for name in NAMES[:6]:
            np.testing.assert_array_equal(np.asarray(getattr(res_p, name)),
                                          np.asarray(getattr(res_r, name)), name)
        np.testing.assert_array_equal(np.asarray(state_p.lru), np.asarray(state_r.lru))


# ------------------------------------------- several query rows per request (the union rule)

# (requests, r, k, hot): one compiled shape each; the kernels run the first two only.
UNION_SHAPES = [(3, 2, 5, 10), (2, 3, 8, 32), (4, 2, 32, 96), (2, 4, 16, 64)]


def union_case(rng, shape, overlap, **kw):
    requests, r, k, hot = shape
    block = 4
    case = random_union_case(rng, requests=requests, rows_per_request=r, k=k, hot=hot,
                             block_size=block, src_blocks=max(2, r * k // block),
                             overlap=overlap, **kw)
    case.hot_table = case.hot_table[:, : -(-hot // block)]      # one width per shape
    return case


@pytest.mark.parametrize("backend", BACKENDS)
@given(seed=st.integers(0, 2**32 - 1), data=st.data(), resident_share=st.sampled_from([0.0, 0.4]),
       corrupt_lru=st.booleans(), overlap=st.sampled_from(OVERLAPS))
def test_union_matches_oracle(backend, seed, data, resident_share, corrupt_lru, overlap):
    """Random requests of r rows (holes, padding requests, resident pages, hits from any
    row, corrupt LRU ids; rows identical / disjoint / overlapping / independent)."""
    shapes = UNION_SHAPES if backend == "reference" else UNION_SHAPES[:2]
    shape = data.draw(st.sampled_from(shapes), label="shape")
    case = union_case(np.random.default_rng(seed), shape, overlap,
                      resident_share=resident_share, corrupt_lru=corrupt_lru)
    resolution, state = run_public(case, backend, query_rows_per_request=shape[1],
                                   validate=False if corrupt_lru else None)
    assert_matches_oracle(case, resolution, state, rows_per_request=shape[1])
    requests, r, k, _ = shape
    assert resolution.swap_src.shape == (requests, r * k)          # the plan is per request
    assert resolution.attention_rows.shape == (requests * r, k)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(0.3))
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(2, 5))
def test_union_matches_oracle_over_steps(backend, seed, steps):
    """State carried across steps; every step draws new rows (and overlap) per request."""
    rng = np.random.default_rng(seed)
    shape = UNION_SHAPES[1]
    case = union_case(rng, shape, "overlapping")
    for _ in range(steps):
        fresh = union_case(rng, shape, str(rng.choice(OVERLAPS)),
                           resident_share=float(rng.choice([0.0, 0.4])))
        case.topk, case.res_table = fresh.topk, fresh.res_table
        resolution, state = run_public(case, backend, query_rows_per_request=shape[1])
        assert_matches_oracle(case, resolution, state, rows_per_request=shape[1])
        case.slot_rows, case.lru = np.asarray(state.slot_rows), np.asarray(state.lru)


@settings(max_examples=examples(0.3))
@given(seed=st.integers(0, 2**32 - 1), resident_share=st.sampled_from([0.0, 0.4]))
def test_union_of_one_row_is_the_single_row_op(seed, resident_share):
    """The union machinery at r = 1 (compaction of the row's positions, gather back)
    reproduces the single-row op bit for bit, and query_rows_per_request=1 is the default."""
    case = random_case(np.random.default_rng(seed), n=4, k=16, hot=32, block_size=4,
                       src_blocks=6, resident_share=resident_share)
    args = [None if a is None else jnp.asarray(a) for a in case.args()]
    kw = dict(block_size=case.block_size, host_rows=case.host_rows)
    single = ref_module.resolve_residency(*args, **kw)
    through_union = union_module.resolve_union(ref_module.resolve_residency, *args,
                                               rows_per_request=1, **kw)
    default, state = run_public(case)
    explicit, state1 = run_public(case, query_rows_per_request=1)
    for name, a, b in zip(NAMES, single, through_union, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    chex.assert_trees_all_equal((default, state), (explicit, state1))


def _single_row_kw(case, rows):
    """Public-op arguments for the batch rows `rows` of `case` alone, as r = 1 rows."""
    return dict(state_rows=jnp.asarray(case.state_rows[rows]),
                hot_block_table=jnp.asarray(case.hot_table[rows]),
                source_block_table=jnp.asarray(case.src_table[rows]),
                resident_block_table=jnp.asarray(case.res_table[rows]),
                block_size=case.block_size, host_rows=case.host_rows)


@pytest.mark.parametrize("backend", BACKENDS)
def test_identical_rows_resolve_like_one_row(backend):
    """r rows selecting the same positions (in other orders) change the state exactly as
    the first row alone, copy what it copies, and each row reads the same device row per
    position."""
    rng = np.random.default_rng(2)
    shape = UNION_SHAPES[1]
    requests, r, k, _ = shape
    case = union_case(rng, shape, "identical", resident_share=0.3)
    for n in range(requests * r):                 # the same positions, holes included
        case.topk[n] = rng.permutation(case.topk[n - n % r])
    state0 = hs.HotState(jnp.asarray(case.slot_rows), jnp.asarray(case.lru))
    union_res, union_state = run_public(case, backend, query_rows_per_request=r)
    first = np.arange(0, requests * r, r)
    one, one_state = hs.resolve_residency(state0, jnp.asarray(case.topk[first]),
                                          backend=backend, **_single_row_kw(case, first))
    chex.assert_trees_all_equal(union_state, one_state)
    for name in ("swap_counts", "num_hits"):
        np.testing.assert_array_equal(getattr(union_res, name), getattr(one, name), name)
    np.testing.assert_array_equal(np.asarray(union_res.swap_src)[:, :k], one.swap_src)
    np.testing.assert_array_equal(np.asarray(union_res.swap_src)[:, k:], -1)
    for n in range(requests * r):
        row0 = dict(zip(case.topk[n - n % r].tolist(),
                        np.asarray(one.attention_rows)[n // r].tolist(), strict=True))
        want = [row0[t] if t >= 0 else -1 for t in case.topk[n].tolist()]
        np.testing.assert_array_equal(np.asarray(union_res.attention_rows)[n], want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_disjoint_rows_resolve_like_their_concatenation(backend):
    """r rows selecting disjoint positions resolve exactly as one row of r*K columns holding
    them side by side (the union is their concatenation, holes aside)."""
    rng = np.random.default_rng(4)
    shape = UNION_SHAPES[1]
    requests, r, k, _ = shape
    case = union_case(rng, shape, "disjoint", resident_share=0.3)
    case.topk[case.topk < 0] = -1
    state0 = hs.HotState(jnp.asarray(case.slot_rows), jnp.asarray(case.lru))
    union_res, union_state = run_public(case, backend, query_rows_per_request=r)
    first = np.arange(0, requests * r, r)
    wide = jnp.asarray(case.topk.reshape(requests, r * k))
    one, one_state = hs.resolve_residency(state0, wide, backend=backend,
                                          **_single_row_kw(case, first))
    chex.assert_trees_all_equal(union_state, one_state)
    for name in ("swap_src", "swap_dst", "swap_counts", "num_hits"):
        np.testing.assert_array_equal(getattr(union_res, name), getattr(one, name), name)
    np.testing.assert_array_equal(np.asarray(union_res.attention_rows),
                                  np.asarray(one.attention_rows).reshape(requests * r, k))


@settings(max_examples=examples(0.3))
@given(seed=st.integers(0, 2**32 - 1), overlap=st.sampled_from(OVERLAPS))
def test_per_row_ablation_copies_at_least_the_union(seed, overlap):
    """The per-row ablation (r = 1, one call per row index on the carried state) copies
    every row the union copies, and more whenever rows of a request share a miss."""
    shape = UNION_SHAPES[2]
    requests, r, _, _ = shape
    case = union_case(np.random.default_rng(seed), shape, overlap)
    union_res, _ = run_public(case, query_rows_per_request=r)
    state = hs.HotState(jnp.asarray(case.slot_rows), jnp.asarray(case.lru))
    per_row_copies = np.zeros(requests, np.int64)
    copied = [set() for _ in range(requests)]
    for j in range(r):
        rows = np.arange(j, requests * r, r)
        res, state = hs.resolve_residency(state, jnp.asarray(case.topk[rows]),
                                          **_single_row_kw(case, rows))
        per_row_copies += np.asarray(res.swap_counts)
        for grp in range(requests):
            copied[grp] |= set(np.asarray(res.swap_src)[grp, : int(res.swap_counts[grp])]
                               .tolist())
    assert (np.asarray(union_res.swap_counts) <= per_row_copies).all()
    for grp in range(requests):
        union_copies = set(np.asarray(union_res.swap_src)[grp, : int(
            union_res.swap_counts[grp])].tolist())
        assert union_copies <= copied[grp]
        assert len(union_copies) == int(union_res.swap_counts[grp])    # each row once


def _union_good_args(r=2):
    cfg, kw = identity_setup(8, 16, 4, n=2 * r)
    kw["state_rows"] = jnp.repeat(jnp.arange(2, dtype=jnp.int32), r)
    return hs.init_hot_state(cfg), jnp.zeros((2 * r, 8), jnp.int32), kw


@pytest.mark.parametrize("mutate,match", [
    (lambda s, t, kw: (s, t[:3], {**kw, "state_rows": kw["state_rows"][:3],
                                  **{n: kw[n][:3] for n in ("hot_block_table",
                                                            "source_block_table")}}),
     r"N=3 rows, not a multiple of query_rows_per_request=2"),
    (lambda s, t, kw: (s, jnp.zeros((4, 9), jnp.int32), kw),
     r"query_rows_per_request=2 .* r\*K=18 .* H=16 .*query_rows_per_request \* top_k <= "
     r"hot_size"),
    (lambda s, t, kw: (s, t, {**kw, "state_rows": jnp.array([0, 1, 1, 0], jnp.int32)}),
     r"state_rows must be equal within each group of query_rows_per_request=2 .* rows 0..1"),
    (lambda s, t, kw: (s, t, {**kw, "state_rows": jnp.array([1, 1, 1, 1], jnp.int32)}),
     r"must not repeat a state row .*\(except within a request"),
    (lambda s, t, kw: (s, t, {**kw, "query_rows_per_request": 0}),
     "query_rows_per_request must be >= 1"),
    (lambda s, t, kw: (s, t, {**kw, "query_rows_per_request": 2.0}),
     "query_rows_per_request must be a static Python int"),
])
def test_union_bad_input_names_the_argument(mutate, match):
    state, topk, kw = mutate(*_union_good_args())
    kw.setdefault("query_rows_per_request", 2)
    with pytest.raises((ValueError, TypeError), match=match):
        hs.resolve_residency(state, topk, **kw)


@pytest.mark.parametrize("rule", ["source_block_table", "hot_block_table",
                                  "resident_block_table", "repeated_host_row"])
def test_union_validate_rejects_each_rule(rule):
    """validate=True (and the default) with r > 1: a request's rows carry equal table rows,
    and its distinct positions distinct host rows; with validate=False the same case runs."""
    rng = np.random.default_rng(8)
    shape = UNION_SHAPES[0]
    requests, r, k, _ = shape
    case = union_case(rng, shape, "overlapping", resident_share=0.3, padding=False)
    run_public(case, query_rows_per_request=r, validate=True)           # valid as drawn
    if rule == "repeated_host_row":
        # Pages 0 and 1 of request 1 now hold block 1: positions 0 and B share a host row.
        case.src_table[r: 2 * r, :2] = 1
        case.topk[r, :2] = [0, case.block_size]
        case.topk[r + 1] = -1
        match = rf"topk rows {r}..{2 * r - 1} \(one request\): .* distinct host rows"
    else:
        table = {"source_block_table": case.src_table, "hot_block_table": case.hot_table,
                 "resident_block_table": case.res_table}[rule]
        table[1, 0] += 1
        match = rf"{rule} rows 0..{r - 1} differ, .* must carry the same table row"
    for validate in (True, None):
        with pytest.raises(ValueError, match=match):
            run_public(case, query_rows_per_request=r, validate=validate)
    run_public(case, query_rows_per_request=r, validate=False)


def test_config_num_speculative_tokens():
    cfg = hs.HiSparseConfig(top_k=64, hot_size=192, block_size=16, max_num_reqs=1,
                            num_speculative_tokens=2)
    assert cfg.query_rows_per_request == 3
    assert hs.HiSparseConfig(top_k=4, hot_size=8, block_size=4,
                             max_num_reqs=1).query_rows_per_request == 1
    for bad in (-1, 1.5, True, None):
        with pytest.raises(ValueError, match=r"HiSparseConfig.num_speculative_tokens must be "
                                             r"an int >= 0"):
            hs.HiSparseConfig(top_k=4, hot_size=8, block_size=4, max_num_reqs=1,
                              num_speculative_tokens=bad)
    with pytest.raises(ValueError, match=r"hot_size must be >= \(1 \+ num_speculative_tokens\)"
                                         r" \* top_k.*hot_size=128, num_speculative_tokens=2"):
        hs.HiSparseConfig(top_k=64, hot_size=128, block_size=16, max_num_reqs=1,
                          num_speculative_tokens=2)
    for k, b, spec in [(64, 16, 0), (2048, 64, 2), (100, 64, 1), (7, 3, 4)]:
        hot = hs.HiSparseConfig.default_hot_size(k, b, spec)
        assert hot % b == 0 and 2 * (1 + spec) * k <= hot < 2 * (1 + spec) * k + b
        hs.HiSparseConfig(top_k=k, hot_size=hot, block_size=b, max_num_reqs=1,
                          num_speculative_tokens=spec)                  # accepted as is


# (requests, r, k, hot, block, resident): the kernel on union rows against the reference.
UNION_KERNEL_SHAPES = {"r2": (3, 2, 6, 16, 4, True), "r3_no_resident": (2, 3, 5, 15, 2, False)}


@functools.partial(jax.jit, static_argnames=("block_size", "r"))
def _union_kernel(*args, block_size, host_rows, r):
    return tk.resolve_residency(*args, block_size=block_size, host_rows=host_rows,
                                interpret=INTERPRET, poison=POISON, query_rows_per_request=r)


_union_ref = jax.jit(ref_module.resolve_residency,
                     static_argnames=("block_size", "query_rows_per_request"))


def _check_union_kernel(case, r, kernel=_union_kernel):
    args = [None if a is None else jnp.asarray(a) for a in case.args()]
    got = kernel(*args, block_size=case.block_size, host_rows=case.host_rows, r=r)
    want = _union_ref(*args, block_size=case.block_size, host_rows=case.host_rows,
                      query_rows_per_request=r)
    for name, g, w in zip(NAMES, got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)


@pytest.mark.parametrize("shape", list(UNION_KERNEL_SHAPES))
@settings(max_examples=examples(0.2))
@given(seed=st.integers(0, 2**32 - 1), corrupt=st.booleans(),
       overlap=st.sampled_from(OVERLAPS))
def test_union_kernel_matches_reference(shape, seed, corrupt, overlap):
    requests, r, k, hot, block, resident = UNION_KERNEL_SHAPES[shape]
    case = random_union_case(np.random.default_rng(seed), requests=requests,
                             rows_per_request=r, k=k, hot=hot, block_size=block,
                             src_blocks=r * k // block + 1, overlap=overlap,
                             resident_share=0.3, corrupt_lru=corrupt)
    case.hot_table = case.hot_table[:, : -(-hot // block)]
    if not resident:
        case.res_table = None
    _check_union_kernel(case, r)


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_union_kernel_lowers_to_triton():
    """The union path (jnp union + kernel on r*K-column rows + gather back) at the GPU test's
    size: r = 2, K = 2048, H = 6144, 64 requests."""
    requests, r, k, hot, block = 64, 2, 2048, 6144, 64
    n = requests * r
    fn = functools.partial(tk.resolve_residency, block_size=block, host_rows=1 << 20,
                           query_rows_per_request=r)
    lower_for_cuda(fn, sds((requests + 2, hot)), sds((requests + 2, hot), jnp.int16),
                   sds((n, k)), sds((n,)), sds((n, hot // block)), sds((n, 100)),
                   sds((n, 100)))


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", ["overlapping", "independent"])
def test_gpu_union_kernel_realistic(overlap):
    """Compiled kernel vs reference at r = 2, K = 2048, H = 6144, 64 requests, over 3 steps
    of carried state; the first step also against the loop oracle."""
    rng = np.random.default_rng(17)
    requests, r, k, hot, block = 64, 2, 2048, 6144, 64
    case = random_union_case(rng, requests=requests, rows_per_request=r, k=k, hot=hot,
                             block_size=block, src_blocks=96, overlap=overlap,
                             resident_share=0.3, corrupt_lru=True)
    for step in range(3):
        if step:
            fresh = random_union_case(rng, requests=requests, rows_per_request=r, k=k,
                                      hot=hot, block_size=block, src_blocks=96,
                                      overlap=overlap, resident_share=0.3)
            case.topk = fresh.topk
        got, got_state = run_public(case, "triton", query_rows_per_request=r)
        want, want_state = run_public(case, "reference", query_rows_per_request=r)
        chex.assert_trees_all_equal((got, got_state), (want, want_state))
        if step == 0:
            assert_matches_oracle(case, got, got_state, rows_per_request=r)
        case.slot_rows = np.asarray(got_state.slot_rows)
        case.lru = np.asarray(got_state.lru)
