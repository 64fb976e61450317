"""Reference resolve_residency time for N in {1, 8, 64, 256}, K=2048, H=4096.

The baseline the Pallas resolve kernel must beat. Each step replays a warm state with 5%
of every row's top-k replaced (the realistic mix of hits and misses); the figure is the
median wall time of one jitted call (launch included), synchronised.
Run: `PYTHONPATH=. python3 -m bench.bench_resolve [--backend reference|pallas]`.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

import hisparse_jax as hs
from bench._common import time_fn, write_result

K, H, B = 2048, 4096, 64
CONTEXT = 65536


def setup(n: int, rng: np.random.Generator):
    cfg = hs.HiSparseConfig(top_k=K, hot_size=H, block_size=B, max_num_reqs=n)
    pages = CONTEXT // B
    src = (1 + np.arange(n * pages).reshape(n, pages)).astype(np.int32)
    hot_table = (1 + np.arange(n * cfg.hot_blocks).reshape(n, cfg.hot_blocks)).astype(np.int32)
    kw = dict(state_rows=jnp.arange(n, dtype=jnp.int32), hot_block_table=jnp.asarray(hot_table),
              source_block_table=jnp.asarray(src), block_size=B, host_rows=(n * pages + 1) * B)
    sel = np.stack([rng.choice(CONTEXT, K, replace=False) for _ in range(n)]).astype(np.int32)
    drift = sel.copy()
    for r in range(n):
        k_new = K // 20
        fresh = np.setdiff1d(rng.choice(CONTEXT, 4 * k_new, replace=False), sel[r])[:k_new]
        drift[r, rng.choice(K, k_new, replace=False)] = fresh
    return cfg, kw, jnp.asarray(sel), jnp.asarray(drift)


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="reference")
    p.add_argument("--sizes", default="1,8,64,256")
    args = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for n in [int(x) for x in args.sizes.split(",")]:
        cfg, kw, sel, drift = setup(n, rng)
        _, warm = hs.resolve_residency(hs.init_hot_state(cfg), sel, backend=args.backend, **kw)
        res, _ = hs.resolve_residency(warm, drift, backend=args.backend, **kw)
        misses = int(res.swap_counts.sum())
        t = time_fn(lambda warm=warm, drift=drift, kw=kw: hs.resolve_residency(
            warm, drift, backend=args.backend, **kw), iters=10 if n >= 64 else 20)
        rows.append({"N": n, "K": K, "H": H, "misses": misses, **t})
        print(f"N={n:4d} K={K} H={H}: {t['median_us']:10.1f} us median "
              f"({misses} misses in the step)")
    path = write_result(f"resolve_{args.backend}", {
        "what": "resolve_residency wall time per jitted call (median), warm state, 5% turnover",
        "backend": args.backend, "results": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
