"""sparse_mla_decode_with_copies: one layer's attention and other layers' copies from host in
one call (the Triton kernel: one launch). Against the two ops it joins, bit for bit, on every
backend: the attention's outputs equal `sparse_mla_decode`'s on the same backend, the caches
`gather_compact_group`'s and the numpy oracle's (poisoned caches, packed and per-layer pools,
bf16 and fp8_ds_mla rows, 1 to 64 copy programs, empty plans); the float64 reference holds
for the attention. Validation names the argument. The kernel's CUDA lowering; on the GPU
(`pytest -m gpu`) the compiled kernel at the engine's shapes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_jax.ops import (
    gather_compact_group,
    sparse_mla_decode,
    sparse_mla_decode_with_copies,
)
from pallas_kernels import kv_format as kvf
from pallas_kernels.sparse_mla_decode import triton as tk
from tests.ops import (
    backends,
    bits,
    examples,
    lower_for_cuda,
    pack_layers,
    random_bytes,
    sds,
    to_host,
)
from tests.ops.test_sparse_mla_decode import SM_SCALE, assert_close
from tests.oracle import oracle_gather

BACKENDS = backends("sparse_mla_decode_with_copies")
BLOCK = 16


def make_case(seed, *, n=3, h=16, top_k=64, num_rows=256, layers=2, packed=False,
              fp8=False, misses=20, host_rows=512):
    """q, the attended layer's cache, its rows (holes anywhere), `layers` other layers'
    poisoned caches and pinned pools (packed: one array [.., layers * Ws]) and a swap plan
    of up to `misses` distinct destinations per row (some rows with none, some entries -1)."""
    rng = np.random.default_rng(seed)
    width = 576
    q = jnp.asarray(rng.standard_normal((n, h, width)), jnp.bfloat16)
    blocks = num_rows // BLOCK
    if fp8:
        kv = kvf.quantize(jnp.asarray(rng.standard_normal((blocks, BLOCK, width)),
                                      jnp.float32))
        row = kvf.FP8_ROW_BYTES
        pools = [random_bytes(rng, (host_rows // BLOCK, BLOCK, row)) for _ in range(layers)]
        caches = [jnp.full((blocks, BLOCK, row), 0xFF, jnp.uint8) for _ in range(layers)]
    else:
        kv = jnp.asarray(rng.standard_normal((blocks, BLOCK, width)), jnp.bfloat16)
        row = width
        pools = [rng.standard_normal((host_rows // BLOCK, BLOCK, row)).astype(jnp.bfloat16)
                 for _ in range(layers)]
        caches = [jnp.full((blocks, BLOCK, row), jnp.nan, jnp.bfloat16)
                  for _ in range(layers)]
    rows = rng.integers(0, num_rows, size=(n, top_k)).astype(np.int32)
    rows[rng.random(rows.shape) < 0.2] = -1
    src = np.full((n, top_k), -1, np.int32)
    dst = np.full((n, top_k), -1, np.int32)
    counts = rng.integers(0, misses + 1, size=n).astype(np.int32)
    counts[0] = misses                                    # at least one row copies
    dests = rng.permutation(num_rows)[: n * misses].reshape(n, misses)
    for t in range(n):
        c = counts[t]
        src[t, :c] = rng.choice(host_rows, c, replace=False)
        dst[t, :c] = dests[t, :c]
    src[rng.random(src.shape) < 0.05] = -1                # dropped entries write nothing
    host = [to_host(p) for p in (pack_layers(pools, layers) if packed else pools)]
    return (q, kv, jnp.asarray(rows), host, pools, caches, jnp.asarray(src), jnp.asarray(dst),
            jnp.asarray(counts))


def _check(backend, seed, *, programs, **kw):
    q, kv, rows, host, pools, caches, src, dst, counts = make_case(seed, **kw)
    fmt = kvf.FP8_DS_MLA if kw.get("fp8") else kvf.BF16
    out, lse, got = sparse_mla_decode_with_copies(
        q, kv, rows, host, [c.copy() for c in caches], src, dst, counts, sm_scale=SM_SCALE,
        kv_format=fmt, copy_programs=programs, backend=backend)
    want_out, want_lse = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, kv_format=fmt,
                                           backend=backend)
    want = gather_compact_group(host, [c.copy() for c in caches], src, dst, counts,
                                backend=backend)
    np.testing.assert_array_equal(bits(out), bits(want_out))
    np.testing.assert_array_equal(bits(lse), bits(want_lse))
    assert isinstance(got, tuple) and len(got) == len(caches)
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_array_equal(bits(g), bits(w))
        oracle = oracle_gather(pools[layer], np.asarray(caches[layer]), np.asarray(src),
                               np.asarray(dst), np.asarray(counts))
        np.testing.assert_array_equal(bits(g), bits(oracle))
    if fmt == kvf.BF16:
        assert_close(out, lse, q, kv, rows)
    return got


@pytest.mark.parametrize("backend", BACKENDS)
@settings(max_examples=examples(0.2), deadline=None)
@given(seed=st.integers(0, 2**31 - 1), programs=st.sampled_from([1, 3, 32, 64]),
       packed=st.booleans(), layers=st.sampled_from([1, 2]))
def test_equals_the_two_ops(backend, seed, programs, packed, layers):
    _check(backend, seed, programs=programs, packed=packed, layers=layers)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_rows_and_two_head_blocks(backend):
    _check(backend, 7, programs=5, fp8=True, h=64)
    _check(backend, 8, programs=2, h=128, n=2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_empty_plan_or_no_layers_copies_nothing(backend):
    q, kv, rows, host, _, caches, src, dst, counts = make_case(3)
    out, lse, got = sparse_mla_decode_with_copies(
        q, kv, rows, host, caches, src, dst, jnp.zeros_like(counts), sm_scale=SM_SCALE,
        backend=backend)
    for g, c in zip(got, caches, strict=True):
        np.testing.assert_array_equal(bits(g), bits(c))
    want_out, _ = sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend=backend)
    np.testing.assert_array_equal(bits(out), bits(want_out))
    out, _, none = sparse_mla_decode_with_copies(q, kv, rows, (), (), src, dst, counts,
                                                 sm_scale=SM_SCALE, backend=backend)
    assert none == ()
    np.testing.assert_array_equal(bits(out), bits(want_out))



@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_past_the_cache_and_repeated_destinations(backend):
    """Both ops' value rules: outside jit an attention entry >= R and two live copies into
    one row raise (naming the entries); under jit the entry past the cache is masked as -1
    is, on every backend (bit for bit the output of the rows with -1 there)."""
    q, kv, rows, host, _, caches, src, dst, counts = make_case(5)
    r = kv.shape[0] * kv.shape[1]
    past = rows.at[0, 1].set(r + 3)
    kw = dict(sm_scale=SM_SCALE, backend=backend)
    with pytest.raises(ValueError, match=rf"attention_rows\[0, 1\] = {r + 3} is not a row"):
        sparse_mla_decode_with_copies(q, kv, past, host, [c.copy() for c in caches], src,
                                      dst, counts, **kw)
    twice = dst.at[0, 1].set(dst[0, 0])                  # counts[0] > 1: both live
    with pytest.raises(ValueError, match=r"swap_dst\[0, 0\] and swap_dst\[0, 1\] both "
                                         r"write device row"):
        sparse_mla_decode_with_copies(q, kv, rows, host, [c.copy() for c in caches], src,
                                      twice, counts, **kw)
    run = jax.jit(lambda x, cs: sparse_mla_decode_with_copies(q, kv, x, host, cs, src, dst,
                                                              counts, **kw)[:2])
    out, lse = run(past, [c.copy() for c in caches])
    want_out, want_lse = run(rows.at[0, 1].set(-1), [c.copy() for c in caches])
    np.testing.assert_array_equal(bits(out), bits(want_out))
    np.testing.assert_array_equal(bits(lse), bits(want_lse))

@pytest.mark.parametrize("change, exc, match", [
    ({"copy_programs": 0}, ValueError, "copy_programs must be >= 1"),
    ({"copy_programs": 2.5}, TypeError, "copy_programs must be a static Python int"),
    ({"sm_scale": -1.0}, ValueError, "sm_scale must be a finite positive float"),
    ({"swap_counts": jnp.zeros((5,), jnp.int32)}, ValueError, "swap_counts has 5 entries"),
    ({"kv_caches": ()}, ValueError, "host_pools"),
])
def test_bad_arguments_name_the_argument(change, exc, match):
    q, kv, rows, host, _, caches, src, dst, counts = make_case(0)
    args = {"q": q, "kv_cache": kv, "attention_rows": rows, "host_pools": host,
            "kv_caches": caches, "swap_src": src, "swap_dst": dst, "swap_counts": counts,
            "sm_scale": SM_SCALE, "copy_programs": 4, **change}
    with pytest.raises(exc, match=match):
        sparse_mla_decode_with_copies(**args)


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_the_kernel_lowers_to_triton():
    """At the engine's shapes: 256 rows, 128 heads, K = 2048, two packed layers' copies."""
    fn = functools.partial(tk.sparse_mla_decode_with_copies, sm_scale=0.1, copy_programs=32)
    text = lower_for_cuda(
        lambda q, kv, rows, pool, c0, c1, s, d, n: fn(q, kv, rows, (pool,), (c0, c1), s, d, n),
        sds((256, 128, 576), jnp.bfloat16), sds((1 << 16, 576), jnp.bfloat16),
        sds((256, 2048)), sds((4096, 64, 1152), jnp.bfloat16),
        sds((1024, 64, 576), jnp.bfloat16), sds((1024, 64, 576), jnp.bfloat16),
        sds((256, 2048)), sds((256, 2048)), sds((256,)))
    assert "hisparse_sparse_mla_decode_copies" in text


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [16, 32])
def test_gpu_at_the_engines_shapes(programs):
    # 64 rows of 128 heads, K = 2048, two layers' copies of ~100 misses per row from pools of
    # 64K rows each: the compiled kernel equals the two ops bit for bit.
    _check(None, 11, programs=programs, n=64, h=128, top_k=2048, num_rows=1 << 17,
           misses=100, host_rows=1 << 16, layers=2)
    _check(None, 12, programs=programs, n=8, h=128, top_k=2048, num_rows=1 << 16,
           misses=100, host_rows=1 << 15, layers=2, packed=True, fp8=True)
