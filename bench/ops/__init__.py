"""Benchmarks of the data-plane ops, one module per op, each against its same-run baselines.

  resolve_residency.py        tuning sweep (RESOLVE_VARIANTS), kernel vs jnp reference per N,
                              public-op wall time at 5% turnover
  gather_compact.py           pinned_host -> device row gather vs bulk device_put and the
                              reference; the index group (one launch vs per layer)
  mirror_rows.py              device -> pinned_host pages vs bulk device_put and the reference
  stage_prefill_rows.py       prefill staging rows (half resident, half pinned_host) vs bulk
                              device_put of the host rows and the reference; L=8 in one launch
  invalidate_written_rows.py  tuning sweep (INVALIDATE_VARIANTS), kernel vs jnp
  sparse_mla_decode.py        attention candidates (ATTENTION_VARIANTS, ...) vs the reference
  copies_beside_attention.py  another layer's copies in the attention's launch vs the copy
                              kernel then the attention kernel, at 256 requests
  grouped_matmul.py           the MoE's grouped matmul at DeepSeek-V3.2 decode shapes: every
                              backend, Triton variants, XLA's ragged-dot fusion flag, the
                              weight-read floor (not in `python3 -m bench.ops`: gpu_suite step)
  validate_cost.py            the ops' default value checks (`validate=None`) against
                              validate=False, at engine-like sizes (only with
                              `python3 -m bench.ops --validate-cost`)

Run one: `PYTHONPATH=. python3 -m bench.ops.<op>`; all within a time budget:
`PYTHONPATH=. python3 -m bench.ops [--budget S] [op ...]`. Each writes
`bench/results/<op>-<backend>.json` (`bench/_common.py`; the backend is jax's platform) after
every figure, so a timeout still leaves the figures so far. HISPARSE_BENCH_SMALL=1 runs tiny
shapes (kernels in the Pallas interpreter off the GPU; figures meaningless) and writes
`<op>_smoke-<backend>.json`. The sweep tables live in these modules, not in the kernels.

This module holds the helpers the data-plane benchmarks share.
"""

from __future__ import annotations

import functools
import os
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench._common import time_fn, write_result
from host_tier import memory_sharding

SMALL = os.environ.get("HISPARSE_BENCH_SMALL") == "1"   # CPU smoke run of a benchmark
INTERPRET = jax.default_backend() != "gpu"
WIDTH = 576
ROW_BYTES = WIDTH * 2
BLOCK = 64


def sharding(kind: str):
    return memory_sharding(jax.devices()[0], kind)


def rand_bf16(rng, shape):
    return rng.standard_normal(shape, dtype=np.float32).astype(jnp.bfloat16)


def gbps(nbytes: float, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


class Run:
    """The figures of one benchmark run: `record` runs one figure (its error is recorded and
    the run goes on) and rewrites the result file; `finish` prints the table and the
    `BEST_TUNING <op> <repr>` lines of the sweeps."""

    def __init__(self, name: str, *, sweep_budget_s: float, path: Any = None):
        self.name = name + ("_smoke" if SMALL else "")
        self.path = path                                # None: bench/results/<name>-<backend>
        self.results: dict[str, Any] = {}
        self.table: list[str] = []
        self.best: dict[str, Any] = {}                  # op -> best tuning found by a sweep
        self.sweep_budget_s = sweep_budget_s
        self.t_start = time.perf_counter()
        if INTERPRET:
            print("warning: no GPU; kernels run in the Pallas interpreter (figures meaningless)")

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def over_budget(self) -> bool:
        """True once the sweeps' time budget is spent (no new sweep candidate after it)."""
        return self.elapsed() > self.sweep_budget_s

    def write(self):
        self.results["best_tunings"] = {op: repr(t) for op, t in self.best.items()}
        self.results["total_seconds"] = round(self.elapsed(), 1)
        return write_result(self.name, {"figures": self.results}, path=self.path)

    def record(self, name: str, fn: Callable[[], dict[str, Any]]) -> None:
        t0 = time.perf_counter()
        try:
            self.results[name] = fn()
        except Exception as e:  # noqa: BLE001 - a failing figure must not stop the run
            self.results[name] = {"error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc(limit=6)}
            self.table.append(f"{name:42s} ERROR {type(e).__name__}: {str(e)[:80]}")
        self.results.setdefault(name, {})["seconds_spent"] = round(time.perf_counter() - t0, 2)
        self.write()

    def finish(self, ops: tuple[str, ...] = ()) -> None:
        path = self.write()
        print(f"wrote {path} ({self.results['total_seconds']} s)")
        print("\n".join(self.table))
        for op in ops:
            print(f"BEST_TUNING {op} {self.best[op]!r}" if op in self.best
                  else f"BEST_TUNING {op} none (no candidate was exact and built)")


def bulk(nbytes: int, src_kind: str, dst) -> dict[str, float]:
    """Median time of one bulk `jax.device_put` of `nbytes` contiguous bytes."""
    rows = nbytes // ROW_BYTES
    x = jax.device_put(jnp.ones((rows, WIDTH), jnp.bfloat16), sharding(src_kind))
    return time_fn(lambda: jax.device_put(x, dst), iters=20)


@functools.cache
def bulk_1gib_gbps(src_kind: str, dst) -> float:
    """GB/s of one 1 GiB `jax.device_put` (the large-transfer ceiling), measured once."""
    nbytes = (16 << 20) if SMALL else (1 << 30)
    x = jax.device_put(jnp.ones((nbytes // ROW_BYTES, WIDTH), jnp.bfloat16), sharding(src_kind))
    t = time_fn(lambda: jax.device_put(x, dst), warmup=2, iters=10)
    return gbps(x.size * 2, t["median_us"])


def chain_us(chained, args, chain: int) -> dict[str, float]:
    """Device us per step of `chained(*args, iters)` (iters traced: one compile): `chain`
    dependent steps inside one jit minus one step, / (chain - 1) (a `fori_loop` chain)."""
    t1 = time_fn(lambda: chained(*args, jnp.int32(1)), iters=5)
    tn = time_fn(lambda: chained(*args, jnp.int32(chain)), iters=5)
    return {"us_per_step": (tn["median_us"] - t1["median_us"]) / (chain - 1),
            "one_step_wall_us": t1["median_us"], "chain": chain}


def unrolled_us(step, state, steps: int, consts: Any = None) -> float:
    """Device us per step of `steps` dependent calls of `step(state, i)` unrolled in one jit
    (straight-line launches, no XLA while loop), minus one call. With `consts` (a pytree of
    arrays), the calls are `step(state, i, consts)` and consts is an argument of the jit, not
    a constant captured into it (pass large inputs, such as a host pool, that way)."""
    def make(m):
        @jax.jit
        def run(st, c):
            for i in range(m):
                st = step(st, i) if consts is None else step(st, i, c)
            return st
        return run
    one, many = make(1), make(steps)
    t1 = time_fn(lambda: one(state, consts), iters=20)
    tn = time_fn(lambda: many(state, consts), iters=20)
    return (tn["median_us"] - t1["median_us"]) / (steps - 1)


def pick_best(results: dict[str, Any], score) -> str | None:
    """The exact, built candidate with the lowest score (a score <= 0 is timing noise)."""
    ok = {name: r for name, r in results.items() if r.get("exact") and "error" not in r
          and score(r) > 0}
    return min(ok, key=lambda name: score(ok[name])) if ok else None
