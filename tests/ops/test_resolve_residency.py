"""resolve_residency: every backend against the loop oracle and the canonical facts; the Triton
kernel against the jnp reference exactly (poisoned outputs, tuning variants), its lowering for
CUDA, and the GPU-scale runs."""

from __future__ import annotations

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hisparse_jax as hs
from bench.ops.resolve_residency import RESOLVE_VARIANTS
from pallas_kernels.resolve_residency import reference as ref_module
from pallas_kernels.resolve_residency import triton as tk
from tests.ops import INTERPRET, POISON, backends, examples, lower_for_cuda, sds
from tests.oracle import host_row, oracle_resolve, random_case

BACKENDS = backends("resolve_residency")
TOP_KS = [1, 31, 32, 33, 63, 64, 65, 128, 2048]
MULTS = [1, 2, 5]
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


def assert_matches_oracle(case, resolution, state):
    want, want_rows, want_lru = oracle_resolve(*case.args(), case.block_size, case.host_rows)
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
        k = data.draw(st.sampled_from(TOP_KS), label="k")
        mult = data.draw(st.sampled_from(MULTS), label="mult")
    else:
        k, mult = data.draw(st.sampled_from(KERNEL_SHAPES), label="k, mult")
    rng = np.random.default_rng(seed)
    block_size = 4 if k < 64 else 16
    src_blocks = max(1, (k + k // 2) // block_size)
    case = random_case(rng, n=4, k=k, hot=k * mult, block_size=block_size,
                       src_blocks=src_blocks, resident_share=resident_share,
                       corrupt_lru=corrupt_lru)
    resolution, state = run_public(case, backend)
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
    row and the rule; the same case without validate=True runs (the check is opt-in)."""
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
    with pytest.raises(ValueError, match=match):
        run_public(case, backend, validate=True)
    run_public(case, backend)                              # opt-in: unchecked, it runs


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
    # 4-slot chunks: the walk carries ranks across 4 chunks; a 2*Kp table collides often.
    "chunked_walk": (2, 6, 16, 4, 3, 0.3, tk.ResolveTuning(chunk=4, table_factor=2,
                                                           cached_loads=True)),
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
