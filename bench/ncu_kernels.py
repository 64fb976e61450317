"""One kernel launch at a given shape, for Nsight Compute (`ncu`) to profile.

  ncu --clock-control none --kernel-name regex:hisparse --launch-skip 2 --launch-count 1 \\
      python3 -m bench.ncu_kernels attention --n 64 --h 128 [--tuning bk32_s3] [--splits 8] \\
          [--kv-format fp8_ds_mla]
  ... python3 -m bench.ncu_kernels resolve --n 64 [--rule map]
  ... python3 -m bench.ncu_kernels gather --rows 27648 [--plan step] [--pool-gib 16]

Runs the op three times on the same inputs (compile, warm, then the launch the profiler is
told to take with --launch-skip 2), blocks after each, prints the wall time of the last. The
inputs are the op benchmarks' (`bench/ops/*`): attention over a 604 MB pool of random bf16
rows with 2% holes, resolve over 3 chained decode steps of drifting top-k (the profiled
launch is the third, on a warm LRU; `--rule map`: the position map kernel,
`resolve_residency_mapped`, on the map those steps built), gather of random rows of a
pinned_host pool, as one dense plan or as an engine step's (256 batch rows with a few
misses each: the kernel's grid has one program per 16 entries of every row, most with
nothing to copy), from the
benchmark's 604 MB pool or a larger one (`--pool-gib`). HISPARSE_BENCH_SMALL=1: the
benchmarks' small CPU shapes, kernels interpreted. The suite step `ncu`
(`bench/gpu_suite.sh`) runs it under ncu per shape; what the profiles said is in
`bench/NOTES-sparse_mla.md` and `bench/NOTES-data_plane.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

import hisparse_jax as hj
from pallas_kernels import kv_format as kvf


def _variant(name: str, variants: dict):
    """The sweep variant `name` ("" = None: the kernel's default); refuses unknown names."""
    if name and name not in variants:
        raise SystemExit(f"--tuning must be one of {sorted(variants)} for this op, got {name!r}")
    return variants[name] if name else None


def _attention(args) -> list:
    from bench.ops import sparse_mla_decode as bench
    from pallas_kernels.sparse_mla_decode import triton

    tuning = _variant(args.tuning, {**bench.ATTENTION_VARIANTS, **bench.ATTENTION_SWEEP_EXTRA})
    if args.splits:
        tuning = dataclasses.replace(tuning or triton.DEFAULT, num_splits=args.splits)
    kv = jax.random.normal(jax.random.key(1), (bench.POOL_ROWS, bench.WIDTH), jnp.bfloat16)
    if args.kv_format != kvf.BF16:
        kv = kvf.quantize(kv)
    q, rows = bench._inputs(jax.random.key(2), args.n, args.h, 1)
    fn = jax.jit(lambda q, kv, rows: hj.sparse_mla_decode(
        q, kv, rows, sm_scale=bench.SM_SCALE, backend="triton", config=tuning,
        kv_format=args.kv_format))
    return [lambda: fn(q[0], kv, rows[0])] * 3


def _resolve(args) -> list:
    from bench.ops import BLOCK
    from bench.ops import resolve_residency as bench
    from pallas_kernels.resolve_residency.triton import DEFAULT

    tuning = _variant(args.tuning, bench.RESOLVE_VARIANTS) or DEFAULT
    k, hot = 2048, 4096
    topks, src_table, hot_table, res_table, host_rows = bench._inputs(
        args.n, k, hot, np.random.default_rng(0), 3)
    tables = (jnp.arange(args.n, dtype=jnp.int32), hot_table, src_table, res_table)
    state = hj.init_hot_state(hj.HiSparseConfig(top_k=k, hot_size=hot, block_size=BLOCK,
                                                max_num_reqs=args.n))
    if args.rule == "map":
        step = jax.jit(bench._mapped_step(tuning, tables, host_rows))
        carry = [state.slot_rows, state.lru,
                 jnp.full((args.n, src_table.shape[1] * BLOCK), -1, jnp.int16)]
    else:
        step = jax.jit(bench._step(tuning, tables, host_rows))
        carry = [state.slot_rows, state.lru]

    def call(i):
        def run():
            outs = step(*carry, topks[i])
            carry[:] = outs[6:6 + len(carry)]
            return outs
        return run
    return [call(i) for i in range(3)]


def _gather(args) -> list:
    from bench.ops import BLOCK, SMALL, WIDTH, rand_bf16, sharding
    from bench.ops.gather_compact import swap_plan

    if args.tuning:
        raise SystemExit("--tuning is for attention and resolve")

    rng = np.random.default_rng(0)
    if args.pool_gib > 0:            # zeros made on the device, moved to pinned host
        host_blocks = max(1, int(args.pool_gib * 2**30) // (BLOCK * WIDTH * 2))
        pool = jax.device_put(jnp.zeros((host_blocks, BLOCK, WIDTH), jnp.bfloat16),
                              sharding("pinned_host"))
    else:
        host_blocks = 64 if SMALL else 1 << 13                  # 604 MB of pinned rows
        pool = jax.device_put(rand_bf16(rng, (host_blocks, BLOCK, WIDTH)),
                              sharding("pinned_host"))
    host_rows = host_blocks * BLOCK
    if args.rows > host_rows:
        raise SystemExit(f"--rows must be at most the pool's {host_rows} rows, "
                         f"got {args.rows}")
    if args.plan == "dense":         # rows // 2048 batch rows of 2048 misses each
        n = max(1, args.rows // 2048)
        k = args.rows // n
        per_row = k
    else:                            # an engine step's plan: 256 rows of K = 2048, few misses
        n, k = 256, 2048
        per_row = min(k, max(1, args.rows // n))
    src, dst, counts, num_blocks = swap_plan(rng, n, k, per_row, host_rows, n * per_row)
    holder = [jax.device_put(jnp.zeros((num_blocks, BLOCK, WIDTH), jnp.bfloat16),
                             sharding("device"))]

    copy = jax.jit(functools.partial(hj.gather_compact, backend="triton"), donate_argnums=(1,))

    def run():
        holder[0] = copy(pool, holder[0], src, dst, counts)
        return holder[0]
    return [run] * 3


OPS = {"attention": _attention, "resolve": _resolve, "gather": _gather}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("op", choices=sorted(OPS))
    p.add_argument("--n", type=int, default=64, help="query rows (attention, resolve)")
    p.add_argument("--h", type=int, default=128, help="query heads (attention)")
    p.add_argument("--rows", type=int, default=27648, help="rows copied (gather)")
    p.add_argument("--plan", choices=("dense", "step"), default="dense",
                   help="gather: `dense` (rows // 2048 batch rows, every entry a miss) or "
                        "`step` (an engine step's plan: 256 batch rows of K = 2048 entries, "
                        "rows // 256 misses each)")
    p.add_argument("--pool-gib", type=float, default=0.0,
                   help="gather: host pool size in GiB (zeros); 0 = the benchmark's 604 MB "
                        "of random rows")
    p.add_argument("--tuning", default="", help="a variant name of the op's benchmark sweep")
    p.add_argument("--rule", default="search", choices=("search", "map"),
                   help="resolve: the search rule (no position map) or the position map rule")
    p.add_argument("--kv-format", default=kvf.BF16, choices=kvf.KV_FORMATS,
                   help="attention: the KV rows' format (fp8_ds_mla: the bf16 pool quantized)")
    p.add_argument("--splits", type=int, default=0,
                   help="attention: K splits per (row, head block) (`num_splits`; 0 = the "
                        "tuning's own)")
    args = p.parse_args(argv)
    if args.n < 1 or args.h < 1 or args.rows < 1:
        p.error("--n, --h and --rows must be >= 1")
    if args.pool_gib < 0:
        p.error(f"--pool-gib must be >= 0, got {args.pool_gib}")
    if args.kv_format != kvf.BF16 and args.op != "attention":
        p.error(f"--kv-format is for attention, got {args.kv_format!r} for {args.op}")
    if args.rule != "search" and args.op != "resolve":
        p.error(f"--rule is for resolve, got {args.rule!r} for {args.op}")
    if args.splits < 0 or (args.splits and args.op != "attention"):
        p.error(f"--splits is for attention and must be >= 0, got {args.splits}")
    t = 0.0
    for call in OPS[args.op](args):
        t0 = time.perf_counter()
        jax.block_until_ready(call())
        t = time.perf_counter() - t0
    print(f"{args.op}: last call {t * 1e6:.1f} us wall", flush=True)


if __name__ == "__main__":
    main()
