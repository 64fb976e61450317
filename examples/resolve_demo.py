"""A small HiSparse data-plane demo: drifting top-k selections served from a pinned host pool.

Each step, every request selects `top_k` of its context positions (a window that drifts by
`--turnover` of its positions per step, plus random far-away picks); `resolve_residency`
maps them to hot-region rows and plans the misses, `gather_compact` copies the misses from
the pinned host pool, and the script checks that every selected device row now holds
exactly the host row it stands for. Runs on the CPU in seconds.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import hisparse_jax as hs
from host_tier import memory_sharding
from host_tier.sizes import cdiv


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--context", type=int, default=4096, help="tokens per request")
    p.add_argument("--top-k", type=int, default=256)
    p.add_argument("--hot-size", type=int, default=512)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--row-width", type=int, default=576)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--turnover", type=float, default=0.05, help="share of top-k replaced/step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    cfg = hs.HiSparseConfig(top_k=args.top_k, hot_size=args.hot_size,
                            block_size=args.block_size, max_num_reqs=args.requests,
                            row_width=args.row_width, kv_dtype="bfloat16")
    rng = np.random.default_rng(args.seed)
    n, b = args.requests, args.block_size
    pages = cdiv(args.context, b)
    host_rows = (n * pages + 1) * b                        # block 0 is the null block
    dev = jax.devices()[0]
    pinned = memory_sharding(dev, "pinned_host")
    pool_np = rng.standard_normal((host_rows, cfg.row_width)).astype(cfg.kv_dtype)
    host_pool = jax.device_put(pool_np, pinned)
    src = (1 + np.arange(n * pages).reshape(n, pages)).astype(np.int32)
    hot_table = (1 + np.arange(n * cfg.hot_blocks).reshape(n, cfg.hot_blocks)).astype(np.int32)
    kv_cache = jnp.zeros((1 + n * cfg.hot_blocks, b, cfg.row_width), cfg.kv_dtype)
    state = hs.init_hot_state(cfg)
    kw = dict(state_rows=jnp.arange(n, dtype=jnp.int32), hot_block_table=jnp.asarray(hot_table),
              source_block_table=jnp.asarray(src), block_size=b, host_rows=host_rows)

    sel = np.stack([rng.choice(args.context, args.top_k, replace=False) for _ in range(n)])
    print(f"{jax.default_backend()} | {n} requests x {args.context} tokens | top_k "
          f"{args.top_k}, hot {args.hot_size} | host pool {pool_np.nbytes / 2**20:.1f} MiB "
          f"pinned | device hot rows {kv_cache.nbytes / 2**20:.1f} MiB")
    print(f"{'step':>4} {'hits':>6} {'misses':>7} {'hit rate':>8} {'MiB moved':>9} {'ms':>7}")
    tot_hits = tot_miss = 0
    for step in range(args.steps):
        t0 = time.perf_counter()
        res, state = hs.resolve_residency(state, jnp.asarray(sel.astype(np.int32)), **kw)
        kv_cache = hs.gather_compact(host_pool, kv_cache, res.swap_src, res.swap_dst,
                                     res.swap_counts)
        jax.block_until_ready(kv_cache)
        ms = (time.perf_counter() - t0) * 1e3
        # Exactness: each selected row on the device equals its host row.
        rows = np.asarray(res.attention_rows)
        got = np.asarray(kv_cache).reshape(-1, cfg.row_width)[rows.reshape(-1)]
        g = src[np.arange(n)[:, None], sel // b] * b + sel % b
        assert np.array_equal(got, pool_np[g.reshape(-1)]), "served row differs from host"
        hits, misses = int(res.num_hits.sum()), int(res.swap_counts.sum())
        tot_hits += hits
        tot_miss += misses
        moved = misses * cfg.row_bytes / 2**20
        print(f"{step:>4} {hits:>6} {misses:>7} {hits / (hits + misses):>8.1%} {moved:>9.2f} "
              f"{ms:>7.1f}")
        # Drift: replace `turnover` of each request's selection with fresh positions.
        for r in range(n):
            k_new = max(1, int(args.turnover * args.top_k))
            fresh = np.setdiff1d(rng.choice(args.context, 4 * k_new, replace=False), sel[r])
            sel[r, rng.choice(args.top_k, k_new, replace=False)] = fresh[:k_new]
    print(f"all {args.steps} steps exact | overall hit rate "
          f"{tot_hits / (tot_hits + tot_miss):.1%} | "
          f"{tot_miss * cfg.row_bytes / 2**20:.1f} MiB moved host -> device")


if __name__ == "__main__":
    main()
