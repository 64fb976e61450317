"""invalidate_written_rows benchmark: the Triton kernel's tuning sweep, then kernel vs jnp.

Run on the GPU machine: `PYTHONPATH=. python3 -m bench.ops.invalidate_written_rows`. Writes
`bench/results/invalidate_written_rows-<backend>.json`.

  * sweep: `INVALIDATE_VARIANTS` at T=256, H=4096, S=256 (half the tokens rewrite a row their
    state row holds); each candidate is checked for exact equality with the jnp reference,
    then timed as a Python-unrolled chain of 64 calls (straight-line launches) and a
    `fori_loop` chain of 200; the best by the unrolled time is printed as
    `BEST_TUNING invalidate_written_rows <repr>`;
  * the public op per backend (default tuning): wall time of one call, and device time per
    call from a `fori_loop` chain and from an unrolled chain.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import hisparse_jax as hj
from bench._common import time_fn
from bench.ops import INTERPRET, SMALL, Run, chain_us, pick_best, unrolled_us
from pallas_kernels.invalidate_written_rows import reference
from pallas_kernels.invalidate_written_rows import triton as kernel
from pallas_kernels.invalidate_written_rows.triton import InvalidateTuning

# The candidates of the sweep (first = the default). One program per (token, chunk) is tiny
# work: the question is launch/occupancy, so the sweep varies the program count
# (T * H / chunk) and the warps per program.
INVALIDATE_VARIANTS: dict[str, InvalidateTuning] = {
    "c1024_w4": InvalidateTuning(),
    "c4096_w8": InvalidateTuning(chunk=4096, num_warps=8),      # one program per token
    "c2048_w4": InvalidateTuning(chunk=2048, num_warps=4),
    "c512_w4": InvalidateTuning(chunk=512, num_warps=4),
}
SWEEP_BUDGET_S = 40.0


def _inputs(rng):
    num_state, hot, tokens = (8, 64, 8) if SMALL else (256, 4096, 256)
    slots_np = rng.integers(-1, 1 << 20, (num_state, hot)).astype(np.int32)
    srows_np = rng.integers(0, num_state, tokens).astype(np.int32)
    # Half the tokens rewrite a row their state row holds (real hits), a few are padding.
    written_np = rng.integers(0, 1 << 20, tokens).astype(np.int32)
    held = slots_np[srows_np, rng.integers(0, hot, tokens)]
    written_np = np.where(rng.random(tokens) < 0.5, np.maximum(held, 0), written_np)
    written_np[: max(1, tokens // 32)] = -1
    return map(jnp.asarray, (slots_np, srows_np, written_np))


def sweep(run: Run, rng) -> dict[str, Any]:
    slot_rows, srows, written = _inputs(rng)
    num_state, hot = slot_rows.shape
    want = np.asarray(jax.jit(reference.invalidate_written_rows)(slot_rows, srows, written))
    out: dict[str, Any] = {"T": int(srows.shape[0]), "H": hot, "S": num_state,
                           "candidates": {}}
    chain = 3 if SMALL else 200
    for name, tuning in INVALIDATE_VARIANTS.items():
        entry: dict[str, Any] = {"tuning": repr(tuning)}
        out["candidates"][name] = entry
        if run.over_budget() and name != next(iter(INVALIDATE_VARIANTS)):
            entry["error"] = "skipped: time budget"
            continue
        t0 = time.perf_counter()
        try:
            def step(st, i, tuning=tuning):
                return kernel.invalidate_written_rows(st, srows, written + i,
                                                      interpret=INTERPRET, tuning=tuning)
            got = np.asarray(jax.jit(lambda x, step=step: step(x, 0))(slot_rows))
            entry["exact"] = bool(np.array_equal(got, want))
            if not entry["exact"]:
                entry["mismatches"] = int(np.sum(got != want))
            else:
                @jax.jit
                def chained(st, iters, step=step):
                    return jax.lax.fori_loop(0, iters, lambda i, x: step(x, i), st)
                entry["fori"] = chain_us(chained, (slot_rows,), chain)
                entry["device_us"] = unrolled_us(step, slot_rows, 4 if SMALL else 64)
        except Exception as e:  # noqa: BLE001 - a failing candidate must not stop the sweep
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
        finally:
            entry["seconds"] = round(time.perf_counter() - t0, 2)
        run.table.append(f"  invalidate {name:14s} " + (
            f"{entry['device_us']:6.2f} us unrolled, {entry['fori']['us_per_step']:6.2f} us "
            f"fori" if "device_us" in entry
            else str(entry.get("error", f"NOT EXACT ({entry.get('mismatches')} slots)"))[:90]))
        print(run.table[-1], flush=True)
    best = pick_best(out["candidates"], lambda r: r["device_us"])
    out["best"] = best
    if best is not None:
        run.best["invalidate_written_rows"] = INVALIDATE_VARIANTS[best]
        out["best_device_us"] = out["candidates"][best]["device_us"]
        out["target_device_us"] = 5.0
    return out


def bench_op(run: Run, rng) -> dict[str, Any]:
    num_state, hot, tokens = (8, 64, 8) if SMALL else (256, 4096, 256)
    slot_rows = jnp.asarray(rng.integers(-1, 1 << 20, (num_state, hot)).astype(np.int32))
    state = hj.HotState(slot_rows, jnp.zeros((num_state, hot), jnp.int16))
    srows = jnp.asarray(rng.integers(0, num_state, tokens).astype(np.int32))
    written = jnp.asarray(rng.integers(0, 1 << 20, tokens).astype(np.int32))
    out: dict[str, Any] = {"T": tokens, "H": hot, "S": num_state}
    chain_iters = 3 if SMALL else 200
    impls = {"triton": functools.partial(kernel.invalidate_written_rows, interpret=INTERPRET),
             "reference": reference.invalidate_written_rows}
    for backend, impl in impls.items():
        out[backend] = time_fn(functools.partial(hj.invalidate_written_rows, state, srows,
                                                 written, backend=backend), iters=20)

        def step(st, i, impl=impl):
            return hj.HotState(impl(st.slot_rows, srows, written + i), st.lru)

        @functools.partial(jax.jit, static_argnames=("iters",))
        def chained(st, *, iters, step=step):
            return jax.lax.fori_loop(0, iters, lambda i, s: step(s, i), st)
        t1 = time_fn(lambda c=chained: c(state, iters=1), iters=5)
        tn = time_fn(lambda c=chained: c(state, iters=chain_iters), iters=5)
        out[f"{backend}_device_us"] = (tn["median_us"] - t1["median_us"]) / (chain_iters - 1)
        out[f"{backend}_device_us_unrolled"] = unrolled_us(step, state, 4 if SMALL else 64)
    out["tuning"] = repr(kernel.DEFAULT)
    out["target_device_us"] = 5.0
    out["speedup_vs_reference_device"] = out["reference_device_us"] / out["triton_device_us"]
    out["speedup_vs_reference_device_unrolled"] = (out["reference_device_us_unrolled"]
                                                   / out["triton_device_us_unrolled"])
    run.table.append(f"invalidate T={out['T']}: kernel {out['triton_device_us']:.2f} us fori / "
                     f"{out['triton_device_us_unrolled']:.2f} us unrolled, jnp "
                     f"{out['reference_device_us']:.2f} / "
                     f"{out['reference_device_us_unrolled']:.2f} us device (target < 5 us)")
    return out


def main() -> None:
    run = Run("invalidate_written_rows", sweep_budget_s=SWEEP_BUDGET_S)
    rng = np.random.default_rng(0)
    run.table.append("tuning sweep (device us per step):")
    run.record("sweep_invalidate", lambda: sweep(run, rng))
    jax.clear_caches()
    run.record("invalidate_T256", lambda: bench_op(run, rng))
    run.finish(("invalidate_written_rows",))


if __name__ == "__main__":
    main()
