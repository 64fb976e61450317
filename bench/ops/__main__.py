"""Runs every op benchmark (or the named ones) within a time budget, one process each.

  PYTHONPATH=. python3 -m bench.ops [--budget SECONDS] [op ...]
  PYTHONPATH=. python3 -m bench.ops --validate-cost       (the default value checks' cost)

Each op's module runs as `python3 -m bench.ops.<op>` with a time limit of its share of what
is left of the budget (at most its `LIMITS` entry), passed to it as HISPARSE_BENCH_LIMIT_S
(a benchmark with a time budget of its own fits it to that); a benchmark that fails or runs
out of time does not stop the others (each writes its result file after every figure). Prints a
summary line per op and exits non-zero if any failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

# op -> the most seconds its benchmark may take (the H200 times stay well below).
LIMITS = {
    "resolve_residency": 300,     # single-row and union (r = 2) figures
    "invalidate_written_rows": 90,
    "gather_compact": 120,
    "mirror_rows": 90,
    "stage_prefill_rows": 120,    # one layer at 3 sizes, and L = 8 at 16384 rows
    "sparse_mla_decode": 240,      # bf16 and fp8_ds_mla rows
    "copies_beside_attention": 120,  # 16 GiB of pinned pools
}
# Run only when asked (`--validate-cost`), not with the others.
EXTRA_LIMITS = {"validate_cost": 300}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("ops", nargs="*", help=f"ops to benchmark (default: all of "
                                          f"{', '.join(LIMITS)})")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all of them")
    p.add_argument("--validate-cost", action="store_true",
                   help="run only `bench.ops.validate_cost`: the ops' default value checks "
                        "against validate=False")
    args = p.parse_args(argv)
    if args.validate_cost and args.ops:
        p.error("--validate-cost runs alone; name no ops")
    ops = ["validate_cost"] if args.validate_cost else args.ops or list(LIMITS)
    limits = {**LIMITS, **EXTRA_LIMITS}
    unknown = sorted(set(ops) - set(limits))
    if unknown:
        p.error(f"unknown ops {unknown}; the ops are {list(LIMITS)}")
    t_start = time.monotonic()
    summary, failed = [], False
    for i, op in enumerate(ops):
        left = args.budget - (time.monotonic() - t_start)
        if left < 10:
            summary.append(f"{op}: skipped (budget spent)")
            failed = True
            continue
        share = sum(limits[o] for o in ops[i:])
        limit = min(limits[op], left * limits[op] / share if share > left else limits[op])
        t0 = time.monotonic()
        print(f"=== bench.ops.{op} (limit {limit:.0f} s)", flush=True)
        try:
            env = dict(os.environ, HISPARSE_BENCH_LIMIT_S=f"{limit:.0f}")
            rc = subprocess.run([sys.executable, "-m", f"bench.ops.{op}"], timeout=limit,
                                check=False, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        summary.append(f"{op}: exit {rc} in {time.monotonic() - t0:.0f} s")
        failed |= rc != 0
    print("=== summary")
    print("\n".join(summary))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
