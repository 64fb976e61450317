"""invalidate_written_rows: every backend against numpy (LRU untouched), a rewritten row is a
miss again on the next resolve, the kernel's chunking, CUDA lowering and the GPU-scale run."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hisparse_jax as hs
from bench.ops.invalidate_written_rows import INVALIDATE_VARIANTS
from pallas_kernels.invalidate_written_rows import triton as tk
from tests.ops import INTERPRET, backends, examples, lower_for_cuda, sds
from tests.oracle import oracle_invalidate

BACKENDS = backends("invalidate_written_rows")


@pytest.mark.parametrize("backend", BACKENDS)
@given(seed=st.integers(0, 2**32 - 1))
def test_matches_numpy(backend, seed):
    rng = np.random.default_rng(seed)
    s, h, t = 4, 16, 12
    slot_rows = rng.integers(-1, 30, size=(s, h)).astype(np.int32)
    lru = np.stack([rng.permutation(h) for _ in range(s)]).astype(np.int16)
    tok_state = rng.integers(-1, s + 1, size=t).astype(np.int32)
    written = rng.integers(-1, 30, size=t).astype(np.int32)
    state = hs.HotState(jnp.asarray(slot_rows), jnp.asarray(lru))
    got = hs.invalidate_written_rows(state, jnp.asarray(tok_state), jnp.asarray(written),
                                     backend=backend)
    np.testing.assert_array_equal(np.asarray(got.slot_rows),
                                  oracle_invalidate(slot_rows, tok_state, written))
    np.testing.assert_array_equal(np.asarray(got.lru), lru)


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(0.15))
@given(seed=st.integers(0, 2**32 - 1))
def test_odd_hot_size_matches_numpy(backend, seed):
    """H = 37 (not a power of two), state rows and written rows out of range both ways."""
    rng = np.random.default_rng(seed)
    num_state, hot, tokens = 5, 37, 20
    slot_rows = rng.integers(-1, 30, size=(num_state, hot)).astype(np.int32)
    state_rows = rng.integers(-2, num_state + 2, size=tokens).astype(np.int32)
    written = rng.integers(-2, 30, size=tokens).astype(np.int32)
    state = hs.HotState(jnp.asarray(slot_rows), jnp.zeros((num_state, hot), jnp.int16))
    got = hs.invalidate_written_rows(state, jnp.asarray(state_rows), jnp.asarray(written),
                                     backend=backend)
    want = oracle_invalidate(slot_rows, state_rows, written)
    np.testing.assert_array_equal(np.asarray(got.slot_rows), want)
    # The kernel with 16-slot chunks: 3 programs per token, the last one partial.
    got = _invalidate_chunked(jnp.asarray(slot_rows), jnp.asarray(state_rows),
                              jnp.asarray(written))
    np.testing.assert_array_equal(np.asarray(got), want)


_invalidate_chunked = jax.jit(functools.partial(
    tk.invalidate_written_rows, interpret=INTERPRET,
    tuning=tk.InvalidateTuning(chunk=16, num_warps=2)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_then_resolve_refetches_rewritten_row(backend):
    """A rewritten host row is a miss again on the next resolve, never a stale hit."""
    cfg = hs.HiSparseConfig(top_k=4, hot_size=8, block_size=4, max_num_reqs=1, row_width=8,
                            kv_dtype="float32")
    kw = dict(state_rows=jnp.array([0], jnp.int32), hot_block_table=jnp.array([[3, 4]]),
              source_block_table=jnp.array([[1, 2]], jnp.int32), block_size=4, host_rows=12,
              backend=backend)
    topk = jnp.arange(4, dtype=jnp.int32)[None]
    _, state = hs.resolve_residency(hs.init_hot_state(cfg), topk, **kw)
    state = hs.invalidate_written_rows(state, jnp.array([0], jnp.int32),
                                       jnp.array([6], jnp.int32), backend=backend)  # t=2's row
    res, _ = hs.resolve_residency(state, topk, **kw)
    assert int(res.swap_counts[0]) == 1 and int(res.swap_src[0, 0]) == 6
    assert int(res.num_hits[0]) == 3


def test_validation_errors():
    state = hs.HotState(jnp.zeros((2, 8), jnp.int32), jnp.zeros((2, 8), jnp.int16))
    with pytest.raises(TypeError, match="state must be a HotState"):
        hs.invalidate_written_rows((state.slot_rows, state.lru), jnp.zeros(1, jnp.int32),
                                   jnp.zeros(1, jnp.int32))
    with pytest.raises(TypeError, match="written_rows must be int32"):
        hs.invalidate_written_rows(state, jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.float32))
    with pytest.raises(ValueError, match="must have the same length"):
        hs.invalidate_written_rows(state, jnp.zeros(1, jnp.int32), jnp.zeros(2, jnp.int32))


def test_tuning_knobs_are_validated():
    with pytest.raises(ValueError, match="chunk"):
        tk.InvalidateTuning(chunk=100)


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_kernel_and_sweep_variants_lower_to_triton():
    """The default and every candidate of the benchmark's sweep lower (T=256, H=4096)."""
    lower_for_cuda(tk.invalidate_written_rows, sds((256, 4096)), sds((256,)), sds((256,)))
    for tuning in INVALIDATE_VARIANTS.values():
        lower_for_cuda(functools.partial(tk.invalidate_written_rows, tuning=tuning),
                       sds((256, 4096)), sds((256,)), sds((256,)))


@pytest.mark.gpu
def test_gpu_invalidate_realistic():
    rng = np.random.default_rng(4)
    num_state, hot, tokens = 256, 4096, 256
    slot_rows = rng.integers(-1, 5000, size=(num_state, hot)).astype(np.int32)
    state_rows = rng.integers(-1, num_state, size=tokens).astype(np.int32)
    written = rng.integers(-1, 5000, size=tokens).astype(np.int32)
    state = hs.HotState(jnp.asarray(slot_rows), jnp.zeros((num_state, hot), jnp.int16))
    got = hs.invalidate_written_rows(state, jnp.asarray(state_rows), jnp.asarray(written))
    want = oracle_invalidate(slot_rows, state_rows, written)
    np.testing.assert_array_equal(np.asarray(got.slot_rows), want)
    for tuning in INVALIDATE_VARIANTS.values():          # every candidate of the sweep
        got = tk.invalidate_written_rows(jnp.asarray(slot_rows), jnp.asarray(state_rows),
                                         jnp.asarray(written), tuning=tuning)
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=repr(tuning))
