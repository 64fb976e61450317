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
overlapped) one at a time: the staging buffer's size (N batch rows; the engine's is
75 MiB at 256 requests), the GPU programs moving the staged rows (`--programs`:
`copy_programs`), and, in a second row of each, the program compiled under
`_compat.EARLY_ASYNC_START_OPTIONS` (XLA's latency-hiding scheduler off). Each stream row
also times the copies alone (no work between the halves).

    python3 -m bench.stream_overlap                    # GPU; CPU: the schedule part is empty
    python3 -m bench.stream_overlap --n 256,689 --programs grid,32 --dump /tmp/hlo
"""

from __future__ import annotations

import argparse
import itertools
import pathlib
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
from pallas_kernels import _compat

WIDTH = 576


def _program(stream: bool | None, work: int, programs: int | None = None, early: bool = False):
    """stream True: copies staged on stream 1 around the work (at most `programs` GPU
    programs moving them); False: copies on the main stream then the work; None: the work
    alone. early: compiled under `_compat.EARLY_ASYNC_START_OPTIONS`."""

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
                                            stage_rows=src.shape[1], copy_programs=programs)
        x = chain(staged.precede(x))
        return gather_compact_group_finish((pool,), (cache,), staged, after=x)[0], x

    options = {"compiler_options": dict(_compat.EARLY_ASYNC_START_OPTIONS)} if early else {}
    return jax.jit(run, donate_argnums=(1,), **options)


def _schedule(compiled_text: str) -> dict[str, Any]:
    """Where the call's start and done sit among the work's kernels in the entry schedule."""
    lines = entry_schedule(compiled_text)
    # XLA prints the call's start as `async-start` or as its sugar `call-start`.
    start = next((i for i, line in enumerate(lines)
                  if line.startswith(("async-start", "call-start"))), None)
    done = next((i for i, line in enumerate(lines)
                 if line.startswith(("async-done", "call-done"))), None)
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


def case(n: int, misses: int, work: int, dim: int, reps: int,
         programs_list: tuple[int | None, ...] = (None,), seed: int = 0,
         dump: str | None = None) -> dict[str, Any]:
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
    base = {}
    for name, stream in (("main", False), ("work_only", None)):
        base[name] = _time(_program(stream, work), (pool, jnp.zeros_like(cache), *args[2:]),
                           reps)
        out[f"{name}_wall_ms"] = base[name]
    copies = base["main"] - base["work_only"]
    out["stream"] = []
    for programs, early in itertools.product(programs_list, (False, True)):
        row: dict[str, Any] = {"copy_programs": programs, "early_async_start": early}
        for name, w in (("stream", work), ("copies_only", 0)):
            fn = _program(True, w, programs, early).lower(*args).compile()  # timed as is
            if name == "stream":
                text = fn.as_text()
                if dump:
                    pathlib.Path(dump, f"stream_overlap-n{n}-p{programs or 'grid'}"
                                       f"{'-early' if early else ''}.txt").write_text(text)
                sched = _schedule(text)
                row["async_call"] = sched["async_call"]
                row["kernels_between_start_and_done"] = sched["kernels_between"]
            row[f"{name}_wall_ms"] = _time(fn, (pool, jnp.zeros_like(cache), *args[2:]), reps)
        if copies > 0:
            row["hidden_share"] = (base["main"] - row["stream_wall_ms"]) / copies
        out["stream"].append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", default="4,64,256", help="batch rows per case (the staging size)")
    p.add_argument("--misses", type=int, default=108, help="rows copied per batch row")
    p.add_argument("--work", type=int, default=8, help="matrix products between the halves")
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--programs", default="grid",
                   help="copy_programs values of the stream case ('grid': None, a program per "
                        "chunk), comma-separated")
    p.add_argument("--output", default=None)
    p.add_argument("--dump", default=None,
                   help="a directory for each stream case's compiled program (HLO text)")
    args = p.parse_args(argv)
    if args.dump:
        pathlib.Path(args.dump).mkdir(parents=True, exist_ok=True)
    results = []
    programs_list = tuple(None if v == "grid" else int(v) for v in args.programs.split(","))
    for n in (int(v) for v in args.n.split(",")):
        r = case(n, args.misses, args.work, args.dim, args.reps, programs_list, dump=args.dump)
        print(f"[stream_overlap] N={n:4d} staging {r['staging_mib']:7.2f} MiB: wall main / "
              f"work alone {r['main_wall_ms']:.3f} / {r['work_only_wall_ms']:.3f} ms",
              flush=True)
        for row in r["stream"]:
            print(f"    programs {row['copy_programs'] or 'grid':>4}"
                  f"{' early' if row['early_async_start'] else '      '}: async call "
                  f"{row['async_call']}, {row['kernels_between_start_and_done']} kernels "
                  f"between; wall stream {row['stream_wall_ms']:.3f} ms, copies alone "
                  f"{row['copies_only_wall_ms']:.3f} ms, hidden share "
                  f"{row.get('hidden_share', float('nan')):.2f}", flush=True)
        results.append(r)
    write_result("stream_overlap", {"config": vars(args), "results": results},
                 args.output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
