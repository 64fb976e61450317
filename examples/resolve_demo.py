"""A small HiSparse data-plane demo: drifting top-k selections served from a pinned host pool.

Each step, every request selects `top_k` of its context positions (a window that drifts by
`--turnover` of its positions per step, plus random far-away picks); `resolve_residency`
maps them to hot-region rows and plans the misses, `gather_compact` copies the misses from
the pinned host pool, and the script checks that every selected device row now holds
exactly the host row it stands for. Runs on the CPU in seconds.

Every argument is checked before any work: a bad value or combination prints one line naming
the flag and the rule and exits with status 2.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import hisparse_jax as hs
from hisparse_jax.config import MAX_HOT_SIZE
from host_tier import memory_sharding
from host_tier.sizes import cdiv
from host_tier.worker.host_pool import check_available_ram


def _int(text: str, least: int) -> int:
    """argparse type: an integer >= `least`."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= {least}, got {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be an int >= {least}, got {value}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int(text, 1)


def seed_int(text: str) -> int:
    """argparse type: an integer >= 0 (numpy's generator refuses negative seeds)."""
    return _int(text, 0)


def fraction(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}") from None
    if not 0 <= value <= 1:             # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="resolve_demo.py", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=positive_int, default=4,
                   help="requests, each with its own hot region and host pages")
    p.add_argument("--context", type=positive_int, default=4096,
                   help="tokens per request (all of them in the pinned host pool)")
    p.add_argument("--top-k", type=positive_int, default=256,
                   help="positions each request selects per step, <= --context")
    p.add_argument("--hot-size", type=positive_int, default=512,
                   help=f"hot-region rows per request, in [--top-k, {MAX_HOT_SIZE}]")
    p.add_argument("--block-size", type=positive_int, default=64, help="rows per block (page)")
    p.add_argument("--row-width", type=positive_int, default=576,
                   help="bfloat16 values per KV row, a multiple of 8 (16-byte rows)")
    p.add_argument("--steps", type=positive_int, default=20, help="decode steps to simulate")
    p.add_argument("--turnover", type=fraction, default=0.05,
                   help="share of each top-k replaced per step, in [0, 1] (at least one "
                        "position)")
    p.add_argument("--seed", type=seed_int, default=0, help="random seed, an int >= 0")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The rules between flags, before any work; `p.error` (exit 2) names the flags."""
    if args.top_k > args.context:
        p.error(f"--top-k {args.top_k} must be <= --context {args.context} (a request selects "
                f"distinct positions of its context)")
    if args.hot_size < args.top_k:
        p.error(f"--hot-size {args.hot_size} must be >= --top-k {args.top_k} (each miss of a "
                f"step needs its own hot slot)")
    if args.hot_size > MAX_HOT_SIZE:
        p.error(f"--hot-size {args.hot_size} must be <= {MAX_HOT_SIZE} (hot slot ids are int16)")
    if args.row_width % 8:
        p.error(f"--row-width {args.row_width} must be a multiple of 8 (bfloat16 rows of a "
                f"multiple of 16 bytes)")
    new = replaced_per_step(args)
    if args.top_k + new > args.context:
        p.error(f"--top-k {args.top_k} + the {new} positions --turnover {args.turnover:g} "
                f"replaces per step must be <= --context {args.context} (new picks come from "
                f"outside the current selection)")
    pages = cdiv(args.context, args.block_size)
    pool = (args.requests * pages + 1) * args.block_size * args.row_width * 2
    try:
        check_available_ram(pool, what="--requests x --context x --row-width")
    except ValueError as e:
        p.error(str(e))


def replaced_per_step(args: argparse.Namespace) -> int:
    """Positions of each request's selection replaced per step: --turnover of --top-k, at
    least one."""
    return max(1, int(args.turnover * args.top_k))


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)

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
        k_new = replaced_per_step(args)
        for r in range(n):
            outside = np.setdiff1d(np.arange(args.context), sel[r])   # >= k_new: check_args
            sel[r, rng.choice(args.top_k, k_new, replace=False)] = rng.choice(
                outside, k_new, replace=False)
    print(f"all {args.steps} steps exact | overall hit rate "
          f"{tot_hits / (tot_hits + tot_miss):.1%} | "
          f"{tot_miss * cfg.row_bytes / 2**20:.1f} MiB moved host -> device")


if __name__ == "__main__":
    main()
