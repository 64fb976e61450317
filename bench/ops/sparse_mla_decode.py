"""sparse_mla_decode benchmark on the GPU: kernel candidates vs the jnp reference.

Run from the repository root: `PYTHONPATH=. python3 -m bench.ops.sparse_mla_decode`. Within
240 s on an H200 (`BUDGET_S`). Writes `bench/results/sparse_mla_decode-<backend>.json` after
every measurement (a timeout still leaves the figures so far); prints a table last.

Phase 1 compares the candidates (`CANDIDATES`: the Triton kernel's tuning variants,
`ATTENTION_VARIANTS` then the benchmark-only `ATTENTION_SWEEP_EXTRA`) at N=64 with h_q=128
and h_q=16, in this process: a candidate that fails to compile or computes wrong numbers is
reported and the rest still run. Each is checked against the jnp reference. The fastest
correct candidate is picked per phase-1 h_q (the knobs that suit 64-head blocks need not
suit 16), and printed last as `BEST_TUNING attention_h<h_q> <variant> <repr>`.
Phase 1 for fp8_ds_mla rows (uint8[656], `pallas_kernels/kv_format.py`) then does the same
with `FP8_CANDIDATES` (`FP8_ATTENTION_VARIANTS` then the benchmark-only `FP8_SWEEP_EXTRA`)
over the bf16 pool quantized (`kv_format.quantize`), checked against the fp8 jnp reference;
its winner per h_q is printed as `BEST_TUNING attention_fp8_h<h_q> ...`.
Phase 2 times, for each shape, the winner of the nearest phase-1 h_q and the reference at
N in {1, 16, 64, 256} x h_q in {16, 128}, K = 2048, and right after the bf16 figure of a shape
with N in `FP8_NS` = {1, 64, 256} the fp8 kernel at that shape (`fp8` entry of the shape: time,
TFLOP/s, bytes per call, the floors with 656-byte rows, and the ratio to the bf16 kernel
timed just before, the same-run baseline); then h_q in {32, 64} while the time budget lasts.
The Mosaic GPU kernel (`MOSAIC_VARIANTS`) joins phase 1 only with SPARSE_MLA_BENCH_MOSAIC=1
(it is slower and costs ~30 s of compiles).

Timing: one jitted function runs the op on `inner` different input sets (rotated, so the
selected rows are not all L2-resident and XLA cannot merge the calls); we take the median
wall-clock time of that function, synchronised with `jax.block_until_ready`, divided by
`inner`. Launch overhead is amortised, not removed. Ceilings measured in the same run: a
device-to-device copy (bytes read + written) and a bf16 8192^3 matmul. Floors: flops /
matmul rate, and the selected rows' bytes (N * K * row bytes: 1,152 bf16, 656 fp8) / copy
rate. `bytes_per_call` adds the query, the output and the row ids to the selected rows.
The time budget (`BUDGET_S`) is cut to the runner's limit minus a margin when
`python3 -m bench.ops` passes one (HISPARSE_BENCH_LIMIT_S).
CPU smoke run (tiny shapes, kernels in interpret mode): HISPARSE_BENCH_SMALL=1 (or
SPARSE_MLA_BENCH_SMOKE=1).
"""

from __future__ import annotations

import math
import os
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from bench._common import time_fn, write_result
from bench.ops import SMALL
from hisparse_jax.ops import sparse_mla_decode
from pallas_kernels import _compat
from pallas_kernels import kv_format as kvf
from pallas_kernels.sparse_mla_decode.triton import AttentionTuning

SM_SCALE = 1.0 / math.sqrt(192.0)
WIDTH, V_WIDTH, TOP_K = 576, 512, 2048
POOL_ROWS = 1 << 19           # 604 MB of bf16 rows: far larger than the 50 MB L2
NS = (1, 16, 64, 256)
FP8_NS = (1, 64, 256)         # phase 2 shapes that also time the fp8 kernel
HS = (16, 128)
HS_EXTRA = (32, 64)           # phase 2, only while the budget lasts
PHASE1_SHAPES = ((64, 128), (64, 16))
# Stop starting phase-2 shapes after this (whole run < 240 s: `bench/ops/__main__.py`), or
# after the runner's limit minus 25 s when it passes one.
BUDGET_S = min(210.0, float(os.environ.get("HISPARSE_BENCH_LIMIT_S", "1e9")) - 25.0)
ROW_BYTES = {"bf16": WIDTH * 2, kvf.FP8_DS_MLA: kvf.FP8_ROW_BYTES}

# The Triton kernel's variants the GPU tests and the benchmark compare (the default for bf16
# rows, `triton.DEFAULT`, is bk64_s2_noprefetch: Triton pipelines the indirect load itself;
# the others carry each step's row ids from the step before); 16 warps at 64 heads halve
# the fp32 accumulator's registers per thread.
ATTENTION_VARIANTS: dict[str, AttentionTuning] = {
    "bk64_s2_noprefetch": AttentionTuning(block_k=64, num_stages=2, prefetch_ids=False),
    "bk64_s2": AttentionTuning(block_k=64, num_stages=2),
    "bk32_s3": AttentionTuning(block_k=32, num_stages=3),
    "bk64_s2_w16": AttentionTuning(block_k=64, num_stages=2, num_warps=16),
}
# Benchmark-only candidates that may not build at every shape: bk64 x 3 stages (2 x 72 KiB
# of K tiles + Q 72 KiB at 64 heads) may exceed the 227 KiB of shared memory; at 16 heads
# it fits. The benchmark records a build failure and goes on; the GPU tests skip these.
ATTENTION_SWEEP_EXTRA: dict[str, AttentionTuning] = {
    "bk64_s3": AttentionTuning(block_k=64, num_stages=3),
    # Issue 14's sweep: Triton's own pipelining of the indirect load (no id carry) at more
    # stages; deeper stages with the carry; the K tile gathered a step ahead in registers
    # (`prefetch_tiles`, Triton's pipeliner off); one K split (one wave at N=64, h_q=128).
    "bk32_s3_noprefetch": AttentionTuning(block_k=32, num_stages=3, prefetch_ids=False),
    "bk32_s4_noprefetch": AttentionTuning(block_k=32, num_stages=4, prefetch_ids=False),
    "bk32_s4": AttentionTuning(block_k=32, num_stages=4),
    "bk16_s4": AttentionTuning(block_k=16, num_stages=4),
    "bk32_regs": AttentionTuning(block_k=32, num_stages=1, prefetch_tiles=True),
    "bk16_regs": AttentionTuning(block_k=16, num_stages=1, prefetch_tiles=True),
    "bk32_s3_split1": AttentionTuning(block_k=32, num_stages=3, num_splits=1),
}


# The Triton kernel's fp8_ds_mla variants the GPU tests and the benchmark compare (the
# default below 64 heads, `triton.DEFAULT_FP8`, is bk32_s3): the byte words taken apart by
# reductions ("contiguous", the default) or by splits (`AttentionTuning.fp8_words="split"`), and the
# scales applied to the scores and P ("scores", the default) or folded into the bf16 tile
# (`AttentionTuning.fp8_scale`: "tiles" = 4 group tiles, "tile512" = one 512-wide tile).
FP8_ATTENTION_VARIANTS: dict[str, AttentionTuning] = {
    "bk32_s3": AttentionTuning(block_k=32, num_stages=3),
    "bk32_s3_split": AttentionTuning(block_k=32, num_stages=3, fp8_words="split"),
    "bk32_s3_tiles": AttentionTuning(block_k=32, num_stages=3, fp8_words="split",
                                     fp8_scale="tiles"),
    "bk32_s3_t512": AttentionTuning(block_k=32, num_stages=3, fp8_words="split",
                                    fp8_scale="tile512"),
}
# Benchmark-only fp8 candidates that may not build at every shape: with 64-row tiles the
# kernel holds the pipelined byte tiles and their bf16 conversion in shared memory next to
# Q, which may exceed the 227 KiB at 64 heads. A build failure is recorded, not fatal; the
# GPU tests skip these.
FP8_SWEEP_EXTRA: dict[str, AttentionTuning] = {
    "bk64_s2": AttentionTuning(block_k=64, num_stages=2),
    "bk64_s2_t512": AttentionTuning(block_k=64, num_stages=2, fp8_words="split",
                                    fp8_scale="tile512"),
}
FP8_CANDIDATES: dict[str, AttentionTuning] = {**FP8_ATTENTION_VARIANTS, **FP8_SWEEP_EXTRA}


def mosaic_variants() -> dict:
    """The Mosaic GPU kernel's variants (the first is its default), or {} where this jax
    cannot import the module (the import is guarded: it needs Mosaic GPU Pallas)."""
    try:
        from pallas_kernels.sparse_mla_decode.mosaic_gpu import TuningConfig
    except ImportError:
        return {}
    return {
        "pipelined": TuningConfig(),                              # 2-deep ring, 1 producer WG
        "no_split": TuningConfig(num_splits=1),                   # one CTA per (row, heads)
    }


def mosaic_row_variants() -> dict:
    """The row-copy Mosaic GPU kernel's variants (`mosaic_gpu_fp8.RowTuning`; the first is its
    default), or {} where this jax cannot import it. Each runs fp8_ds_mla rows, and bf16 rows
    when passed as the config of backend "mosaic_gpu". The knobs: one 768-byte copy per fp8
    row or 640 + 128 bytes (`row_copies`), copies issued per producer loop iteration
    (`copy_unroll`), Pallas' automatic warpgroup barriers (one before every copy), Mosaic's
    bank-conflict-checked staging loads (bf16 rows only: fp8 views are refused), Q K^T by
    both consumers instead of P handed from one to the other (`share_p=False`, fp8 rows),
    constant tile addresses (`anchor=False`: the descriptors hoisted out of the tile loop
    and spilled), the copies issued from the producer's 4 warps (`copy_warps`), the next
    tile's rows prefetched into L2 (`prefetch`), the copies promised in bounds
    (`in_bounds`, fp8 rows), 8 more registers per consumer thread (16 fewer per producer
    thread), the conversion in the wide register layout (`wide_convert`)."""
    try:
        from pallas_kernels.sparse_mla_decode.mosaic_gpu_fp8 import RowTuning
    except ImportError:
        return {}
    return {
        "row": RowTuning(),
        "row_nowarps": RowTuning(copy_warps=False),
        "row_noprefetch": RowTuning(prefetch=False),
        "row_noinbounds": RowTuning(in_bounds=False),
        "row_dec05": RowTuning(copy_warps=False, prefetch=False, in_bounds=False),
        "row_noshare": RowTuning(share_p=False),
        "row_noanchor": RowTuning(anchor=False),
        "row_2copies": RowTuning(row_copies=2),
        "row_unroll1": RowTuning(copy_unroll=1),
        "row_unroll4": RowTuning(copy_unroll=4),
        "row_unroll16": RowTuning(copy_unroll=16),
        "row_regs240": RowTuning(compute_registers=240, producer_registers=24),
        "row_wide": RowTuning(wide_convert=True),
        "row_autobar": RowTuning(auto_barriers=True),
    }


def mosaic_row_bf16_variants() -> dict:
    """Row-copy variants for bf16 rows (passed as the config of backend "mosaic_gpu"): the
    default, without the L2 prefetch of the next tile's rows, the wide conversion layout,
    and Mosaic's optimized (bank-conflict checked) staging loads, which it plans for the bf16
    staging tile."""
    rows = mosaic_row_variants()
    if not rows:
        return {}
    import dataclasses

    return {"row": rows["row"], "row_noprefetch": rows["row_noprefetch"],
            "row_wide": rows["row_wide"],
            "row_optloads": dataclasses.replace(rows["row"], optimized_loads=True)}


CANDIDATES = (("mosaic_gpu:pipelined",) if os.environ.get("SPARSE_MLA_BENCH_MOSAIC") else ()
              ) + tuple(f"triton:{v}" for v in {**ATTENTION_VARIANTS, **ATTENTION_SWEEP_EXTRA})
MATMUL_N, COPY_ELEMS = 8192, 1 << 29
SMOKE = SMALL or bool(os.environ.get("SPARSE_MLA_BENCH_SMOKE"))
if SMOKE:
    TOP_K, POOL_ROWS, NS, FP8_NS, HS, HS_EXTRA = 128, 4096, (1, 2), (1, 2), (16,), ()
    PHASE1_SHAPES, MATMUL_N, COPY_ELEMS = ((2, 16),), 512, 1 << 20
    FP8_CANDIDATES = dict(FP8_ATTENTION_VARIANTS)


def _candidate(name: str):
    """(backend, tuning) of a "backend:variant" candidate ("fp8:variant": the Triton kernel
    over fp8_ds_mla rows)."""
    backend, variant = name.split(":")
    if backend == "fp8":
        return "triton", FP8_CANDIDATES[variant]
    if backend == "triton":
        return backend, {**ATTENTION_VARIANTS, **ATTENTION_SWEEP_EXTRA}[variant]
    return backend, mosaic_variants()[variant]


def flops(n: int, h: int, k: int = TOP_K) -> float:
    return 2.0 * n * h * k * (WIDTH + V_WIDTH)


def selected_bytes(n: int, k: int = TOP_K, kv_format: str = "bf16") -> float:
    """Bytes of the selected rows one call reads (each once)."""
    return float(n * k * ROW_BYTES[kv_format])


def bytes_per_call(n: int, h: int, k: int = TOP_K, kv_format: str = "bf16") -> float:
    """Selected rows + row ids (int32) + q (bf16, 576 wide) + out (bf16, 512 wide)."""
    return selected_bytes(n, k, kv_format) + n * k * 4 + n * h * (WIDTH + V_WIDTH) * 2


def _inputs(key, n, h, inner):

    kq, kr, kh = jax.random.split(key, 3)
    q = jax.random.normal(kq, (inner, n, h, WIDTH), jnp.bfloat16)
    rows = jax.random.randint(kr, (inner, n, TOP_K), 0, POOL_ROWS, jnp.int32)
    rows = jnp.where(jax.random.uniform(kh, rows.shape) < 0.02, -1, rows)  # a few holes
    return q, rows


def _inner_for(n: int, h: int) -> int:
    if SMOKE:
        return 1
    return 8 if n * h <= 64 * 32 else 4


def _timed(fn, q, kv, rows, *, iters=10):
    """Median seconds per op of `fn` mapped over the `inner` leading axis inside one jit."""

    inner = q.shape[0]

    @jax.jit
    def many(q, kv, rows):
        return [fn(q[i], kv, rows[i]) for i in range(inner)]

    stats = time_fn(lambda: many(q, kv, rows), warmup=1 if SMOKE else 2,
                    iters=1 if SMOKE else iters)
    return stats["median_us"] * 1e-6 / inner, stats


def _rel_err(a, b) -> float:

    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _ops(kv_format: str = "bf16"):
    """(reference, kernel(name)) over rows of `kv_format`."""
    def ref(q, kv, rows):
        return sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, kv_format=kv_format,
                                 backend="reference")

    def kernel(name):
        backend, config = _candidate(name)

        def run(q, kv, rows):
            return sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, kv_format=kv_format,
                                     backend=backend, config=config)
        return run
    return ref, kernel


def run_candidate(name: str, kv, ref, kernel) -> dict:
    """Phase 1 body: check and time one candidate at PHASE1_SHAPES."""

    result = {"variant": name, "config": repr(_candidate(name)[1]), "shapes": []}
    for n, h in PHASE1_SHAPES:
        entry = {"n": n, "h_q": h}
        t0 = time.time()
        try:
            q, rows = _inputs(jax.random.key(n * 1000 + h), n, h, _inner_for(n, h))
            rows = rows.at[0, 0].set(-1)                           # one all-invalid row
            out, lse = jax.jit(kernel(name))(q[0], kv, rows[0])
            ref_out, ref_lse = jax.jit(ref)(q[0], kv, rows[0])
            entry["rel_err_out"] = _rel_err(out, ref_out)
            finite = jnp.isfinite(ref_lse)
            entry["lse_finite_match"] = bool(jnp.all(jnp.isfinite(lse) == finite))
            entry["max_abs_err_lse"] = float(jnp.max(jnp.where(finite, jnp.abs(lse - ref_lse),
                                                                0.0)))
            entry["nan"] = bool(jnp.isnan(out.astype(jnp.float32)).any())
            entry["correct"] = (entry["rel_err_out"] < 1e-2 and entry["lse_finite_match"]
                                and entry["max_abs_err_lse"] < 1e-1 and not entry["nan"])
            t, stats = _timed(kernel(name), q, kv, rows, iters=5)
            entry["time_us"] = t * 1e6
            entry["tflops"] = flops(n, h) / t / 1e12
            entry["timing"] = stats
        except Exception as e:  # noqa: BLE001 - report and continue
            entry["error"] = f"{type(e).__name__}: {e}"[:4000]
            entry["traceback"] = traceback.format_exc()[-4000:]
        entry["wall_s"] = time.time() - t0
        result["shapes"].append(entry)
        print(f"[phase1] {name} N={n} h={h}: " + (
            entry["error"][:300] if "error" in entry else
            f"err={entry['rel_err_out']:.2e} {entry['time_us']:.1f}us "
            f"{entry['tflops']:.1f}TF/s ok={entry['correct']}")
            + f" ({entry['wall_s']:.0f}s)", flush=True)
    return result


def _best_by_h(phase1) -> dict[int, str]:
    """h_q -> the fastest candidate correct at the phase-1 shapes with that h_q."""
    best = {h: _best_variant(phase1, h) for h in sorted({h for _, h in PHASE1_SHAPES})}
    return {h: v for h, v in best.items() if v is not None}


def _best_variant(phase1, h_q: int | None = None) -> str | None:
    """Fastest candidate correct at the phase-1 shapes with this h_q (h_q None: at every
    phase-1 shape, by the sum of the times)."""
    best, best_t = None, float("inf")
    for res in phase1:
        shapes = [s for s in res.get("shapes", []) if h_q is None or s["h_q"] == h_q]
        if not shapes or not all(s.get("correct") for s in shapes):
            continue
        t = sum(s["time_us"] for s in shapes)
        if t < best_t:
            best, best_t = res["variant"], t
    return best


def _best_for(best_by_h: dict, h: int) -> str | None:
    """The phase-1 winner to use at h_q = h: the one of the nearest phase-1 h_q."""
    if not best_by_h:
        return None
    return best_by_h[min(best_by_h, key=lambda h1: (abs(math.log2(h1) - math.log2(h)), -h1))]


def _ceilings() -> dict:

    n = COPY_ELEMS                                                 # 1 GiB of bf16
    x = jax.random.normal(jax.random.key(2), (n,), jnp.bfloat16)
    copy = jax.jit(lambda x: x * jnp.bfloat16(1.0) + jnp.bfloat16(0.0))
    st = time_fn(lambda: copy(x), warmup=2, iters=10)
    copy_bw = 2 * n * 2 / (st["median_us"] * 1e-6)
    a = jax.random.normal(jax.random.key(3), (MATMUL_N, MATMUL_N), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(4), (MATMUL_N, MATMUL_N), jnp.bfloat16)
    mm = jax.jit(lambda a, b: a @ b)
    st2 = time_fn(lambda: mm(a, b), warmup=2, iters=10)
    mm_flops = 2 * MATMUL_N**3 / (st2["median_us"] * 1e-6)
    return {"copy_bytes_per_s": copy_bw, "copy_timing": st, "matmul_flops_per_s": mm_flops,
            "matmul_timing": st2,
            "copy_how": "jit(x*1+0) over 1 GiB bf16, bytes read + written, median of 10",
            "matmul_how": "jit(a @ b) bf16 8192^3, median of 10"}


def _write(payload: dict) -> str:
    return str(write_result("sparse_mla_decode" + ("_smoke" if SMOKE else ""), payload))


def _phase2_entry(n, h, best, kv, ref, kernel, ceilings, kv_format="bf16") -> dict:
    """One phase-2 shape: the kernel `best` (and, unless ref is None, the reference) over
    rows of `kv_format`, with the floors of that row size."""
    sel = selected_bytes(n, kv_format=kv_format)
    entry = {"n": n, "h_q": h, "top_k": TOP_K, "variant": best, "kv_format": kv_format,
             "row_bytes": ROW_BYTES[kv_format], "flops": flops(n, h), "selected_bytes": sel,
             "bytes_per_call": bytes_per_call(n, h, kv_format=kv_format)}
    entry["flop_floor_us"] = flops(n, h) / ceilings["matmul_flops_per_s"] * 1e6
    entry["byte_floor_us"] = sel / ceilings["copy_bytes_per_s"] * 1e6
    q, rows = _inputs(jax.random.key(n * 1000 + h + 7), n, h, _inner_for(n, h))
    if ref is not None:
        try:
            t_ref, _ = _timed(ref, q, kv, rows, iters=5)
            entry["ref_time_us"] = t_ref * 1e6
            entry["ref_tflops"] = flops(n, h) / t_ref / 1e12
        except Exception as e:  # noqa: BLE001
            entry["ref_error"] = f"{type(e).__name__}: {e}"[:2000]
    if best is not None:
        try:
            t_k, stats = _timed(kernel(best), q, kv, rows)
            entry["time_us"] = t_k * 1e6
            entry["tflops"] = flops(n, h) / t_k / 1e12
            entry["timing"] = stats
            entry["GBps_rows"] = sel / t_k / 1e9
            entry["gap_to_floor"] = t_k * 1e6 / max(entry["flop_floor_us"],
                                                    entry["byte_floor_us"])
            if "ref_time_us" in entry:
                entry["speedup_vs_ref"] = entry["ref_time_us"] / entry["time_us"]
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
    print(f"[phase2] {kv_format} N={n} h={h}: "
          f"{entry.get('time_us', float('nan')):.1f}us {entry.get('tflops', float('nan')):.1f}"
          f"TF/s ref {entry.get('ref_time_us', float('nan')):.1f}us "
          f"{entry.get('error', '')[:200]}", flush=True)
    return entry


def _summary(payload: dict, path: str, total_s: float) -> None:
    print(f"\nwrote {path}; best: {payload['best_variant']}; fp8 best by h_q: "
          f"{payload.get('best_variant_fp8_by_h_q')}; total {total_s:.0f}s")
    for res in payload["phase1_variants"] + payload["phase1_fp8_variants"]:
        for s in res.get("shapes", []):
            print(f"  {res['variant']:>22} N={s['n']:<3} h={s['h_q']:<3} "
                  + (f"err={s.get('rel_err_out', float('nan')):.2e} "
                     f"{s.get('time_us', float('nan')):8.1f}us "
                     f"{s.get('tflops', float('nan')):6.1f}TF/s" if "error" not in s
                     else s["error"][:150].replace("\n", " ")))
    print(f"{'N':>4} {'h_q':>4} {'variant':>14} {'kernel_us':>10} {'TFLOP/s':>8} "
          f"{'ref_us':>10} {'x_ref':>6} {'flop_fl_us':>10} {'byte_fl_us':>10} {'gap':>5}")
    for e in payload["results"]:
        print(f"{e['n']:>4} {e['h_q']:>4} {str(e.get('variant', '-'))[-14:]:>14} "
              f"{e.get('time_us', float('nan')):>10.1f} "
              f"{e.get('tflops', float('nan')):>8.1f} {e.get('ref_time_us', float('nan')):>10.1f} "
              f"{e.get('speedup_vs_ref', float('nan')):>6.1f} {e['flop_floor_us']:>10.1f} "
              f"{e['byte_floor_us']:>10.1f} {e.get('gap_to_floor', float('nan')):>5.1f}")
    fp8 = [(e, e["fp8"]) for e in payload["results"] if "fp8" in e]
    if fp8:
        print(f"fp8_ds_mla (656-B rows) against bf16 (1152-B rows), same run:\n"
              f"{'N':>4} {'h_q':>4} {'variant':>16} {'fp8_us':>9} {'TFLOP/s':>8} "
              f"{'MB/call':>8} {'byte_fl_us':>10} {'gap':>5} {'bf16_us':>9} {'x_bf16':>7}")
    for e, f in fp8:
        print(f"{f['n']:>4} {f['h_q']:>4} {str(f.get('variant', '-'))[-16:]:>16} "
              f"{f.get('time_us', float('nan')):>9.1f} {f.get('tflops', float('nan')):>8.1f} "
              f"{f['bytes_per_call'] / 1e6:>8.1f} {f['byte_floor_us']:>10.1f} "
              f"{f.get('gap_to_floor', float('nan')):>5.1f} "
              f"{e.get('time_us', float('nan')):>9.1f} "
              f"{f.get('speedup_vs_bf16', float('nan')):>7.2f}")


def _skipped(n: int, h: int) -> dict:
    return {"n": n, "h_q": h, "skipped": "time budget", "flop_floor_us": float("nan"),
            "byte_floor_us": float("nan")}


def _fp8_entry(n, h, best8, kv8, kernel8, ceilings, bf16: dict) -> dict:
    """The fp8 kernel at one phase-2 shape (same q and row ids as the bf16 entry `bf16`,
    timed just before it: the same-run baseline and the ratios)."""
    e8 = _phase2_entry(n, h, best8, kv8, None, kernel8, ceilings, kv_format=kvf.FP8_DS_MLA)
    e8["bytes_ratio_vs_bf16"] = e8["bytes_per_call"] / bf16["bytes_per_call"]
    if "time_us" in e8 and "time_us" in bf16:
        e8["bf16_time_us"] = bf16["time_us"]
        e8["bf16_variant"] = bf16["variant"]
        e8["speedup_vs_bf16"] = bf16["time_us"] / e8["time_us"]
    return e8


def main() -> None:
    t_start = time.time()
    ref, kernel = _ops()
    ref8, kernel8 = _ops(kvf.FP8_DS_MLA)
    fp8_candidates = [f"fp8:{v}" for v in FP8_CANDIDATES]
    payload = {
        "what": "sparse MLA decode (q [N, h_q, 576] bf16, K=2048 selected rows, v_width 512); "
                "rows bf16 (1152 B) and fp8_ds_mla (656 B, `docs/kv_format.md`)",
        "timing_method": "median wall-clock of one jit running the op on `inner` rotated input "
                         "sets, / inner, synchronised with jax.block_until_ready",
        "flops_formula": "2 * N * h_q * K * (576 + 512)",
        "byte_floor_formula": "N * K * row bytes (1152 bf16, 656 fp8) / measured copy "
                              "bandwidth (read + write)",
        "bytes_per_call_formula": "N * K * (row bytes + 4) + N * h_q * (576 + 512) * 2",
        "pool_rows": POOL_ROWS, "candidates": list(CANDIDATES),
        "fp8_candidates": fp8_candidates, "complete": False, "budget_s": BUDGET_S,
        "phase1_variants": [], "phase1_fp8_variants": [], "best_variant": None, "results": [],
    }
    ceilings = _ceilings()
    payload["ceilings"] = ceilings
    print(f"[ceilings] copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"matmul {ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    path = _write(payload)
    kv = jax.random.normal(jax.random.key(1), (POOL_ROWS, WIDTH), jnp.bfloat16)
    candidates = [c for c in CANDIDATES
                  if not (SMOKE and c.startswith("mosaic_gpu")
                          and not _compat.mosaic_gpu_interpret_available())]
    for name in candidates:
        payload["phase1_variants"].append(run_candidate(name, kv, ref, kernel))
        path = _write(payload)
    best = _best_variant(payload["phase1_variants"])
    payload["best_variant"] = best
    best_by_h = _best_by_h(payload["phase1_variants"])
    payload["best_variant_by_h_q"] = {str(h): v for h, v in best_by_h.items()}
    print(f"[phase1] best: {best}, by h_q: {best_by_h} ({time.time() - t_start:.0f}s)",
          flush=True)

    kv8 = jax.jit(kvf.quantize)(kv)                       # the same values as fp8 rows
    for name in fp8_candidates:
        payload["phase1_fp8_variants"].append(run_candidate(name, kv8, ref8, kernel8))
        path = _write(payload)
    best8_by_h = _best_by_h(payload["phase1_fp8_variants"])
    payload["best_variant_fp8_by_h_q"] = {str(h): v for h, v in best8_by_h.items()}
    print(f"[phase1] fp8 best by h_q: {best8_by_h} ({time.time() - t_start:.0f}s)",
          flush=True)

    shapes = [(n, h) for n in NS for h in HS] + [(n, h) for n in NS for h in HS_EXTRA]
    for n, h in shapes:
        if time.time() - t_start > BUDGET_S:
            payload["results"].append(_skipped(n, h))
            continue
        entry = _phase2_entry(n, h, _best_for(best_by_h, h), kv, ref, kernel, ceilings)
        payload["results"].append(entry)
        path = _write(payload)
        if n in FP8_NS and h in HS and best8_by_h:
            entry["fp8"] = _fp8_entry(n, h, _best_for(best8_by_h, h), kv8, kernel8, ceilings,
                                      entry)
            path = _write(payload)
    payload["complete"] = True
    payload["total_s"] = time.time() - t_start
    path = _write(payload)
    _summary(payload, path, payload["total_s"])
    for h, v in best_by_h.items():
        print(f"BEST_TUNING attention_h{h} {v} {_candidate(v)[1]!r}")
    for h, v in best8_by_h.items():
        print(f"BEST_TUNING attention_fp8_h{h} {v} {_candidate(v)[1]!r}")
    if best is not None:
        print(f"BEST_TUNING attention {best} {_candidate(best)[1]!r}")


if __name__ == "__main__":
    main()
