"""How the gather's rate depends on the pinned pool it reads: size, row width, layers.

    PYTHONPATH=. python3 -m bench.gather_pool [--rows 27648] [--sizes-gib 0.5,2,8,16]

The engine's step at 256 requests gathers its misses (2 layers of ~27K rows) from a ~19 GB
pool at ~32 GB/s while the same kernel on one layer's rows from the op benchmark's 604 MB
pool runs at ~51 GB/s (Nsight Compute; `bench/NOTES-data_plane.md`). This
benchmark times the gather of `--rows` distinct random rows (batch rows of 2048 misses) as
device time: `--reps` gathers chained in one jit, each with its own random rows (no row is
read twice, so no L2 reuse), the wall divided by the count. Cases:

  * size: one pool of each `--sizes-gib` (576 bf16 = 1152 B rows); at the largest also the
    rows sorted by address;
  * width: at the largest size, rows of 2304 and 4608 B (same pool bytes, fewer rows), the
    same row count: the rate in rows/s against bytes/s says whether a row costs a fixed
    translation or its bytes;
  * layers: an index group of 2 layers with one pool per layer (half the size each), as the
    engine holds them, in one launch (`gather_compact_group`) and in one launch per layer
    (`fused=False`), against one pool holding both layers' rows side by side (2304 B rows):
    the same bytes; and the packed host pool the engine keeps for such a group
    (`HostPool(layers_per_array=2)`: one [blocks, B, 2 x 576] array) through
    `gather_compact_group` into the two layers' caches.

The same-run baseline is the first case (the smallest pool). Writes
`bench/results/gather_pool-<backend>.json` after every figure. HISPARSE_BENCH_SMALL=1: tiny
shapes (CPU test; figures meaningless).
"""

from __future__ import annotations

import argparse
import functools
import gc
import pathlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bench._common import write_result
from bench.ops import BLOCK, SMALL, gbps, sharding
from hisparse_jax.ops import gather_compact_group

HOST, DEVICE = sharding("pinned_host"), sharding("device")
K = 2048                                  # misses per batch row of the plan


def _blocks(gib: float, width: int) -> int:
    return max(1, int(gib * 2**30) // (BLOCK * width * 2))


def _pool(gib: float, width: int) -> jax.Array:
    """Zeros of [blocks, BLOCK, width] bf16, made on the device and moved to pinned host."""
    return jax.device_put(jnp.zeros((_blocks(gib, width), BLOCK, width), jnp.bfloat16), HOST)


def _plans(rng, host_rows: int, rows: int, reps: int, *, ordered: bool):
    """`reps` plans of `rows` pool rows each (distinct over all plans) into distinct cache
    rows, batch rows of K (the last may be shorter): (src, dst, counts, num_blocks) with a
    leading axis of `reps`."""
    n = -(-rows // K)
    k = min(K, rows)
    flat = rng.choice(host_rows, size=(reps, rows), replace=False).astype(np.int32)
    if ordered:
        flat.sort(axis=1)
    num_blocks = max(-(-rows // BLOCK), 1)
    src = np.full((reps, n * k), -1, np.int32)
    dst = np.full((reps, n * k), -1, np.int32)
    src[:, :rows] = flat
    for r in range(reps):
        dst[r, :rows] = rng.permutation(num_blocks * BLOCK)[:rows]
    counts = np.broadcast_to(np.minimum(k, rows - k * np.arange(n)), (reps, n))
    return (jnp.asarray(src.reshape(reps, n, k)), jnp.asarray(dst.reshape(reps, n, k)),
            jnp.asarray(counts.astype(np.int32)), num_blocks)


@functools.partial(jax.jit, static_argnames="fused", donate_argnums=1)
def _chain(pools, caches, src, dst, counts, *, fused: bool):
    """Every plan of the stack in turn, each a gather into the caches."""
    def body(r, caches):
        return gather_compact_group(pools, caches, src[r], dst[r], counts[r], fused=fused,
                                    validate=False)
    return jax.lax.fori_loop(0, src.shape[0], body, tuple(caches))


def _time(pools: list[jax.Array], rows: int, reps: int, rng, *, ordered: bool = False,
          fused: bool = True, layers: int | None = None) -> dict[str, Any]:
    """Device time of one gather of `rows` rows of every layer (one per pool, or `layers`
    side by side in the pools: packed): a chain of `reps` in one jit (compiled and run once
    first), median of 3 chains, divided by `reps`."""
    layers = layers or len(pools)
    width = pools[0].shape[-1] * len(pools) // layers
    src, dst, counts, num_blocks = _plans(rng, pools[0].shape[0] * BLOCK, rows, reps,
                                          ordered=ordered)
    caches = tuple(jax.device_put(jnp.zeros((num_blocks, BLOCK, width), jnp.bfloat16), DEVICE)
                   for _ in range(layers))
    caches = jax.block_until_ready(_chain(pools, caches, src, dst, counts, fused=fused))
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        caches = jax.block_until_ready(_chain(pools, caches, src, dst, counts, fused=fused))
        walls.append((time.perf_counter() - t0) * 1e6)
    us = sorted(walls)[1] / reps
    nbytes = rows * width * 2 * layers
    return {"pool_gib": sum(p.nbytes for p in pools) / 2**30, "pools": len(pools),
            "layers": layers, "row_bytes": width * 2, "rows": rows, "ordered": ordered,
            "fused": fused, "bytes": nbytes, "reps": reps, "chain_walls_us": walls,
            "us_per_gather": us, "GBps": gbps(nbytes, us),
            "Mrows_per_s": rows * len(pools) / us}


def _anon_huge_kib() -> int | None:
    """AnonHugePages of /proc/meminfo (transparent huge pages in use), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _host_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {}
    for name in ("enabled", "defrag"):
        path = pathlib.Path(f"/sys/kernel/mm/transparent_hugepage/{name}")
        facts[f"thp_{name}"] = path.read_text().strip() if path.exists() else None
    return facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512 if SMALL else 27648,
                   help="rows gathered per layer and call (default: the e2e step's misses "
                        "at 256 requests)")
    p.add_argument("--sizes-gib", default="0.02,0.04" if SMALL else "0.5,2,8,16",
                   help="pool sizes in GiB, comma-separated; the first is the baseline")
    p.add_argument("--reps", type=int, default=2 if SMALL else 12,
                   help="gathers chained in one jit (distinct rows each)")
    p.add_argument("--cases", default="size,sorted,width,layers",
                   help="which cases to run, comma-separated (size,sorted,width,layers)")
    p.add_argument("--output", type=pathlib.Path, default=None)
    args = p.parse_args(argv)
    cases = set(args.cases.split(","))
    if not cases <= {"size", "sorted", "width", "layers"}:
        p.error(f"--cases must name some of size,sorted,width,layers, got {args.cases!r}")
    try:
        sizes = [float(s) for s in args.sizes_gib.split(",") if s]
    except ValueError:
        p.error(f"--sizes-gib must be numbers separated by commas, got {args.sizes_gib!r}")
    if not sizes or min(sizes) <= 0:
        p.error(f"--sizes-gib must name at least one size > 0, got {args.sizes_gib!r}")
    if args.rows < 1:
        p.error(f"--rows must be >= 1, got {args.rows}")
    if args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    fewest = BLOCK * min(_blocks(min(sizes), 576), _blocks(max(sizes) / 2, 576),
                         _blocks(max(sizes), 2304))
    if args.rows * args.reps > fewest:
        p.error(f"--rows x --reps must be at most {fewest} (the rows of the smallest pool "
                f"this run makes), got {args.rows} x {args.reps}")

    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"rows": args.rows, "reps": args.reps, "host": _host_facts(),
                           "figures": []}
    name = "gather_pool" + ("_smoke" if SMALL else "")

    def record(tag: str, fig: dict[str, Any]) -> None:
        fig["case"] = tag
        base = out["figures"][0] if out["figures"] else fig
        fig["ratio_GBps_to_baseline"] = fig["GBps"] / base["GBps"]
        out["figures"].append(fig)
        print(f"{tag:26s} {fig['pools']} x {fig['pool_gib'] / fig['pools']:6.2f} GiB "
              f"{fig['row_bytes']:5d} B {fig['us_per_gather']:8.1f} us {fig['GBps']:6.1f} GB/s "
              f"{fig['Mrows_per_s']:6.2f} Mrows/s  THP {fig['anon_huge_pages_kib']} KiB",
              flush=True)
        write_result(name, out, args.output)

    def with_pools(tag: str, gib: float, width: int, count: int = 1, **kw) -> None:
        pools = [_pool(gib, width) for _ in range(count)]
        fig = _time(pools, args.rows, args.reps, rng, **kw)
        fig["anon_huge_pages_kib"] = _anon_huge_kib()
        record(tag, fig)
        del pools
        gc.collect()

    big = max(sizes)
    if "size" in cases:
        for gib in sizes:
            with_pools("size", gib, 576)
    if "sorted" in cases:
        with_pools("size-sorted", big, 576, ordered=True)
    if "width" in cases:
        with_pools("width2304", big, 1152)
        with_pools("width4608", big, 2304)
    if "layers" in cases:
        with_pools("layers-2pools-one-launch", big / 2, 576, 2)
        with_pools("layers-2pools-per-layer", big / 2, 576, 2, fused=False)
        with_pools("layers-1pool-side-by-side", big, 1152)
        with_pools("layers-packed-pool", big, 1152, layers=2)
    print("wrote", write_result(name, out, args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
