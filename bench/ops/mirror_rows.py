"""mirror_rows benchmark: 64-row pages from the device cache into a pinned_host pool.

Run on the GPU machine: `PYTHONPATH=. python3 -m bench.ops.mirror_rows`. Writes
`bench/results/mirror_rows-<backend>.json`: 16 and 256 whole pages (device page -> a random
host page of a 604 MB pool), the kernel vs a bulk `jax.device_put` device -> pinned_host of
the same bytes (bandwidth ratio; and vs a 1 GiB bulk copy) and vs the `compute_on` reference
(speed-up); wall time of one public call (the pool is donated and threaded through).
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


def bench_mirror(run: Run, pages: int, holder: list, rng) -> dict[str, Any]:
    """`holder[0]` is the pool; mirror donates it, so the updated pool goes back there."""
    rows = pages * BLOCK
    num_blocks = 2 * pages
    cache = jax.device_put(rand_bf16(rng, (num_blocks, BLOCK, WIDTH)), DEVICE)
    # Whole pages: device page p -> a random host page.
    dev_pages = rng.permutation(num_blocks)[:pages]
    host_pages = rng.choice(holder[0].shape[0], size=pages, replace=False)
    offs = np.arange(BLOCK)
    device_rows = jnp.asarray((dev_pages[:, None] * BLOCK + offs).reshape(-1).astype(np.int32))
    host_rows = jnp.asarray((host_pages[:, None] * BLOCK + offs).reshape(-1).astype(np.int32))
    out: dict[str, Any] = {"pages": pages, "rows": rows, "row_bytes": ROW_BYTES}
    for backend in ("triton", "reference"):
        def step(backend=backend):
            holder[0] = hj.mirror_rows(cache, holder[0], device_rows, host_rows,
                                       backend=backend, validate=False)
            return holder[0]
        out[backend] = time_fn(step, iters=10 if backend == "reference" else 20)
    same_size = bulk(rows * ROW_BYTES, "device", HOST)
    out["bulk_device_put_device_to_host"] = same_size
    kernel_gbps = gbps(rows * ROW_BYTES, out["triton"]["median_us"])
    bulk_gbps = gbps(rows * ROW_BYTES, same_size["median_us"])
    out.update(kernel_GBps=kernel_gbps, bulk_GBps=bulk_gbps,
               ratio_to_bulk=kernel_gbps / bulk_gbps, target_ratio_to_bulk=0.7,
               speedup_vs_reference=out["reference"]["median_us"] / out["triton"]["median_us"])
    bulk_1g = bulk_1gib_gbps("device", HOST)
    out.update(bulk_1GiB_GBps=bulk_1g, ratio_to_bulk_1GiB=kernel_gbps / bulk_1g)
    run.table.append(f"mirror {pages:4d} pages x 64: {out['triton']['median_us']:8.1f} us "
                     f"{kernel_gbps:5.1f} GB/s = {out['ratio_to_bulk']:.2f} x same-size bulk, "
                     f"{out['ratio_to_bulk_1GiB']:.2f} x 1 GiB bulk {bulk_1g:.1f} GB/s "
                     f"(target 0.7), {out['speedup_vs_reference']:.1f}x reference")
    return out


def main() -> None:
    run = Run("mirror_rows", sweep_budget_s=0.0)
    rng = np.random.default_rng(0)
    host_blocks = 64 if SMALL else 1 << 13                      # 604 MB of pinned rows
    holder = [jax.device_put(rand_bf16(rng, (host_blocks, BLOCK, WIDTH)), HOST)]
    for pages in ((4,) if SMALL else (16, 256)):
        run.record(f"mirror_rows_{pages}_pages",
                   lambda pages=pages: bench_mirror(run, pages, holder, rng))
    holder.clear()
    run.finish()


if __name__ == "__main__":
    main()
