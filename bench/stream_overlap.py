"""Does XLA overlap a copy-stream call with other work, and what decides it? (issue 15)

Compiles one program per case: `gather_compact_group_start` on stream 1 (N batch rows, each
with `--misses` rows from a pinned host pool of 576-wide bf16 rows, all staged), then other
work (a chain of `--work` bf16 matrix products of `--dim`), then `gather_compact_group_finish`
waiting for that work. For each case it reads the compiled schedule (`bench/xla_schedule.py`):
is the call's start placed before the work, and its done after it? It then times the program
against the same one without a stream (copies on the main stream, in place) and against the
work alone (wall time of whole calls, p50: one program per call, so wall time is the
device's plus a fixed dispatch cost; `hidden_share` is the part of the copies' time the
stream hid). Cases vary what differs
between the small program of the GPU test (overlapped) and the engine's step (not
overlapped) one at a time; here the staging buffer's size (N batch rows; the engine's is
75 MiB at 256 requests).

    python3 -m bench.stream_overlap                    # GPU; CPU: the schedule part is empty
    python3 -m bench.stream_overlap --n 4,64,256 --output bench/results/stream_overlap-gpu.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench._common import write_result
from bench.xla_schedule import entry_schedule
from hisparse_jax.ops import (
    gather_compact_group,
    gather_compact_group_finish,
    gather_compact_group_start,
)

WIDTH = 576


def _program(stream: bool | None, work: int):
    """stream True: copies staged on stream 1 around the work; False: copies on the main
    stream then the work; None: the work alone."""

    def run(pool, cache, src, dst, counts, x, w):
        def chain(x):
            for _ in range(work):
                x = jnp.tanh(x @ w)
            return x

        if stream is None:
            return cache, chain(x)
        if not stream:
            cache = gather_compact_group((pool,), (cache,), src, dst, counts)[0]
            return cache, chain(x)
        staged = gather_compact_group_start((pool,), (cache,), src, dst, counts, stream=1,
                                            stage_rows=src.shape[1])
        x = chain(staged.precede(x))
        return gather_compact_group_finish((pool,), (cache,), staged, after=x)[0], x

    return jax.jit(run, donate_argnums=(1,))


def _schedule(compiled_text: str) -> dict[str, Any]:
    """Where the call's start and done sit among the work's kernels in the entry schedule."""
    lines = entry_schedule(compiled_text)
    start = next((i for i, line in enumerate(lines) if line.startswith("async-start")), None)
    done = next((i for i, line in enumerate(lines) if line.startswith("async-done")), None)
    if start is None or done is None:
        return {"async_call": False, "kernels_between": 0, "schedule": lines}
    return {"async_call": True, "start_index": start, "done_index": done,
            "kernels_between": done - start - 1, "schedule": lines}


def _time(fn, args, reps: int) -> float:
    """p50 wall ms of `reps` calls, each waited for."""
    cache = args[1]
    for _ in range(2):
        cache, _ = fn(args[0], cache, *args[2:])
    jax.block_until_ready(cache)
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        cache, out = fn(args[0], cache, *args[2:])
        jax.block_until_ready((cache, out))
        walls.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(walls)


def case(n: int, misses: int, work: int, dim: int, reps: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    host_rows = max(4 * n * misses, 1 << 16)
    pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    pool = jax.device_put(rng.standard_normal((host_rows, WIDTH)).astype(jnp.bfloat16), pinned)
    cache_rows = n * misses + 64
    cache = jnp.zeros((cache_rows // 64 + 1, 64, WIDTH), jnp.bfloat16)
    src = jnp.asarray(rng.integers(0, host_rows, (n, misses)), jnp.int32)
    dst = jnp.asarray(np.arange(n * misses).reshape(n, misses) + 64, jnp.int32)
    counts = jnp.full((n,), misses, jnp.int32)
    x = jnp.asarray(rng.standard_normal((dim, dim)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((dim, dim)) / np.sqrt(dim), jnp.bfloat16)
    args = (pool, cache, src, dst, counts, x, w)
    out: dict[str, Any] = {"n": n, "misses": misses, "staging_mib": n * misses * WIDTH * 2 / 2**20,
                           "work_products": work, "dim": dim}
    for name, stream in (("stream", True), ("main", False), ("work_only", None)):
        fn = _program(stream, work)
        text = fn.lower(*args).compile().as_text()
        if stream:
            sched = _schedule(text)
            out["async_call"] = sched["async_call"]
            out["kernels_between_start_and_done"] = sched["kernels_between"]
        out[f"{name}_wall_ms"] = _time(fn, (pool, jnp.zeros_like(cache), *args[2:]), reps)
    if out["main_wall_ms"] > out["work_only_wall_ms"]:
        copies = out["main_wall_ms"] - out["work_only_wall_ms"]
        out["hidden_share"] = (out["main_wall_ms"] - out["stream_wall_ms"]) / copies
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", default="4,64,256", help="batch rows per case (the staging size)")
    p.add_argument("--misses", type=int, default=108, help="rows copied per batch row")
    p.add_argument("--work", type=int, default=8, help="matrix products between the halves")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    results = []
    for n in (int(v) for v in args.n.split(",")):
        r = case(n, args.misses, args.work, args.dim, args.reps)
        print(f"[stream_overlap] N={n:4d} staging {r['staging_mib']:7.2f} MiB: async call "
              f"{r['async_call']}, {r['kernels_between_start_and_done']} kernels between; "
              f"wall stream / main / work alone {r['stream_wall_ms']:.3f} / "
              f"{r['main_wall_ms']:.3f} / {r['work_only_wall_ms']:.3f} ms", flush=True)
        results.append(r)
    write_result("stream_overlap", {"config": vars(args), "results": results},
                 args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
