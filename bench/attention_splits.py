"""Device time of the sparse MLA decode kernel at small N against its K split count.

    PYTHONPATH=. python3 -m bench.attention_splits [--ns 1,2,4,8,16] [--heads 128,16]

At small N (one to a few requests decoding) the kernel's grid is N x head blocks x K splits
programs; the default rule (`_attention_splits`) keeps at least 4 K steps per split, so at
N=1, h_q=128 the grid is 16 programs on a 132-SM GPU. This benchmark times the Triton kernel
(bf16 rows, K = 2048) at the split counts `--splits` that divide the K steps, and the default
rule, at each (N, h_q): the device time per call (the jax profiler's kernel intervals, busy
time over `--reps` calls on `--inner` rotating input sets, the split-K combine included;
GPU only) and the wall time of one synchronised call (median of the same calls, launch
included); `--xla-combine` also times each setting with the split-K combine as XLA fusions
(the combine kernel's baseline). Each setting is checked against the jnp reference
(relative error of the output). The same-run baseline is the default rule's figure of the
same shape.

Writes `bench/results/attention_splits-<backend>.json` after every figure.
HISPARSE_BENCH_SMALL=1: tiny shapes in interpret mode (CPU test; figures meaningless).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench._common import time_fn, write_result
from bench.ops import SMALL
from bench.profile_step import device_events, load_trace, summarise_device
from hisparse_jax.ops import sparse_mla_decode
from pallas_kernels.sparse_mla_decode import triton as tk

WIDTH, V_WIDTH = 576, 512
TOP_K = 256 if SMALL else 2048
POOL_ROWS = 1 << (10 if SMALL else 19)       # 604 MB of bf16 rows: past the 50 MB L2
SM_SCALE = 1.0 / math.sqrt(192.0)


def _steps() -> int:
    return -(-TOP_K // tk.DEFAULT.block_k)


def _split_counts() -> list[int]:
    """Every split count that divides the K steps (the kernel's rule: no all-padding step)."""
    steps = _steps()
    return [s for s in range(1, steps + 1) if steps % s == 0]


def _default_splits(n: int, h: int) -> int:
    block_h = tk.DEFAULT.block_h or min(64, max(16, tk._triton.pow2_ceil(h)))
    return tk._attention_splits(n * (-(-h // block_h)), _steps(), tk.DEFAULT)


def _device_us(f, sets, reps: int) -> dict[str, Any] | None:
    """Busy device time per call of `f` over `reps` calls (profiler trace), with its top
    kernels; None without a GPU trace."""
    if jax.default_backend() != "gpu":
        return None
    # No Python tracer and no HLO protos: only the kernels are wanted (a lighter trace; the
    # first GPU run spent ~80 s per setting, where compiles and traces were not told apart).
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.enable_hlo_proto = False
    with tempfile.TemporaryDirectory(prefix="hisparse-splits-") as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True,
                                profiler_options=options):
            outs = [f(*sets[i % len(sets)]) for i in range(reps)]
            jax.block_until_ready(outs)
        trace = load_trace(pathlib.Path(trace_dir))
    if trace is None:
        return None
    summary = summarise_device(device_events(trace), reps)
    if not summary.get("events"):
        return None
    return {"busy_us": summary["busy_us_per_step"],
            "kernels": [{"name": k["name"][:80], "us": k["us_per_step"],
                         "calls": k["calls_per_step"]} for k in summary["top_kernels"][:4]]}


def _time(n: int, h: int, splits: int | None, args: argparse.Namespace, kv, key, *,
          fused_combine: bool = True) -> dict[str, Any]:
    tuning = dataclasses.replace(tk.DEFAULT, fused_combine=fused_combine,
                                 **({} if splits is None else {"num_splits": splits}))
    sets = []
    for k in jax.random.split(key, args.inner):
        kq, kr = jax.random.split(k)
        sets.append((jax.random.normal(kq, (n, h, WIDTH), jnp.bfloat16),
                     jax.random.randint(kr, (n, TOP_K), 0, POOL_ROWS, jnp.int32)))

    def op(q, rows, backend, config):
        return sparse_mla_decode(q, kv, rows, sm_scale=SM_SCALE, backend=backend,
                                 config=config)[0]

    f = jax.jit(lambda q, rows: op(q, rows, "triton", tuning))
    got = np.asarray(f(*sets[0]), np.float64)
    want = np.asarray(op(*sets[0], "reference", None), np.float64)
    err = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    calls = iter(range(1 << 30))
    stats = time_fn(lambda: f(*sets[next(calls) % len(sets)]), warmup=1 if SMALL else 3,
                    iters=args.reps)
    device = _device_us(f, sets, args.reps)
    return {"n": n, "h_q": h, "splits": splits or _default_splits(n, h),
            "default_rule": splits is None,
            "combine": "fused kernel" if fused_combine else "XLA fusions",
            "wall_us_per_call": stats["median_us"],
            "device_us_per_call": None if device is None else device["busy_us"],
            "top_kernels": None if device is None else device["kernels"], "rel_err": err,
            "selected_bytes": n * TOP_K * WIDTH * 2}


def _ints(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected integers separated by commas, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ns", type=_ints, default=[1, 2] if SMALL else [1, 2, 4, 8, 16])
    p.add_argument("--heads", type=_ints, default=[16] if SMALL else [128, 16])
    p.add_argument("--splits", type=_ints, default=None,
                   help="split counts to time beside the default (default: every count that "
                        "divides the K steps, from 4 up)")
    p.add_argument("--inner", type=int, default=2 if SMALL else 8,
                   help="distinct input sets the calls rotate over")
    p.add_argument("--reps", type=int, default=2 if SMALL else 30,
                   help="calls timed (wall) and traced (device)")
    p.add_argument("--xla-combine", action="store_true",
                   help="also time each timed split count with the split-K combine as XLA "
                        "fusions (`AttentionTuning.fused_combine=False`): the combine "
                        "kernel's same-run baseline")
    p.add_argument("--output", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    if args.inner < 1 or args.reps < 1:
        p.error(f"--inner and --reps must be >= 1, got {args.inner} and {args.reps}")
    counts = _split_counts()
    wanted = args.splits or [s for s in counts if s >= min(4, counts[-1])]
    if not set(wanted) <= set(counts):
        p.error(f"--splits must divide the {_steps()} K steps ({counts}), got {wanted}")
    kv = jax.random.normal(jax.random.key(0), (POOL_ROWS, WIDTH), jnp.bfloat16)
    out: dict[str, Any] = {"top_k": TOP_K, "block_k": tk.DEFAULT.block_k,
                           "split_counts": counts, "timed_splits": wanted, "figures": []}
    name = "attention_splits" + ("_smoke" if SMALL else "")
    key = jax.random.key(1)
    for h in args.heads:
        for n in args.ns:
            base = _time(n, h, None, args, kv, key)
            base["ratio_to_default"] = 1.0
            out["figures"].append(base)
            write_result(name, out, args.output)
            line = [f"N={n:3d} h={h:3d} default {base['splits']:2d} splits: wall "
                    f"{base['wall_us_per_call']:6.1f} us device {base['device_us_per_call']}"]
            key_us = "device_us_per_call" if base["device_us_per_call"] else "wall_us_per_call"
            runs = [(s, True) for s in wanted if s != base["splits"]]
            if args.xla_combine:
                runs = [(None, False)] + [(s, f) for s in wanted if s != base["splits"]
                                          for f in (True, False)]
            for s, fused in runs:
                fig = _time(n, h, s, args, kv, key, fused_combine=fused)
                fig["ratio_to_default"] = base[key_us] / fig[key_us]
                out["figures"].append(fig)
                line.append(f"{fig['splits']}{'' if fused else ' xla'}: "
                            f"{fig['wall_us_per_call']:.1f} / {fig[key_us]:.1f}")
                write_result(name, out, args.output)
            print("  ".join(line), flush=True)
    print("wrote", write_result(name, out, args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
