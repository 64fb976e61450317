"""Benchmark of sparse MLA decode attention on the GPU: Mosaic GPU kernel vs the jnp reference.

Run from the repository root: `PYTHONPATH=. python -m bench.bench_sparse_mla`. Under 3 minutes
on an H200. Writes `bench/results/sparse_mla-gpu.json`; prints a table last.

Phase 1 runs every kernel variant (`pallas_kernels.sparse_mla_mgpu.VARIANTS`) in its own
subprocess with a timeout, so a variant that fails to compile, computes wrong numbers or
hangs is reported and the rest still run. It checks each against the jnp reference and times
it at N=64 with h_q=128 and h_q=16. Phase 2 times the fastest correct variant and the reference
at N in {1, 16, 64, 256} x h_q in {16, 32, 64, 128}, K = 2048.

Timing: one jitted function runs the op on `inner` different input sets (rotated, so the
selected rows are not all L2-resident and XLA cannot merge the calls); we take the median
wall-clock time of that function, synchronised with `jax.block_until_ready`, divided by
`inner`. Launch overhead is amortised, not removed. Ceilings measured in the same run: a
device-to-device copy (bytes read + written) and a bf16 8192^3 matmul.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
import traceback

SM_SCALE = 1.0 / math.sqrt(192.0)
WIDTH, V_WIDTH, TOP_K = 576, 512, 2048
POOL_ROWS = 1 << 19           # 604 MB of bf16 rows: far larger than the 50 MB L2
NS = (1, 16, 64, 256)
HS = (16, 32, 64, 128)
PHASE1_SHAPES = ((64, 128), (64, 16))
BUDGET_S = 165.0
VARIANT_TIMEOUT_S = 75.0
MATMUL_N, COPY_ELEMS = 8192, 1 << 29
# CPU smoke test of this script (tiny shapes, kernel in interpret mode): SPARSE_MLA_BENCH_SMOKE=1
SMOKE = bool(os.environ.get("SPARSE_MLA_BENCH_SMOKE"))
if SMOKE:
    TOP_K, POOL_ROWS, NS, HS, PHASE1_SHAPES = 128, 4096, (1, 2), (16,), ((2, 16),)
    MATMUL_N, COPY_ELEMS, VARIANT_TIMEOUT_S = 512, 1 << 20, 300.0


def _variants():
    import dataclasses

    from pallas_kernels.sparse_mla_mgpu import VARIANTS

    if SMOKE:
        return {k: dataclasses.replace(v, interpret=True) for k, v in VARIANTS.items()}
    return VARIANTS


def flops(n: int, h: int, k: int = TOP_K) -> float:
    return 2.0 * n * h * k * (WIDTH + V_WIDTH)


def selected_bytes(n: int, k: int = TOP_K) -> float:
    return float(n * k * WIDTH * 2)


def _inputs(key, n, h, inner):
    import jax
    import jax.numpy as jnp

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
    import jax

    from bench._common import time_fn

    inner = q.shape[0]

    @jax.jit
    def many(q, kv, rows):
        return [fn(q[i], kv, rows[i]) for i in range(inner)]

    stats = time_fn(lambda: many(q, kv, rows), warmup=1 if SMOKE else 2,
                    iters=1 if SMOKE else iters)
    return stats["median_us"] * 1e-6 / inner, stats


def _rel_err(a, b) -> float:
    import numpy as np

    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _ops():
    from hisparse_jax.attention import sparse_mla_decode

    def ref(q, kv, rows):
        return sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend="reference")

    def kernel(config):
        def run(q, kv, rows):
            return sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend="mosaic_gpu",
                                     config=config)
        return run
    return ref, kernel


def run_variant(name: str) -> dict:
    """Phase 1 body (in a subprocess): check and time one variant."""
    import jax
    import jax.numpy as jnp

    ref, kernel = _ops()
    cfg = _variants()[name]
    kv = jax.random.normal(jax.random.key(1), (POOL_ROWS, WIDTH), jnp.bfloat16)
    result = {"variant": name, "config": repr(cfg), "shapes": []}
    for n, h in PHASE1_SHAPES:
        entry = {"n": n, "h_q": h}
        try:
            q, rows = _inputs(jax.random.key(n * 1000 + h), n, h, _inner_for(n, h))
            rows = rows.at[0, 0].set(-1)                           # one all-invalid row
            out, lse = jax.jit(kernel(cfg))(q[0], kv, rows[0])
            ref_out, ref_lse = jax.jit(ref)(q[0], kv, rows[0])
            entry["rel_err_out"] = _rel_err(out, ref_out)
            finite = jnp.isfinite(ref_lse)
            entry["lse_finite_match"] = bool(jnp.all(jnp.isfinite(lse) == finite))
            entry["max_abs_err_lse"] = float(jnp.max(jnp.where(finite, jnp.abs(lse - ref_lse),
                                                                0.0)))
            entry["nan"] = bool(jnp.isnan(out.astype(jnp.float32)).any())
            entry["correct"] = (entry["rel_err_out"] < 1e-2 and entry["lse_finite_match"]
                                and entry["max_abs_err_lse"] < 1e-1 and not entry["nan"])
            t, stats = _timed(kernel(cfg), q, kv, rows)
            entry["time_us"] = t * 1e6
            entry["tflops"] = flops(n, h) / t / 1e12
            entry["timing"] = stats
        except Exception as e:  # noqa: BLE001 - report and continue
            entry["error"] = f"{type(e).__name__}: {e}"[:4000]
            entry["traceback"] = traceback.format_exc()[-4000:]
        result["shapes"].append(entry)
    return result


def _phase1(variants) -> list[dict]:
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    results = []
    for name in variants:
        t0 = time.time()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "bench.bench_sparse_mla", "--variant", name],
                capture_output=True, text=True, timeout=VARIANT_TIMEOUT_S, env=env)
            line = [ln for ln in proc.stdout.splitlines() if ln.startswith("VARIANT_JSON ")]
            if line:
                res = json.loads(line[-1][len("VARIANT_JSON "):])
            else:
                res = {"variant": name, "error": f"exit {proc.returncode}",
                       "stderr_tail": proc.stderr[-4000:]}
        except subprocess.TimeoutExpired as e:
            res = {"variant": name, "error": f"timeout after {VARIANT_TIMEOUT_S}s (hang?)",
                   "stderr_tail": (e.stderr or b"")[-4000:].decode("utf-8", "replace")
                   if isinstance(e.stderr, bytes) else str(e.stderr)[-4000:]}
        res["wall_s"] = time.time() - t0
        results.append(res)
        status = res.get("error") or "; ".join(
            f"N={s['n']} h={s['h_q']}: " + (s.get("error", "")[:200] or
                                           f"err={s['rel_err_out']:.2e} {s['time_us']:.1f}us "
                                           f"{s['tflops']:.1f}TF/s ok={s['correct']}")
            for s in res.get("shapes", []))
        print(f"[phase1] {name}: {status}", flush=True)
    return results


def _best_variant(phase1) -> str | None:
    best, best_t = None, float("inf")
    for res in phase1:
        shapes = res.get("shapes", [])
        if not shapes or not all(s.get("correct") for s in shapes):
            continue
        t = sum(s["time_us"] for s in shapes)
        if t < best_t:
            best, best_t = res["variant"], t
    return best


def _ceilings() -> dict:
    import jax
    import jax.numpy as jnp

    from bench._common import time_fn

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", help="internal: run phase 1 for one variant and exit")
    args = parser.parse_args()
    if args.variant:
        print("VARIANT_JSON " + json.dumps(run_variant(args.variant), default=str), flush=True)
        return

    t_start = time.time()
    variants = _variants()
    phase1 = _phase1(list(variants))
    best = _best_variant(phase1)

    import jax

    from bench._common import write_result

    ref, kernel = _ops()
    ceilings = _ceilings()
    print(f"[ceilings] copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
          f"matmul {ceilings['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    import jax.numpy as jnp

    kv = jax.random.normal(jax.random.key(1), (POOL_ROWS, WIDTH), jnp.bfloat16)
    rows_out = []
    for n in NS:
        for h in HS:
            entry = {"n": n, "h_q": h, "top_k": TOP_K, "variant": best,
                     "flops": flops(n, h), "selected_bytes": selected_bytes(n)}
            entry["flop_floor_us"] = flops(n, h) / ceilings["matmul_flops_per_s"] * 1e6
            entry["byte_floor_us"] = selected_bytes(n) / ceilings["copy_bytes_per_s"] * 1e6
            if time.time() - t_start > BUDGET_S:
                entry["skipped"] = "time budget"
                rows_out.append(entry)
                continue
            q, rows = _inputs(jax.random.key(n * 1000 + h + 7), n, h, _inner_for(n, h))
            try:
                t_ref, _ = _timed(ref, q, kv, rows, iters=5)
                entry["ref_time_us"] = t_ref * 1e6
                entry["ref_tflops"] = flops(n, h) / t_ref / 1e12
            except Exception as e:  # noqa: BLE001
                entry["ref_error"] = f"{type(e).__name__}: {e}"[:2000]
            if best is not None:
                try:
                    t_k, stats = _timed(kernel(variants[best]), q, kv, rows)
                    entry["time_us"] = t_k * 1e6
                    entry["tflops"] = flops(n, h) / t_k / 1e12
                    entry["timing"] = stats
                    entry["gap_to_floor"] = t_k * 1e6 / max(entry["flop_floor_us"],
                                                            entry["byte_floor_us"])
                    if "ref_time_us" in entry:
                        entry["speedup_vs_ref"] = entry["ref_time_us"] / entry["time_us"]
                except Exception as e:  # noqa: BLE001
                    entry["error"] = f"{type(e).__name__}: {e}"[:2000]
            rows_out.append(entry)
            print(f"[phase2] N={n} h={h}: " + (
                f"{entry.get('time_us', float('nan')):.1f}us "
                f"{entry.get('tflops', float('nan')):.1f}TF/s ref "
                f"{entry.get('ref_time_us', float('nan')):.1f}us") + (
                f" {entry.get('error', '')[:200]}"), flush=True)
            del q, rows

    payload = {
        "what": "sparse MLA decode (q [N, h_q, 576] bf16, K=2048 selected rows, v_width 512)",
        "timing_method": "median wall-clock of one jit running the op on `inner` rotated input "
                         "sets, / inner, synchronised with jax.block_until_ready",
        "flops_formula": "2 * N * h_q * K * (576 + 512)",
        "byte_floor_formula": "N * K * 1152 B / measured copy bandwidth (read + write)",
        "pool_rows": POOL_ROWS,
        "ceilings": ceilings,
        "phase1_variants": phase1,
        "best_variant": best,
        "results": rows_out,
    }
    path = write_result("sparse_mla", payload)

    print(f"\nwrote {path}; best variant: {best}; total {time.time() - t_start:.0f}s")
    for res in phase1:
        for s in res.get("shapes", []):
            print(f"  {res['variant']:>14} N={s['n']:<3} h={s['h_q']:<3} "
                  + (f"err={s.get('rel_err_out', float('nan')):.2e} "
                     f"{s.get('time_us', float('nan')):8.1f}us "
                     f"{s.get('tflops', float('nan')):6.1f}TF/s" if "error" not in s
                     else s["error"][:150]))
        if "error" in res:
            print(f"  {res['variant']:>14} FAILED: {res['error'][:200]}")
    print(f"{'N':>4} {'h_q':>4} {'kernel_us':>10} {'TFLOP/s':>8} {'ref_us':>10} {'x_ref':>6} "
          f"{'flop_fl_us':>10} {'byte_fl_us':>10} {'gap':>5}")
    for e in rows_out:
        print(f"{e['n']:>4} {e['h_q']:>4} {e.get('time_us', float('nan')):>10.1f} "
              f"{e.get('tflops', float('nan')):>8.1f} {e.get('ref_time_us', float('nan')):>10.1f} "
              f"{e.get('speedup_vs_ref', float('nan')):>6.1f} {e['flop_floor_us']:>10.1f} "
              f"{e['byte_floor_us']:>10.1f} {e.get('gap_to_floor', float('nan')):>5.1f}")


if __name__ == "__main__":
    main()
