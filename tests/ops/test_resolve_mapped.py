"""resolve_residency with the hot state's position map (`HotState.pos_slot`): the map rule's
Triton kernel against its jnp reference exactly on any state (stale, out-of-range and
consistent map entries, corrupt LRU ids, poisoned outputs); the map rule against the search
rule on every state the ops reach (resolves, invalidations, resets, a page moved to a new
host block), through the public op; the map's own facts; its input checks; lowering; GPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hisparse_jax as hs
from hisparse_jax.state import apply_hot_updates
from host_tier.plan import HotInvalidation, StepPlan, TableRows, TableUpdate
from pallas_kernels.resolve_residency import reference as ref_module
from pallas_kernels.resolve_residency import triton as tk
from tests.ops import INTERPRET, POISON, backends, examples, lower_for_cuda, sds
from tests.oracle import host_row, random_case

BACKENDS = backends("resolve_residency_mapped")
NAMES = ("attention_rows", "valid_counts", "swap_src", "swap_dst", "swap_counts", "num_hits",
         "slot_rows", "lru", "pos_slot")


def random_map(rng, case, width):
    """A position map for `case` (int16[S, width]): for some slots holding a host row of a
    position of their row's request, the entry of that position names the slot; other
    entries are -1, stale slot ids or ids outside [0, H)."""
    num_state, hot = case.slot_rows.shape
    pmap = np.full((num_state, width), -1, np.int16)
    noise = rng.random(pmap.shape) < 0.2
    pmap[noise] = rng.integers(-1, hot + 3, size=int(noise.sum()))
    for n, s in enumerate(case.state_rows):
        if s < 0:
            continue
        where = {host_row(case.src_table, n, t, case.block_size, case.host_rows): t
                 for t in range(width)}
        for j, g in enumerate(case.slot_rows[s]):
            if g >= 0 and g in where and rng.random() < 0.7:
                pmap[s, where[g]] = j
    return pmap


@functools.partial(jax.jit, static_argnames=("block_size", "tuning"))
def _kernel(*args, block_size, host_rows, tuning):
    return tk.resolve_residency_mapped(*args, block_size=block_size, host_rows=host_rows,
                                       interpret=INTERPRET, tuning=tuning, poison=POISON)


_ref = jax.jit(ref_module.resolve_residency_mapped, static_argnames=("block_size",))

# (n, k, hot, block_size, src_blocks, tuning): one compile each.
MAPPED_SHAPES = {
    "one_pass": (4, 8, 12, 4, 4, tk.ResolveTuning()),
    # The walk in 4-slot chunks (hit count, then a second pass for the new LRU); volatile.
    "chunked": (3, 6, 16, 4, 3, tk.ResolveTuning(chunk=4, cached_loads=False)),
}


def _mapped_case(rng, shape, corrupt):
    n, k, hot, block, src_blocks, _ = MAPPED_SHAPES[shape]
    case = random_case(rng, n=n, k=k, hot=hot, block_size=block, src_blocks=src_blocks,
                       resident_share=0.3, corrupt_lru=corrupt)
    case.hot_table = case.hot_table[:, : -(-hot // block)]
    width = (src_blocks + 1) * block
    return case, random_map(rng, case, width)


def _check(case, pmap, tuning):
    slot_rows, lru, *tables = [None if a is None else jnp.asarray(a) for a in case.args()]
    args = (slot_rows, lru, jnp.asarray(pmap), *tables)
    got = _kernel(*args, block_size=case.block_size, host_rows=case.host_rows, tuning=tuning)
    want = _ref(*args, block_size=case.block_size, host_rows=case.host_rows)
    for name, g, w in zip(NAMES, got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=name)
    return got, want


@pytest.mark.parametrize("shape", list(MAPPED_SHAPES))
@settings(max_examples=examples(0.2))
@given(seed=st.integers(0, 2**32 - 1), corrupt=st.booleans())
def test_kernel_matches_mapped_reference(shape, seed, corrupt):
    case, pmap = _mapped_case(np.random.default_rng(seed), shape, corrupt)
    _check(case, pmap, MAPPED_SHAPES[shape][-1])


@settings(max_examples=examples(0.5))
@given(seed=st.integers(0, 2**32 - 1))
def test_reference_hits_exactly_the_walked_slots_the_map_names(seed):
    """The map rule, spelled out per column against the reference's outputs."""
    rng = np.random.default_rng(seed)
    case, pmap = _mapped_case(rng, "one_pass", corrupt=True)
    slot_rows, lru, *tables = [None if a is None else jnp.asarray(a) for a in case.args()]
    out = _ref(slot_rows, lru, jnp.asarray(pmap), *tables, block_size=case.block_size,
               host_rows=case.host_rows)
    hot = case.slot_rows.shape[1]
    for n, s in enumerate(case.state_rows):
        if s < 0:
            continue
        walked = set(int(x) for x in case.lru[s] if 0 <= x < hot)
        hits = 0
        for i, t in enumerate(case.topk[n]):
            g = host_row(case.src_table, n, int(t), case.block_size, case.host_rows)
            resident = host_row(case.res_table, n, int(t), case.block_size, 1 << 30) >= 0
            if g < 0 or resident:
                continue
            j = int(pmap[s, t])
            hit = 0 <= j < hot and j in walked and case.slot_rows[s, j] == g
            hits += hit
            if hit:
                block = case.hot_table[n, j // case.block_size]
                assert int(out[0][n, i]) == block * case.block_size + j % case.block_size
            elif int(out[0][n, i]) >= 0:  # a miss copied to the slot the map now names
                slot = int(out[8][s, t])
                assert int(out[6][s, slot]) == g
                block = case.hot_table[n, slot // case.block_size]
                assert int(out[0][n, i]) == block * case.block_size + slot % case.block_size
            else:                         # a miss that met an out-of-range LRU id
                assert int(out[8][s, t]) == pmap[s, t]
        assert int(out[5][n]) == hits


# ------------------------------------- the map rule equals the search rule on reachable states

N, K, HOT, BLOCK, SRC_BLOCKS = 3, 6, 16, 4, 6


def _driver(rng, backend, steps, r=1):
    """Random op sequences from an empty state, applied to a state with and without the map;
    every resolve's outputs and the slots and LRU must agree."""
    requests = N
    n = requests * r
    num_state = requests + 1
    width = SRC_BLOCKS * BLOCK
    cfg = hs.HiSparseConfig(top_k=K, hot_size=HOT * r, block_size=BLOCK,
                            max_num_reqs=num_state, max_model_len=width,
                            num_speculative_tokens=r - 1)
    mapped = hs.init_hot_state(cfg)
    assert mapped.pos_slot is not None and mapped.pos_slot.shape == (num_state, width)
    search = hs.HotState(mapped.slot_rows, mapped.lru)
    used = requests * SRC_BLOCKS
    src = (1 + rng.permutation(used).reshape(requests, SRC_BLOCKS)).astype(np.int32)
    res = np.where(rng.random(src.shape) < 0.2, rng.integers(1, 99, src.shape), 0)
    state_rows = rng.permutation(num_state)[:requests].astype(np.int32)
    hot_blocks = -(-HOT * r // BLOCK)
    hot_table = rng.integers(1, 999, (requests, hot_blocks)).astype(np.int32)
    sel = np.stack([rng.choice(width, K, replace=False) for _ in range(n)])
    host_blocks = used + 1 + steps
    for _ in range(steps):
        op = rng.choice(["resolve", "resolve", "resolve", "invalidate", "reset", "move_page"])
        if op == "invalidate":
            req = int(rng.integers(requests))
            t = rng.choice(width, 3, replace=False)
            written = np.array([host_row(src, req, int(x), BLOCK, 1 << 30) for x in t])
            args = (jnp.full((3,), state_rows[req], jnp.int32), jnp.asarray(written, jnp.int32))
            mapped = hs.invalidate_written_rows(mapped, *args, backend=backend)
            search = hs.invalidate_written_rows(search, *args, backend=backend)
        elif op == "reset":
            rows = jnp.asarray([state_rows[int(rng.integers(requests))], -1], jnp.int32)
            mapped, search = hs.reset_rows(mapped, rows), hs.reset_rows(search, rows)
        elif op == "move_page":
            # A page gets a new host block (copy on write); the host tier's plan drops the
            # new block's rows from the request's hot state.
            req, page = int(rng.integers(requests)), int(rng.integers(SRC_BLOCKS))
            src[req, page] = host_blocks
            host_blocks += 1
            empty = TableRows(np.zeros(0, np.int32), np.zeros((0, 1), np.int32))
            plan = StepPlan(step=0, writes=(), tables=TableUpdate(empty, empty, empty),
                            hot_resets=(), restores=(), spills=(),
                            hot_invalidations=(HotInvalidation(int(state_rows[req]),
                                                               (int(src[req, page]),)),))
            mapped, search = apply_hot_updates(plan, (mapped, search), block_size=BLOCK)
        else:
            for row in range(n):
                change = rng.choice(K, K // 2, replace=False)
                fresh = np.setdiff1d(np.arange(width), sel[row])
                sel[row, change] = rng.choice(fresh, K // 2, replace=False)
            topk = sel.copy()
            topk[rng.random(topk.shape) < 0.1] = -1
            kw = dict(state_rows=jnp.asarray(np.repeat(state_rows, r)),
                      hot_block_table=jnp.asarray(np.repeat(hot_table, r, axis=0)),
                      source_block_table=jnp.asarray(np.repeat(src, r, axis=0)),
                      resident_block_table=jnp.asarray(np.repeat(res, r, axis=0)),
                      block_size=BLOCK, host_rows=host_blocks * BLOCK, backend=backend,
                      query_rows_per_request=r)
            got, mapped = hs.resolve_residency(mapped, jnp.asarray(topk), **kw)
            want, search = hs.resolve_residency(search, jnp.asarray(topk), **kw)
            for name in NAMES[:6]:
                np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                              np.asarray(getattr(want, name)), name)
        np.testing.assert_array_equal(np.asarray(mapped.slot_rows), np.asarray(search.slot_rows))
        np.testing.assert_array_equal(np.asarray(mapped.lru), np.asarray(search.lru))
        assert search.pos_slot is None


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(0.3))
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(3, 10))
def test_map_rule_equals_search_rule_on_reachable_states(backend, seed, steps):
    _driver(np.random.default_rng(seed), backend, steps)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(0.2))
@given(seed=st.integers(0, 2**32 - 1), steps=st.integers(2, 6))
def test_map_rule_equals_search_rule_with_two_query_rows(backend, seed, steps):
    """The union rule (speculative decode: two query rows per request)."""
    _driver(np.random.default_rng(seed), backend, steps, r=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cold_start_names_each_columns_slot_and_replay_keeps_the_map(backend):
    k, hot, block = 8, 16, 4
    cfg = hs.HiSparseConfig(top_k=k, hot_size=hot, block_size=block, max_num_reqs=2,
                            max_model_len=32)
    topk = jnp.asarray([[9, 3, 30, 17, 0, 22, 5, 12]], jnp.int32)
    kw = dict(state_rows=jnp.asarray([1], jnp.int32),
              hot_block_table=jnp.asarray([[5, 6, 7, 8]], jnp.int32),
              source_block_table=jnp.asarray([[1 + p for p in range(8)]], jnp.int32),
              block_size=block, host_rows=1 << 20, backend=backend)
    first, state = hs.resolve_residency(hs.init_hot_state(cfg), topk, **kw)
    want = np.full((2, 32), -1, np.int16)
    want[1, np.asarray(topk[0])] = np.arange(k)          # column i -> slot i, cold
    np.testing.assert_array_equal(np.asarray(state.pos_slot), want)
    again, replayed = hs.resolve_residency(state, topk, **kw)
    assert int(again.num_hits[0]) == k and int(again.swap_counts[0]) == 0
    np.testing.assert_array_equal(np.asarray(again.attention_rows),
                                  np.asarray(first.attention_rows))
    for a, b in zip(jax.tree.leaves(replayed), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_controls_the_map():
    base = dict(top_k=4, hot_size=8, block_size=4, max_num_reqs=3)
    assert hs.init_hot_state(hs.HiSparseConfig(**base)).pos_slot is None   # no max_model_len
    off = hs.HiSparseConfig(**base, max_model_len=10, position_map=False)
    assert hs.init_hot_state(off).pos_slot is None
    on = hs.init_hot_state(hs.HiSparseConfig(**base, max_model_len=10))
    assert on.pos_slot.shape == (3, 12) and on.pos_slot.dtype == jnp.int16
    assert (np.asarray(on.pos_slot) == -1).all()
    with pytest.raises(ValueError, match="position_map must be a bool"):
        hs.HiSparseConfig(**base, position_map="yes")


@pytest.mark.parametrize("mutate,error,match", [
    (lambda m: m.astype(jnp.int32), TypeError, "state.pos_slot must be int16"),
    (lambda m: m[:, :-1], ValueError, r"state.pos_slot must be \[S=3, >= P\]"),
    (lambda m: m[:2], ValueError, r"state.pos_slot must be \[S=3, >= P\]"),
])
def test_bad_map_names_the_argument(mutate, error, match):
    cfg = hs.HiSparseConfig(top_k=4, hot_size=8, block_size=4, max_num_reqs=3,
                            max_model_len=16)
    state = hs.init_hot_state(cfg)
    state = hs.HotState(state.slot_rows, state.lru, mutate(state.pos_slot))
    with pytest.raises(error, match=match):
        hs.resolve_residency(state, jnp.zeros((1, 4), jnp.int32),
                             state_rows=jnp.zeros((1,), jnp.int32),
                             hot_block_table=jnp.ones((1, 2), jnp.int32),
                             source_block_table=jnp.ones((1, 4), jnp.int32),
                             block_size=4, host_rows=64)


@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("n,k,hot,block,resident", [(64, 2048, 4096, 64, True),
                                                     (3, 10, 37, 4, False)])
def test_kernel_lowers_to_triton(n, k, hot, block, resident):
    fn = functools.partial(tk.resolve_residency_mapped, block_size=block, host_rows=1 << 20)
    args = [sds((n + 2, hot)), sds((n + 2, hot), jnp.int16), sds((n + 2, 100 * block),
                                                                jnp.int16),
            sds((n, k)), sds((n,)), sds((n, -(-hot // block))), sds((n, 100))]
    if resident:
        lower_for_cuda(fn, *args, sds((n, 100)))
    else:
        lower_for_cuda(lambda *a: fn(*a, None), *args)


# --------------------------------------------------------------------------- GPU, real sizes


@pytest.mark.gpu
@pytest.mark.parametrize("n", [1, 8, 64])
def test_gpu_kernel_realistic(n):
    rng = np.random.default_rng(n)
    k, hot, block, src_blocks = 2048, 4096, 64, 48
    case = random_case(rng, n=n, k=k, hot=hot, block_size=block, src_blocks=src_blocks,
                       resident_share=0.3, corrupt_lru=True)
    _check(case, random_map(rng, case, (src_blocks + 1) * block), tk.ResolveTuning())


@pytest.mark.gpu
@pytest.mark.parametrize("r", [1, 2])
def test_gpu_map_rule_equals_search_rule_over_steps(r):
    for seed in range(3):
        _driver(np.random.default_rng(seed), "triton", 12, r=r)
