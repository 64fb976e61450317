"""Another layer's copies from host beside this layer's attention, in one launch, against the
copy kernel then the attention kernel, at the engine's shapes.

Run on the GPU machine: `PYTHONPATH=. python3 -m bench.ops.copies_beside_attention`. Writes
`bench/results/copies_beside_attention-<backend>.json`.

One decode step of two layers at 256 requests (128 heads, 576-wide bf16 rows, top-k 2048,
about 5% of each row's entries copied from host per layer, as `bench/e2e_decode.py` measures
at 5% turnover; one pinned pool per layer):

  * "attention": `sparse_mla_decode` alone;
  * "copy": the copy kernel alone (`gather_compact_group` of one layer's misses);
  * "copy_then_attention": both, one after the other (the engine's step without the option);
  * "copies_beside_attention[programs=P]": `sparse_mla_decode_with_copies`, the copies of
    the other layer by P programs in the attention's launch (`copy_with_attention`).

Device us per step by `unrolled_us` (steps unrolled in one jit, minus one), each step on its
own plan (no pool row of a step is in L2 from the step before), alternating the two layers.
The joint call's outputs are compared bit for bit with the two kernels'.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench.ops import BLOCK, SMALL, WIDTH, Run, sharding, unrolled_us
from hisparse_jax.ops import gather_compact_group, sparse_mla_decode, sparse_mla_decode_with_copies

HOST = sharding("pinned_host")
PROGRAMS = (16, 32, 64)


def _plans(rng, *, steps, n, k, misses, cache_rows, host_rows):
    """`steps` plans of n rows x k entries: attention rows distinct across the batch, random
    over the cache; `misses` random entries per row are copied from distinct random host rows
    into their own device rows (as a lookup's misses land in the rows attention then reads).
    Each plan: (rows, swap_src, swap_dst, counts)."""
    plans = []
    for _ in range(steps):
        rows = rng.permutation(cache_rows)[: n * k].reshape(n, k).astype(np.int32)
        src = rng.permutation(host_rows)[: n * misses].reshape(n, misses).astype(np.int32)
        cols = np.sort(rng.random((n, k)).argsort(axis=1)[:, :misses], axis=1)
        swap_src = np.full((n, k), -1, np.int32)
        swap_dst = np.full((n, k), -1, np.int32)
        swap_src[:, :misses] = src
        swap_dst[:, :misses] = np.take_along_axis(rows, cols, axis=1)
        plans.append(tuple(jnp.asarray(a) for a in (rows, swap_src, swap_dst))
                     + (jnp.full((n,), misses, jnp.int32),))
    return plans


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--heads", type=int, default=128)
    p.add_argument("--top-k", type=int, default=2048)
    p.add_argument("--miss-fraction", type=float, default=0.05)
    p.add_argument("--cache-rows", type=int, default=1 << 20)
    p.add_argument("--pool-gib", type=float, default=8.0, help="pinned pool per layer")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args(argv)
    if SMALL:
        args.requests, args.heads, args.top_k = 4, 16, 128
        args.cache_rows, args.pool_gib, args.steps = 4096, 0.01, 3
    n, h, k = args.requests, args.heads, args.top_k
    misses = max(1, int(round(args.miss_fraction * k)))
    host_blocks = int(args.pool_gib * 2**30) // (BLOCK * WIDTH * 2)
    cache_blocks = args.cache_rows // BLOCK
    run = Run("copies_beside_attention", sweep_budget_s=0)
    layers = 2
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * layers + 1)

    def rand(key, shape):
        return jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)

    pools = tuple(jax.device_put(rand(keys[i], (host_blocks, BLOCK, WIDTH)), HOST)
                  for i in range(layers))
    caches = tuple(rand(keys[layers + i], (cache_blocks, BLOCK, WIDTH)) for i in range(layers))
    q = rand(keys[-1], (n, h, WIDTH))
    plans = _plans(np.random.default_rng(0), steps=args.steps, n=n, k=k, misses=misses,
                   cache_rows=cache_blocks * BLOCK, host_rows=host_blocks * BLOCK)
    sm = WIDTH ** -0.5
    # The kernels, compiled on the GPU, in Pallas interpret mode on the CPU (the smoke run).
    backend = "triton"
    run.results["setup"] = {"requests": n, "heads": h, "top_k": k, "misses_per_row": misses,
                            "cache_rows": cache_blocks * BLOCK, "pool_rows": host_blocks * BLOCK,
                            "pool_gib_per_layer": args.pool_gib, "steps": args.steps}
    # A step's state: (the layers' caches, a float32 sum of one output element per step, so
    # that no output is dead code); its inputs (pools, q, plans) are arguments of the jit.
    consts = (pools, q, plans)

    def attention(state, i, consts):
        (caches, acc), (_, q, plans) = state, consts
        out, _ = sparse_mla_decode(q, caches[i % layers], plans[i % len(plans)][0],
                                   sm_scale=sm, backend=backend)
        return caches, acc + out[0, 0, 0].astype(jnp.float32)

    def copy(state, i, consts):
        (caches, acc), (pools, _, plans) = state, consts
        lay = (i + 1) % layers                        # the other layer, as beside() copies
        _, src, dst, counts = plans[(i + 1) % len(plans)]
        (new,) = gather_compact_group((pools[lay],), (caches[lay],), src, dst, counts,
                                      backend=backend, validate=False)
        return tuple(new if j == lay else c for j, c in enumerate(caches)), acc

    def copy_then_attention(state, i, consts):
        return attention(copy(state, i, consts), i, consts)

    def beside(state, i, consts, programs):
        (caches, acc), (pools, q, plans) = state, consts
        lay, other = i % layers, (i + 1) % layers
        _, src, dst, counts = plans[(i + 1) % len(plans)]
        out, _, (new,) = sparse_mla_decode_with_copies(
            q, caches[lay], plans[i % len(plans)][0], (pools[other],), (caches[other],),
            src, dst, counts, sm_scale=sm, copy_programs=programs, backend=backend,
            validate=False)
        return (tuple(new if j == other else c for j, c in enumerate(caches)),
                acc + out[0, 0, 0].astype(jnp.float32))

    def figure(step):
        return lambda: {"device_us_per_layer": unrolled_us(step, (caches, jnp.float32(0)),
                                                           args.steps, consts)}

    steps = {"attention": attention, "copy": copy, "copy_then_attention": copy_then_attention,
             **{f"copies_beside_attention[programs={p}]": functools.partial(beside, programs=p)
                for p in PROGRAMS}}
    for name, step in steps.items():
        run.record(name, figure(step))

    def exact() -> dict[str, Any]:
        rows = plans[0][0]
        _, src, dst, counts = plans[1]
        # The copy op updates its caches in place (donated): each call gets its own copies.
        (want_cache,) = gather_compact_group((pools[1],), (jnp.copy(caches[1]),), src, dst,
                                             counts, backend=backend)
        want_out, want_lse = sparse_mla_decode(q, caches[0], rows, sm_scale=sm, backend=backend)
        out, lse, (cache,) = sparse_mla_decode_with_copies(
            q, caches[0], rows, (pools[1],), (jnp.copy(caches[1]),), src, dst, counts,
            sm_scale=sm, backend=backend)
        return {"out_equal": bool(jnp.array_equal(out, want_out)),
                "lse_equal": bool(jnp.array_equal(lse, want_lse)),
                "cache_equal": bool(jnp.array_equal(cache, want_cache))}

    run.record("exact", exact)
    r = run.results
    both = r["copy_then_attention"].get("device_us_per_layer")
    for name in steps:
        us = r[name].get("device_us_per_layer")
        if us is None:
            continue
        ratio = ""
        if name.startswith("copies_beside") and both:
            r[name]["ratio_copy_then_attention_over_this"] = both / us
            ratio = f"  {both / us:.2f}x faster than copy then attention"
        run.table.append(f"{name:40s} {us:8.1f} us per layer{ratio}")
    run.table.append(f"exact: {r.get('exact')}")
    run.finish()


if __name__ == "__main__":
    main()
