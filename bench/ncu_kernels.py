"""One kernel launch at a given shape, for Nsight Compute (`ncu`) to profile.

  ncu --clock-control none --kernel-name regex:hisparse --launch-skip 2 --launch-count 1 \\
      python3 -m bench.ncu_kernels attention --n 64 --h 128 [--tuning bk32_s3] [--splits 8] \\
          [--kv-format fp8_ds_mla] [--backend mosaic_gpu --tuning row]
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

`sweep` (no ncu: one GPU call for the row-copy Mosaic GPU kernel's candidates):

  python3 -m bench.ncu_kernels sweep --json OUT.json [--shapes 64x128,256x128,64x16] \\
      [--budget-s 420]

runs the attention candidates (`_sweep_plan`: the Triton default as the same-run baseline, then
every row-copy variant; fp8_ds_mla rows first, then bf16) at K = 2048 over the op
benchmark's pool (2^19 random rows, 2% holes, one all-invalid query row). Each (candidate,
shape) is checked against the jnp reference on the same inputs (relative error of out, lse),
then timed: device time per call from the jax profiler (`kernel_us`: the longest kernel of
the call, the attention kernel at these shapes; `device_us`: everything the call runs, the
split-K merge included) and wall time per call; TFLOP/s = 2 N h_q K (576 + 512) / kernel_us.
Per row format, the first shape gets every candidate, the other shapes the baseline, the
row-copy default and the fastest correct row-copy variant of the first shape. A failing
build or a wrong result is recorded and the sweep goes on; the JSON is rewritten after every
figure, so a cut run keeps what it measured.
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

    if args.backend == "mosaic_gpu":       # the row-copy kernel's variants (fp8 and bf16 rows)
        rows_variants = (bench.mosaic_row_variants() if args.kv_format != kvf.BF16
                         else bench.mosaic_row_bf16_variants())
        tuning = _variant(args.tuning or "row", rows_variants)
    else:
        tuning = _variant(args.tuning, {**bench.ATTENTION_VARIANTS,
                                        **bench.ATTENTION_SWEEP_EXTRA})
    if args.splits:
        tuning = dataclasses.replace(tuning or triton.DEFAULT, num_splits=args.splits)
    kv = jax.random.normal(jax.random.key(1), (bench.POOL_ROWS, bench.WIDTH), jnp.bfloat16)
    if args.kv_format != kvf.BF16:
        kv = kvf.quantize(kv)
    q, rows = bench._inputs(jax.random.key(2), args.n, args.h, 1)
    fn = jax.jit(lambda q, kv, rows: hj.sparse_mla_decode(
        q, kv, rows, sm_scale=bench.SM_SCALE, backend=args.backend, config=tuning,
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
# `sweep` is not a single launch (`_sweep`, called from `main`).


# ------------------------------------------------------------------ sweep (one GPU call)

def _sweep_plan(only: str = "") -> list[tuple[str, str, str, object]]:
    """(kv_format, name, backend, config) of the candidates, in the order they run: per row
    format the Triton default (the baseline), then the row-copy kernel's variants; `only`
    (comma-separated names, "" for all) keeps those variants and the baselines."""
    from bench.ops import sparse_mla_decode as bench

    plan = [(kvf.FP8_DS_MLA, "triton", "triton", None)]
    plan += [(kvf.FP8_DS_MLA, v, "mosaic_gpu", c) for v, c in bench.mosaic_row_variants().items()]
    plan += [(kvf.BF16, "triton", "triton", None)]
    plan += [(kvf.BF16, v, "mosaic_gpu", c) for v, c in bench.mosaic_row_bf16_variants().items()]
    keep = {n for n in only.split(",") if n}
    unknown = keep - {name for _, name, _, _ in plan}
    if unknown:
        raise ValueError(f"--candidates names no variant: {sorted(unknown)}")
    return [c for c in plan if not keep or c[1] in keep | {"triton"}]


def _device_times(f, sets, reps: int) -> dict:
    """Device time per call of `f` over `reps` calls (jax profiler): all kernels (`device_us`)
    and the attention kernel's (`kernel_us`: the longest kernel of the call, the attention
    kernel at every benchmarked shape), with the top kernels' names."""
    import pathlib
    import tempfile

    from bench.profile_step import device_events, load_trace, summarise_device

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.enable_hlo_proto = False
    with tempfile.TemporaryDirectory(prefix="hisparse-sweep-") as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True,
                                profiler_options=options):
            jax.block_until_ready([f(*sets[i % len(sets)]) for i in range(reps)])
        trace = load_trace(pathlib.Path(trace_dir))
    summary = summarise_device(device_events(trace), reps) if trace else {}
    top = summary.get("top_kernels", [])
    if not top:
        return {"device_us": None, "kernel_us": None, "kernels": []}
    return {"device_us": summary["busy_us_per_step"], "kernel_us": top[0]["us_per_step"],
            "kernel_name": top[0]["name"][:120],
            "kernels": [{"name": k["name"][:100], "us": k["us_per_step"],
                         "calls": k["calls_per_step"]} for k in top[:4]]}


def _sweep_one(fmt, name, backend, cfg, n, h, pools, ref_cache) -> dict:
    """One (candidate, shape): correctness against the jnp reference, then device and wall
    time per call over 4 rotating input sets."""
    from bench._common import time_fn
    from bench.ops import sparse_mla_decode as bench

    entry = {"kv_format": fmt, "candidate": name, "backend": backend, "config": repr(cfg),
             "n": n, "h_q": h, "top_k": bench.TOP_K, "flops": bench.flops(n, h)}
    kv = pools[fmt]
    q, rows = bench._inputs(jax.random.key(n * 1000 + h), n, h, 4)
    rows = rows.at[0, -1, 0].set(bench.POOL_ROWS - 1)  # the pool's last row (fp8: read past)
    rows = rows.at[0, 0].set(-1)                       # an all-invalid query row
    sets = [(q[i], rows[i]) for i in range(4)]

    def op(q, rows, backend=backend, cfg=cfg):
        return hj.sparse_mla_decode(q, kv, rows, sm_scale=bench.SM_SCALE, kv_format=fmt,
                                    backend=backend, config=cfg)
    f = jax.jit(op)
    t0 = time.time()
    out, lse = jax.block_until_ready(f(*sets[0]))
    entry["compile_and_first_call_s"] = time.time() - t0
    key = (fmt, n, h)
    if key not in ref_cache:
        ref_cache[key] = jax.block_until_ready(
            jax.jit(lambda q, rows: op(q, rows, "reference", None))(*sets[0]))
    ref_out, ref_lse = ref_cache[key]
    a, b = np.asarray(out, np.float64), np.asarray(ref_out, np.float64)
    entry["rel_err_out"] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    lse, ref_lse = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)
    fin = np.isfinite(ref_lse)
    entry["lse_finite_match"] = bool(np.array_equal(np.isfinite(lse), fin))
    entry["max_abs_err_lse"] = float(np.max(np.abs(np.where(fin, lse, 0.0)
                                                   - np.where(fin, ref_lse, 0.0))))
    entry["dead_row_zero"] = bool(np.all(a[0] == 0.0))
    entry["nan"] = bool(np.isnan(a).any())
    entry["correct"] = (entry["rel_err_out"] < 1e-2 and entry["lse_finite_match"]
                        and entry["max_abs_err_lse"] < 0.1 and entry["dead_row_zero"]
                        and not entry["nan"])
    calls = iter(range(1 << 30))
    wall = time_fn(lambda: f(*sets[next(calls) % 4]), warmup=1 if bench.SMOKE else 2,
                   iters=1 if bench.SMOKE else 10)
    entry["wall_us"] = wall["median_us"]
    if jax.default_backend() == "gpu":
        entry.update(_device_times(f, sets, 12))
    if entry.get("kernel_us"):
        entry["tflops"] = entry["flops"] / (entry["kernel_us"] * 1e-6) / 1e12
        entry["rows_GBps"] = n * bench.TOP_K * bench.ROW_BYTES[fmt] / entry["kernel_us"] / 1e3
    return entry


def _sweep(path: str, shapes_text: str, budget_s: float, only: str = "") -> None:
    import json
    import traceback

    from bench.ops import sparse_mla_decode as bench

    t_start = time.time()
    plan, ref_cache = _sweep_plan(only), {}     # unknown --candidates: refused before any work
    shapes = [tuple(int(x) for x in s.split("x")) for s in shapes_text.split(",") if s]
    kv = jax.random.normal(jax.random.key(1), (bench.POOL_ROWS, bench.WIDTH), jnp.bfloat16)
    pools = {kvf.BF16: kv, kvf.FP8_DS_MLA: jax.block_until_ready(jax.jit(kvf.quantize)(kv))}
    payload = {"what": "attention candidates at K = 2048: correctness vs the jnp reference, "
                       "device time (jax profiler) and TFLOP/s",
               "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
               "shapes": shapes, "results": [], "complete": False}

    def save():
        with open(path, "w") as fh:
            json.dump(payload, fh, indent=1, default=str)

    def measure(fmt, name, backend, cfg, n, h):
        if time.time() - t_start > budget_s:
            payload["results"].append({"kv_format": fmt, "candidate": name, "n": n, "h_q": h,
                                       "skipped": "time budget"})
            return
        try:
            e = _sweep_one(fmt, name, backend, cfg, n, h, pools, ref_cache)
        except Exception as ex:  # noqa: BLE001 - record and go on
            e = {"kv_format": fmt, "candidate": name, "n": n, "h_q": h,
                 "error": f"{type(ex).__name__}: {ex}"[:3000],
                 "traceback": traceback.format_exc()[-3000:]}
        e["at_s"] = time.time() - t_start
        payload["results"].append(e)
        save()
        print(f"[sweep] {fmt:>10} {name:>14} N={n:<3} h={h:<3} " + (
            e["error"][:200] if "error" in e else
            f"err={e['rel_err_out']:.1e} ok={e['correct']} kernel={e.get('kernel_us') or 0:.1f}us "
            f"{e.get('tflops') or 0:.0f}TF/s device={e.get('device_us') or 0:.1f}us "
            f"wall={e['wall_us']:.1f}us") + f" ({e['at_s']:.0f}s)", flush=True)

    first, rest = shapes[0], shapes[1:]
    for fmt in (kvf.FP8_DS_MLA, kvf.BF16):          # fp8 rows (the target) first
        mine = [c for c in plan if c[0] == fmt]
        for _, name, backend, cfg in mine:
            measure(fmt, name, backend, cfg, *first)
        rows = [e for e in payload["results"] if e.get("kv_format") == fmt
                and e.get("correct") and e.get("backend") == "mosaic_gpu" and e.get("kernel_us")]
        best = min(rows, key=lambda e: e["kernel_us"])["candidate"] if rows else None
        payload[f"best_row_variant_{fmt}"] = best
        for shape in rest:
            for _, name, backend, cfg in mine:
                if name in ("triton", "row", best):
                    measure(fmt, name, backend, cfg, *shape)
    payload["complete"] = True
    payload["total_s"] = time.time() - t_start
    save()
    print(f"[sweep] wrote {path} in {payload['total_s']:.0f}s; best row-copy variants: "
          f"fp8 {payload.get('best_row_variant_fp8_ds_mla')}, "
          f"bf16 {payload.get('best_row_variant_bf16')}", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("op", choices=sorted(OPS) + ["sweep"])
    p.add_argument("--backend", default="triton", choices=("triton", "mosaic_gpu"),
                   help="attention: the kernel (mosaic_gpu: the row-copy kernel, whose variants "
                        "`--tuning` names: bench.ops.sparse_mla_decode.mosaic_row_variants)")
    p.add_argument("--json", default="", help="sweep: where to write the JSON results")
    p.add_argument("--candidates", default="",
                   help="sweep: comma-separated row-copy variants to run (default: all; the "
                        "Triton baselines always run)")
    p.add_argument("--shapes", default="64x128,256x128,64x16",
                   help="sweep: N x h_q shapes, K = 2048 (the first gets every candidate)")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="sweep: stop starting new measurements after this many seconds")
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
    if args.op == "sweep":
        if not args.json:
            p.error("sweep needs --json PATH")
        _sweep(args.json, args.shapes, args.budget_s, args.candidates)
        return
    if args.backend != "triton" and args.op != "attention":
        p.error(f"--backend is for attention, got {args.backend!r} for {args.op}")
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
