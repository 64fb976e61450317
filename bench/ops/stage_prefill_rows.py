"""stage_prefill_rows benchmark: a prefill chunk's selected rows into a staging buffer.

Run on the GPU machine: `PYTHONPATH=. python3 -m bench.ops.stage_prefill_rows` (or within
the suite: `python3 -m bench.ops stage_prefill_rows`). Writes
`bench/results/stage_prefill_rows-<backend>.json`.

  * M = 2048, 16384 and 65536 staging rows of 1152 B (576 bf16), one layer: M distinct
    positions out of a context of 2M tokens whose pages are all on the host (a 604 MB pinned
    pool) and about half of them also resident on the device (those rows are copied device
    to device: the resident copy wins), so about half the rows cross PCIe. Figures: the
    kernel's and the `compute_on` reference's time, GB/s of all staged bytes and of the host
    bytes alone, and the same-run bulk baselines: one `jax.device_put` pinned_host -> device
    of the host rows' bytes (the PCIe part the kernel cannot avoid; ratio_to_bulk =
    bulk time / kernel time, 1.0 = the kernel costs no more than that bulk copy) and of all
    M rows' bytes; and the 1 GiB bulk copy (the large-transfer ceiling);
  * index group: the 16384-row plan into L = 8 layers (smaller pools), one launch vs the
    reference.
HISPARSE_BENCH_SMALL=1 runs tiny shapes (on the CPU: the kernel in the Pallas interpreter).
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

HOST, DEVICE = sharding("pinned_host"), sharding("device")


def make_plan(rng, rows: int, host_blocks: int) -> dict[str, Any]:
    """`rows` distinct positions of a 2 * rows token context (2 * rows / BLOCK pages),
    every page on a distinct host block, about half resident on a distinct device block."""
    context = 2 * rows
    pages = -(-context // BLOCK)
    if pages >= host_blocks:
        raise ValueError(f"{pages} pages need more than the pool's {host_blocks} blocks")
    num_blocks = pages + 1                                      # block 0 is the null block
    positions = np.sort(rng.choice(context, size=rows, replace=False)).astype(np.int32)
    source = rng.choice(np.arange(1, host_blocks), size=pages, replace=False).astype(np.int32)
    resident = rng.choice(np.arange(1, num_blocks), size=pages, replace=False)
    resident = np.where(rng.random(pages) < 0.5, resident, 0).astype(np.int32)
    page_of = positions // BLOCK
    return {"positions": jnp.asarray(positions), "source": jnp.asarray(source),
            "resident": jnp.asarray(resident), "num_blocks": num_blocks, "pages": pages,
            "device_rows": int((resident[page_of] > 0).sum()),
            "host_rows": int((resident[page_of] <= 0).sum())}


def time_backend(pools, caches, plan, rows: int, backend: str, *, iters: int):
    """Median time of one public call; the donated staging buffers are threaded through."""
    holder = [tuple(jax.device_put(jnp.zeros((rows, WIDTH), jnp.bfloat16), DEVICE)
                    for _ in pools)]
    counts = {}

    def step():
        out = hj.ops.stage_prefill_rows(pools, caches, holder[0], plan["positions"],
                                        plan["source"], plan["resident"], block_size=BLOCK,
                                        backend=backend)
        holder[0] = out.staging
        counts["rows"] = (out.rows_from_device, out.rows_from_host)
        return out
    timing = time_fn(step, iters=iters)
    timing["rows_from_device"], timing["rows_from_host"] = map(int, counts["rows"])
    return timing


def bench_stage(run: Run, rows: int, pool, rng) -> dict[str, Any]:
    """One layer: `rows` staging rows, half from the device cache, half from `pool`."""
    plan = make_plan(rng, rows, pool.shape[0])
    cache = jax.device_put(rand_bf16(rng, (plan["num_blocks"], BLOCK, WIDTH)), DEVICE)
    out: dict[str, Any] = {"rows": rows, "row_bytes": ROW_BYTES, "pages": plan["pages"],
                           "pool_rows": pool.shape[0] * BLOCK,
                           "device_rows": plan["device_rows"], "host_rows": plan["host_rows"]}
    for backend in ("triton", "reference"):
        out[backend] = time_backend((pool,), (cache,), plan, rows, backend,
                                    iters=10 if backend == "reference" else 20)
        if (out[backend]["rows_from_device"], out[backend]["rows_from_host"]) != (
                plan["device_rows"], plan["host_rows"]):
            raise AssertionError(f"{backend} counts {out[backend]} differ from the plan's")
    host_bytes, all_bytes = plan["host_rows"] * ROW_BYTES, rows * ROW_BYTES
    out["bulk_host_rows_to_device"] = bulk(host_bytes, "pinned_host", DEVICE)
    out["bulk_all_rows_to_device"] = bulk(all_bytes, "pinned_host", DEVICE)
    kernel_us = out["triton"]["median_us"]
    bulk_host_us = out["bulk_host_rows_to_device"]["median_us"]
    bulk_1g = bulk_1gib_gbps("pinned_host", DEVICE)
    out.update(
        kernel_GBps=gbps(all_bytes, kernel_us), kernel_host_GBps=gbps(host_bytes, kernel_us),
        bulk_host_rows_GBps=gbps(host_bytes, bulk_host_us),
        bulk_all_rows_GBps=gbps(all_bytes, out["bulk_all_rows_to_device"]["median_us"]),
        ratio_to_bulk=bulk_host_us / kernel_us,
        bulk_1GiB_GBps=bulk_1g, host_ratio_to_bulk_1GiB=gbps(host_bytes, kernel_us) / bulk_1g,
        speedup_vs_reference=out["reference"]["median_us"] / kernel_us)
    run.table.append(f"stage {rows:6d} rows ({plan['host_rows']} host): {kernel_us:8.1f} us "
                     f"{out['kernel_GBps']:5.1f} GB/s staged, host part "
                     f"{out['kernel_host_GBps']:5.1f} GB/s = {out['ratio_to_bulk']:.2f} x "
                     f"same-size bulk, {out['host_ratio_to_bulk_1GiB']:.2f} x 1 GiB bulk "
                     f"{bulk_1g:.1f} GB/s, {out['speedup_vs_reference']:.1f}x reference")
    return out


def bench_group(run: Run, layers: int, rows: int, rng) -> dict[str, Any]:
    """The plan of `rows` rows into `layers` layers: one launch vs the reference."""
    host_blocks = 2 * (-(-2 * rows // BLOCK))
    pools = tuple(jax.device_put(rand_bf16(rng, (host_blocks, BLOCK, WIDTH)), HOST)
                  for _ in range(layers))
    plan = make_plan(rng, rows, host_blocks)
    caches = tuple(jax.device_put(rand_bf16(rng, (plan["num_blocks"], BLOCK, WIDTH)), DEVICE)
                   for _ in range(layers))
    out: dict[str, Any] = {"layers": layers, "rows": rows, "host_rows": plan["host_rows"]}
    for backend in ("triton", "reference"):
        out[backend] = time_backend(pools, caches, plan, rows, backend,
                                    iters=10 if backend == "reference" else 20)
    kernel_us = out["triton"]["median_us"]
    out.update(kernel_GBps=gbps(layers * rows * ROW_BYTES, kernel_us),
               kernel_host_GBps=gbps(layers * plan["host_rows"] * ROW_BYTES, kernel_us),
               speedup_vs_reference=out["reference"]["median_us"] / kernel_us)
    run.table.append(f"group L={layers} x {rows} rows: one launch {kernel_us:.0f} us "
                     f"({out['kernel_host_GBps']:.1f} GB/s host part), reference "
                     f"{out['reference']['median_us']:.0f} us")
    return out


def main() -> None:
    run = Run("stage_prefill_rows", sweep_budget_s=0.0)
    rng = np.random.default_rng(0)
    host_blocks = 64 if SMALL else 1 << 13                      # 604 MB of pinned rows
    holder = [jax.device_put(rand_bf16(rng, (host_blocks, BLOCK, WIDTH)), HOST)]
    for rows in ((256,) if SMALL else (2048, 16384, 65536)):
        run.record(f"stage_prefill_rows_{rows}_rows",
                   lambda rows=rows: bench_stage(run, rows, holder[0], rng))
    holder.clear()                                              # free the pool
    run.record("index_group_L8", lambda: bench_group(run, 2 if SMALL else 8,
                                                     256 if SMALL else 16384, rng))
    run.finish()


if __name__ == "__main__":
    main()
