"""gather_compact benchmark: rows from a pinned_host pool into the device cache.

Run on the GPU machine: `PYTHONPATH=. python3 -m bench.ops.gather_compact`. Writes
`bench/results/gather_compact-<backend>.json`.

  * gather_compact: 2048, 16384 and 65536 rows of 1152 B (576 bf16) from a 604 MB pool, the
    kernel vs a bulk `jax.device_put` pinned_host -> device of the same bytes (bandwidth
    ratio; and vs a 1 GiB bulk copy, the large-transfer ceiling) and vs the `compute_on`
    reference (speed-up); wall time of one public call;
  * the same at 16384 and 65536 rows of 656 B (fp8_ds_mla rows, uint8; `docs/kv_format.md`)
    from a 344 MB pool, with the ratio to the bf16 figure of the same row count;
  * index group: `gather_compact_group` of one swap plan into L=8 layers, one launch vs one
    launch per layer vs the reference.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import hisparse_jax as hj
from bench._common import time_fn
from bench.ops import (
    BLOCK,
    ROW_BYTES,
    SMALL,
    WIDTH,
    Run,
    bulk,
    bulk_1gib_gbps,
    gbps,
    rand_bf16,
    sharding,
)
from pallas_kernels.kv_format import FP8_ROW_BYTES

HOST, DEVICE = sharding("pinned_host"), sharding("device")


def _random_rows(rng, shape, dtype):
    """Random bf16 rows, or random bytes for uint8 (fp8_ds_mla) rows."""
    if jnp.dtype(dtype) == jnp.uint8:
        return rng.integers(0, 256, size=shape, dtype=np.uint8)
    return rand_bf16(rng, shape)


def swap_plan(rng, n: int, k: int, misses: int, host_rows: int, rows: int):
    """A swap plan of n batch rows of k entries whose first `misses` entries copy distinct
    random host rows to distinct device rows (the rest -1), into a cache of
    max(2 * rows // BLOCK, 64) blocks: (src, dst, counts, num_blocks)."""
    num_blocks = max(2 * rows // BLOCK, 64)
    src = np.full((n, k), -1, np.int32)
    src[:, :misses] = rng.choice(host_rows, size=(n, misses), replace=False)
    dst = np.full((n, k), -1, np.int32)
    dst[:, :misses] = rng.permutation(num_blocks * BLOCK)[: n * misses].reshape(n, misses)
    return (jnp.asarray(src), jnp.asarray(dst), jnp.full((n,), misses, jnp.int32),
            num_blocks)


def bench_gather(run: Run, rows: int, pool, rng) -> dict[str, Any]:
    """`rows` rows of `pool` ([host_blocks, BLOCK, row], bf16 or uint8) into a device cache."""
    row_bytes = pool.shape[-1] * pool.dtype.itemsize
    n = max(1, rows // 2048)
    k = rows // n
    host_rows = pool.shape[0] * pool.shape[1]
    src, dst, counts, num_blocks = swap_plan(rng, n, k, k, host_rows, rows)
    out: dict[str, Any] = {"rows": rows, "row_bytes": row_bytes, "pool_rows": host_rows,
                           "dtype": str(pool.dtype)}
    for backend in ("triton", "reference"):
        holder = [jax.device_put(_random_rows(rng, (num_blocks, BLOCK, pool.shape[-1]),
                                              pool.dtype), DEVICE)]

        def step(backend=backend, holder=holder):
            holder[0] = hj.gather_compact(pool, holder[0], src, dst, counts, backend=backend,
                                          validate=False)
            return holder[0]
        out[backend] = time_fn(step, iters=20)
    same_size = bulk(rows * row_bytes, "pinned_host", DEVICE)
    out["bulk_device_put_host_to_device"] = same_size
    kernel_gbps = gbps(rows * row_bytes, out["triton"]["median_us"])
    bulk_gbps = gbps(rows * row_bytes, same_size["median_us"])
    out.update(
        kernel_GBps=kernel_gbps, bulk_GBps=bulk_gbps,
        ratio_to_bulk=kernel_gbps / bulk_gbps,
        target_ratio_to_bulk=0.8 if rows >= 16384 else 0.5,
        speedup_vs_reference=out["reference"]["median_us"] / out["triton"]["median_us"])
    bulk_1g = bulk_1gib_gbps("pinned_host", DEVICE)
    out.update(bulk_1GiB_GBps=bulk_1g, ratio_to_bulk_1GiB=kernel_gbps / bulk_1g)
    bf16 = run.results.get(f"gather_compact_{rows}_rows", {}).get("triton")
    if row_bytes != ROW_BYTES and bf16:
        out["bf16_rows_us"] = bf16["median_us"]
        out["speedup_vs_bf16_rows"] = bf16["median_us"] / out["triton"]["median_us"]
    run.table.append(f"gather {rows:6d} rows of {row_bytes} B: "
                     f"{out['triton']['median_us']:8.1f} us "
                     f"{kernel_gbps:5.1f} GB/s = {out['ratio_to_bulk']:.2f} x same-size bulk, "
                     f"{out['ratio_to_bulk_1GiB']:.2f} x 1 GiB bulk {bulk_1g:.1f} GB/s "
                     f"(target {out['target_ratio_to_bulk']}), "
                     f"{out['speedup_vs_reference']:.1f}x reference")
    return out


def bench_group(run: Run, layers: int, rng) -> dict[str, Any]:
    n, k, misses = (2, 64, 8) if SMALL else (64, 2048, 256)
    host_blocks, num_blocks = (4 if SMALL else 1 << 11), 2 * n * k // BLOCK
    pools = [jax.device_put(rand_bf16(rng, (host_blocks, BLOCK, WIDTH)), HOST)
             for _ in range(layers)]
    src = np.full((n, k), -1, np.int32)
    dst = np.full((n, k), -1, np.int32)
    src[:, :misses] = rng.choice(host_blocks * BLOCK, (n, misses), replace=False)
    dst[:, :misses] = rng.permutation(num_blocks * BLOCK)[: n * misses].reshape(n, misses)
    src, dst = jnp.asarray(src), jnp.asarray(dst)
    counts = jnp.full((n,), misses, jnp.int32)
    out: dict[str, Any] = {"layers": layers, "N": n, "misses_per_row": misses}
    for name, backend, fused in (("one_launch", "triton", True),
                                 ("per_layer", "triton", False),
                                 ("reference", "reference", False)):
        holder = [tuple(jax.device_put(jnp.zeros((num_blocks, BLOCK, WIDTH), jnp.bfloat16),
                                       DEVICE) for _ in range(layers))]

        def step(backend=backend, fused=fused, holder=holder):
            holder[0] = hj.ops.gather_compact_group(pools, holder[0], src, dst, counts,
                                                    backend=backend, fused=fused,
                                                    validate=False)
            return holder[0]
        out[name] = time_fn(step, iters=10 if backend == "reference" else 20)
    out["one_launch_speedup_vs_per_layer"] = (out["per_layer"]["median_us"]
                                              / out["one_launch"]["median_us"])
    out["one_launch_speedup_vs_reference"] = (out["reference"]["median_us"]
                                              / out["one_launch"]["median_us"])
    run.table.append(f"group L={layers}: one launch {out['one_launch']['median_us']:.0f} us, "
                     f"per layer {out['per_layer']['median_us']:.0f} us, reference "
                     f"{out['reference']['median_us']:.0f} us")
    return out


def main() -> None:
    run = Run("gather_compact", sweep_budget_s=0.0)
    rng = np.random.default_rng(0)
    host_blocks = 64 if SMALL else 1 << 13                      # 604 MB of pinned rows
    holder = [jax.device_put(rand_bf16(rng, (host_blocks, BLOCK, WIDTH)), HOST)]
    for rows in ((256,) if SMALL else (2048, 16384, 65536)):
        run.record(f"gather_compact_{rows}_rows",
                   lambda rows=rows: bench_gather(run, rows, holder[0], rng))
    holder.clear()                                              # free the pool
    holder.append(jax.device_put(_random_rows(rng, (host_blocks, BLOCK, FP8_ROW_BYTES),
                                              jnp.uint8), HOST))    # 344 MB of fp8 rows
    for rows in ((256,) if SMALL else (16384, 65536)):
        run.record(f"gather_compact_fp8_{rows}_rows",
                   lambda rows=rows: bench_gather(run, rows, holder[0], rng))
    holder.clear()
    run.record("index_group_L8", lambda: bench_group(run, 2 if SMALL else 8, rng))
    run.finish()


if __name__ == "__main__":
    main()
