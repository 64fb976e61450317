"""grouped_matmul benchmark on the GPU: the MoE's grouped matmuls at DeepSeek-V3.2 decode shapes.

Run from the repository root (the GPU suite's step `grouped_matmul` does):
  XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=. python3 -m bench.ops.grouped_matmul
Writes `bench/results/grouped_matmul-<backend>.json` after every figure; prints a table last.

Shapes: T tokens decoding in {1, 64, 256}, each choosing 8 distinct experts of G = 256
uniformly at random (a load-balanced router): M = 8 T token-expert pairs sorted by expert,
and the layer's two grouped matmuls, gate+up (K = 7168, N = 4096: 2 x 2048) and down
(K = 2048, N = 7168), bf16 inputs, float32 output.

Per shape: every backend of the op that supports the inputs (`hisparse_jax.ops.
grouped_matmul`: "reference" = XLA's lowering of `jax.lax.ragged_dot`, "triton",
"mosaic_gpu"; a backend that cannot run them is recorded with its reason), the Triton
kernel's tuning variants (`TRITON_VARIANTS`, while `SWEEP_BUDGET_S` lasts), and
`jax.lax.ragged_dot` with `--xla_gpu_experimental_use_ragged_dot_fusion=true` ("xla_fusion").
XLA reads its flags once per process, so that one runs in a subprocess of this module
(`--fusion-child`), first, before this process allocates its weights: the GPU memory this
process has not taken is the child's (hence XLA_PYTHON_CLIENT_PREALLOCATE=false: with
jax's default preallocation this process holds 75% of the GPU from its first import and the
child's 22.5 GB of weights may not fit). The child records whether the compiled program
holds a cuDNN call (the flag's grouped GEMM) or fell back to XLA's dense expansion.

Timing: device time per call, the jax profiler's kernel intervals (busy time over `REPS`
calls on `INNER` rotating lhs / routing sets, every kernel of the op: the Triton kernel's
tile table and the Mosaic wrapper's row padding included), and the median wall time of one
synchronised call. Each output is checked against the reference's (relative Frobenius
error; the child's against a sample of the parent's reference output for the same inputs).
Floors and ceilings measured in the same run: HBM read rate (`jnp.sum` over 2 GiB, bytes
read / time) and copy rate (x * 1 + 0 over 1 GiB, bytes read + written / time); the
weight-read floor of a shape is G_active * K * N * 2 bytes / the read rate (G_active: the
experts with at least one pair), and `all_weights_us` the same for all G experts (what XLA's
dense lowering and the Mosaic kernel read at decode sizes).
Expert weights: 16 random experts tiled to 256 (distinct addresses, so no expert's read
hits another's in L2; 1 GB of random numbers instead of 15).
HISPARSE_BENCH_SMALL=1: tiny shapes (G = 16, K = 64, N = 128), kernels in interpret mode.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench._common import time_fn
from bench.ops import SMALL, Run
from bench.profile_step import device_events, load_trace, summarise_device
from hisparse_jax import ops
from hisparse_jax.ops import _registry
from pallas_kernels.grouped_matmul.triton import GroupedTuning

TOP_K, GROUPS, DISTINCT = 8, 256, 16
TOKENS = (1, 64, 256)
SHAPES = {"gate_up": (7168, 4096), "down": (2048, 7168)}          # name -> (K, N)
INNER, REPS = 2, 10
FUSION_FLAG = "--xla_gpu_experimental_use_ragged_dot_fusion=true"
READ_BYTES, COPY_ELEMS = 1 << 31, 1 << 29
if SMALL:
    GROUPS, DISTINCT, TOKENS, INNER, REPS = 16, 4, (1, 4), 1, 2
    SHAPES = {"gate_up": (64, 128), "down": (128, 64)}
    READ_BYTES, COPY_ELEMS = 1 << 22, 1 << 20
BUDGET_S = min(480.0, float(os.environ.get("HISPARSE_BENCH_LIMIT_S", "1e9")) - 40.0)
SWEEP_BUDGET_S = 0.6 * BUDGET_S
# The Triton kernel's variants (the first is `triton.DEFAULT`, which the "triton" backend
# figure runs): tile rows, column block, K step, pipelining depth.
TRITON_VARIANTS: dict[str, GroupedTuning] = {
    "default": GroupedTuning(),
    "n64": GroupedTuning(block_n=64),
    "k128_s3": GroupedTuning(block_k=128),
    "k128_s4_w8": GroupedTuning(block_k=128, num_stages=4, num_warps=8),
    "m32": GroupedTuning(block_m=32),
    "m64_w8": GroupedTuning(block_m=64, num_warps=8),
}
NOMINAL_HBM = {"H100": 3.35e12, "H200": 4.8e12}                   # SXM, bytes / s


def routing(seed: int, tokens: int) -> np.ndarray:
    """int32[G] pairs per expert: each token's TOP_K distinct experts, uniformly random."""
    rng = np.random.default_rng(seed)
    experts = np.argsort(rng.random((tokens, GROUPS)), axis=1)[:, :TOP_K]
    return np.bincount(experts.ravel(), minlength=GROUPS).astype(np.int32)


def weights(k: int, n: int) -> jax.Array:
    """bf16 [G, K, N]: DISTINCT random experts tiled to G."""
    few = jax.random.normal(jax.random.key(k * 7 + n), (DISTINCT, k, n), jnp.bfloat16)
    return jnp.tile(few, (GROUPS // DISTINCT, 1, 1))


def input_sets(tokens: int, k: int) -> list[tuple[jax.Array, jax.Array]]:
    """INNER (lhs bf16 [8 T, K], group_sizes int32[G]) sets, the same in every process."""
    return [(jax.random.normal(jax.random.key(1000 * tokens + 10 * i + k % 7),
                               (TOP_K * tokens, k), jnp.bfloat16),
             jnp.asarray(routing(1000 * tokens + i, tokens)))
            for i in range(INNER)]


def device_us(f, sets, rhs, reps: int) -> float | None:
    """Busy device microseconds per call of f(lhs, rhs, sizes) over `reps` calls (profiler
    trace); None off the GPU."""
    if jax.default_backend() != "gpu":
        return None
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.enable_hlo_proto = False
    with tempfile.TemporaryDirectory(prefix="hisparse-gmm-") as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True,
                                profiler_options=options):
            jax.block_until_ready([f(lhs, rhs, s) for lhs, s in
                                   (sets[i % len(sets)] for i in range(reps))])
        trace = load_trace(pathlib.Path(trace_dir))
    if trace is None:
        return None
    summary = summarise_device(device_events(trace), reps)
    return summary.get("busy_us_per_step")


def timed(f, sets, rhs) -> dict[str, Any]:
    """Wall median of one synchronised call and device time per call of f."""
    calls = iter(range(1 << 30))

    def one():
        lhs, s = sets[next(calls) % len(sets)]
        return f(lhs, rhs, s)

    wall = time_fn(one, warmup=1 if SMALL else 2, iters=REPS)
    return {"wall_us": wall["median_us"], "device_us": device_us(f, sets, rhs, REPS)}


def op_fn(backend: str, tuning: Any = None):
    return jax.jit(lambda lhs, rhs, s: ops.grouped_matmul(lhs, rhs, s, backend=backend,
                                                          config=tuning))


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def sample(out) -> list:
    """The first rows and columns of an output: what the fusion child sends back."""
    return np.asarray(out[:4, :64], np.float64).tolist()


# --------------------------------------------------------------------------- the child


def fusion_child(path: str) -> int:
    """In a process started with FUSION_FLAG: time `jax.lax.ragged_dot` (the reference) at
    every shape, write {figure name: figures} JSON to `path`."""
    results: dict[str, Any] = {}
    for name, (k, n) in SHAPES.items():
        rhs = weights(k, n)
        for tokens in TOKENS:
            key = f"{name}_T{tokens}"
            try:
                sets = input_sets(tokens, k)
                f = op_fn("reference")
                text = (f.lower(sets[0][0], rhs, sets[0][1]).compile().as_text() or "").lower()
                out = f(sets[0][0], rhs, sets[0][1])
                # With the flag in effect the compiled program calls cuDNN (its grouped GEMM);
                # without, XLA has expanded the ragged dot into dense dots.
                results[key] = {**timed(f, sets, rhs), "sample": sample(out),
                                "cudnn_call": "cudnn" in text,
                                "ragged_dot_instruction": " ragged-dot(" in text}
            except Exception as e:  # noqa: BLE001 - record and go on
                results[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            pathlib.Path(path).write_text(json.dumps(results))
        del rhs
    return 0


def run_fusion_child(limit_s: float) -> dict[str, Any]:
    """The child's figures, or {"error": ...} (an XLA that does not know the flag aborts)."""
    with tempfile.TemporaryDirectory(prefix="hisparse-gmm-fusion-") as tmp:
        path = os.path.join(tmp, "fusion.json")
        env = dict(os.environ, XLA_FLAGS=" ".join(filter(None, (os.environ.get("XLA_FLAGS"),
                                                                  FUSION_FLAG))))
        try:
            proc = subprocess.run([sys.executable, "-m", "bench.ops.grouped_matmul",
                                   "--fusion-child", path], env=env, timeout=limit_s,
                                  capture_output=True, text=True, check=False)
            tail, rc = (proc.stdout + proc.stderr)[-1500:], proc.returncode
        except subprocess.TimeoutExpired:
            tail, rc = "timed out", "timeout"
        figures = json.loads(pathlib.Path(path).read_text()) if os.path.exists(path) else {}
    return {"flag": FUSION_FLAG, "exit": rc, "figures": figures,
            **({"log_tail": tail} if rc != 0 or not figures else {})}


# --------------------------------------------------------------------------- the parent


def ceilings() -> dict[str, Any]:
    x = jnp.ones((READ_BYTES // 2,), jnp.bfloat16)
    total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    read = time_fn(lambda: total(x), iters=10)
    y = jnp.ones((COPY_ELEMS,), jnp.bfloat16)
    copy_fn = jax.jit(lambda y: y * jnp.bfloat16(1) + jnp.bfloat16(0))
    copy = time_fn(lambda: copy_fn(y), iters=10)
    kind = jax.devices()[0].device_kind
    nominal = next((v for name, v in NOMINAL_HBM.items() if name in kind), None)
    return {"read_bytes_per_s": READ_BYTES / (read["median_us"] * 1e-6),
            "copy_bytes_per_s": 2 * COPY_ELEMS * 2 / (copy["median_us"] * 1e-6),
            "nominal_hbm_bytes_per_s": nominal, "device_kind": kind,
            "read_how": "jit(sum) over 2 GiB bf16, bytes read, median of 10 (wall)",
            "copy_how": "jit(x*1+0) over 1 GiB bf16, bytes read + written, median of 10"}


def bench_shape(run: Run, name: str, k: int, n: int, tokens: int, rhs, read_rate: float,
                fusion: dict[str, Any]) -> dict[str, Any]:
    sets = input_sets(tokens, k)
    sizes = [np.asarray(s) for _, s in sets]
    active = float(np.mean([(s > 0).sum() for s in sizes]))
    out: dict[str, Any] = {
        "T": tokens, "M": TOP_K * tokens, "K": k, "N": n, "G": GROUPS,
        "G_active": active, "weight_floor_us": active * k * n * 2 / read_rate * 1e6,
        "all_weights_us": GROUPS * k * n * 2 / read_rate * 1e6, "backends": {}}
    want = np.asarray(op_fn("reference")(sets[0][0], rhs, sets[0][1]), np.float64)
    candidates = [(b, None) for b in ops.registered_backends("grouped_matmul")]
    candidates += [(f"triton:{v}", t) for v, t in TRITON_VARIANTS.items() if v != "default"]
    for label, tuning in candidates:
        backend = label.split(":")[0]
        if tuning is not None and run.elapsed() > SWEEP_BUDGET_S:
            out["backends"][label] = {"skipped": "sweep budget spent"}
            continue
        reason = _registry.unsupported("grouped_matmul", backend, sets[0][0], rhs, sets[0][1])
        if reason is not None:
            out["backends"][label] = {"unsupported": reason}
            continue
        try:
            f = op_fn(backend, tuning)
            t0 = time.perf_counter()
            got = f(sets[0][0], rhs, sets[0][1])
            jax.block_until_ready(got)
            fig = {"first_call_s": round(time.perf_counter() - t0, 2), **timed(f, sets, rhs),
                   "rel_err": rel_err(got, want)}
        except Exception as e:  # noqa: BLE001 - a failing candidate must not stop the run
            fig = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        out["backends"][label] = fig
    child = fusion.get("figures", {}).get(f"{name}_T{tokens}")
    if child is not None and "sample" in child:
        child = dict(child)
        child["rel_err"] = rel_err(child.pop("sample"), want[:4, :64])   # of the sample
    out["backends"]["xla_fusion"] = child or {"error": fusion.get("log_tail", "no figure")}
    for label, fig in out["backends"].items():
        us = fig.get("device_us") or fig.get("wall_us")
        if us:
            fig["floor_ratio"] = us / out["weight_floor_us"]
            run.table.append(f"{name:8s} T={tokens:<4d} {label:22s} {us:10.1f} us  "
                             f"x{fig['floor_ratio']:.2f} floor  err {fig.get('rel_err', '-')}")
        else:
            run.table.append(f"{name:8s} T={tokens:<4d} {label:22s} "
                             f"{str(fig.get('unsupported') or fig.get('error') or fig)[:70]}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fusion-child", metavar="PATH", help=argparse.SUPPRESS)
    p.add_argument("--no-fusion", action="store_true", help="skip the XLA-flag subprocess")
    args = p.parse_args(argv)
    if args.fusion_child:
        return fusion_child(args.fusion_child)
    run = Run("grouped_matmul", sweep_budget_s=SWEEP_BUDGET_S)
    if os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").lower() != "false" \
            and jax.default_backend() == "gpu":
        print("warning: XLA_PYTHON_CLIENT_PREALLOCATE is not false: this process holds 75% "
              "of the GPU and the fusion subprocess may run out of memory")
    fusion = {"skipped": "--no-fusion"} if args.no_fusion else run_fusion_child(
        max(60.0, 0.35 * BUDGET_S))
    run.results["xla_fusion_child"] = {k: v for k, v in fusion.items() if k != "figures"}
    run.record("ceilings", ceilings)
    read_rate = run.results["ceilings"].get("read_bytes_per_s") or 1e12
    for name, (k, n) in SHAPES.items():
        rhs = weights(k, n)
        for tokens in TOKENS:
            if run.elapsed() > BUDGET_S:
                run.table.append(f"{name} T={tokens}: skipped (budget spent)")
                continue
            run.record(f"{name}_T{tokens}", lambda s=name, k=k, n=n, t=tokens, r=rhs:
                       bench_shape(run, s, k, n, t, r, read_rate, fusion))
        del rhs
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
