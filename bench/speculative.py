"""Speculative decoding end to end: tokens/s with k draft tokens against no speculation.

The setting of `bench/e2e_decode.py` (default `dsv32-2l`, synthetic 64K-token prompts, the
drift top-k model, one GPU KV budget for every run, HiSparse and all-resident alive together
and measured in alternating blocks) with `EngineConfig.speculative.num_tokens` = k. The
random-weight model has no trained MTP head (its drafts would almost never be accepted), so
drafts come from `hisparse_jax.draft_sources.AcceptanceRateDraft`: each draft is accepted
with the configured probability (the first rejection ends the run), which is what a trained
head's acceptance rate does to the step; the emitted tokens are then not the model's, which
the timing does not care about. Every k > 0 step verifies k + 1 query rows per request,
resolved as one union (`docs/semantics.md`); the default hot region grows to
2 (1 + k) top_k rows, and the budget is planned for the largest k, so all runs share it.

For each concurrency C (default 1 and 256): k = 0 (the baseline, measured in the same run),
then every k in --k at every rate in --rates, then k = 0 again (the first engine of a process
also pays for first touches of the pinned pool and the allocator). The ratio reported per
(mode, C, k, rate) is tokens/s over the mean of the two k = 0 runs of the same mode and C.
The ablation (on unless --no-ablation): HiSparse with per-row resolution
(`EngineConfig.residency=HiSparse(per_row=True)`: one resolve and copy pass per row index) at the
largest C, k and the middle rate, against the union run: hit rate, rows host -> device per
step, tokens/s.

    python3 -m bench.speculative                                      # the GPU sweep
    python3 -m bench.speculative --config tiny --context 2048 --gen-budget 256 \\
        --concurrency 1,4 --block-size 16 --measure-steps 8 --rates 0.8 --k 1  # CPU smoke

Results: `bench/results/speculative-<backend>.json` (written after every group).
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import jax

from bench._common import RESULTS_DIR, write_result
from bench.e2e_decode import (
    CompileCounter,
    _floats,
    _ints,
    _print,
    plan_sizes,
    run_group,
)
from hisparse_jax import models
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.draft_sources import AcceptanceRateDraft
from hisparse_jax.engine import Speculative
from host_tier import HostPool


def _label(r: dict[str, Any]) -> str:
    spec = r.get("speculation", {})
    if not spec.get("k"):
        return "k=0"
    tail = "" if spec.get("union", True) else " per-row"
    return f"k={spec['k']} rate={spec['rate']}{tail}"


def ratios(results: list[dict[str, Any]]) -> dict[str, Any]:
    """tokens/s over the same mode and concurrency's k = 0 run; the ablation's figures."""
    ok = [r for r in results if "decode_tokens_per_s" in r]
    runs: dict[tuple[str, int], list[float]] = {}
    for r in ok:
        if not r["speculation"]["k"]:
            runs.setdefault((r["mode"], r["concurrency"]), []).append(r["decode_tokens_per_s"])
    # The k = 0 baseline runs first and last at each concurrency: the ratio is over their mean.
    base = {key: sum(v) / len(v) for key, v in runs.items()}
    out: dict[str, Any] = {"no_speculation_tokens_per_s": {
        f"{m} C={c}": v for (m, c), v in runs.items()}, "over_no_speculation": {},
        "ablation": {}}
    for r in ok:
        b = base.get((r["mode"], r["concurrency"]))
        if b is None or not r["speculation"]["k"]:
            continue
        key = f"{r['mode']} C={r['concurrency']} {_label(r)}"
        out["over_no_speculation"][key] = r["decode_tokens_per_s"] / b
    for r in ok:
        if r["speculation"].get("union", True):
            continue
        twin = next((u for u in ok if u["mode"] == r["mode"]
                     and u["concurrency"] == r["concurrency"]
                     and u["speculation"] == {**r["speculation"], "union": True}), None)
        if twin is not None:
            out["ablation"][f"{r['mode']} C={r['concurrency']} {_label(twin)}"] = {
                "hit_rate_union": twin["hit_rate"], "hit_rate_per_row": r["hit_rate"],
                "rows_h2d_per_step_union": twin["rows_h2d_per_step"],
                "rows_h2d_per_step_per_row": r["rows_h2d_per_step"],
                "tokens_per_s_union_over_per_row": (twin["decode_tokens_per_s"]
                                                    / r["decode_tokens_per_s"])}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="dsv32-2l", choices=sorted(models.CONFIGS))
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--gen-budget", type=int, default=1024)
    p.add_argument("--concurrency", type=_ints, default=[1, 256])
    p.add_argument("--modes", type=lambda t: t.split(","), default=["hisparse", "all-resident"])
    p.add_argument("--k", type=_ints, default=[1, 2], help="draft tokens per step")
    p.add_argument("--rates", type=_floats, default=[0.6, 0.8, 0.9])
    p.add_argument("--no-ablation", action="store_true")
    p.add_argument("--turnover", type=float, default=0.05)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--gpu-blocks", type=int, default=None)
    p.add_argument("--warmup-steps", type=int, default=4)
    p.add_argument("--measure-steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-ramp-steps", type=int, default=2000)
    p.add_argument("--time-budget", type=float, default=float("inf"),
                   help="seconds; groups past it are recorded as skipped")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    args.trace = None  # run_group's top-k: the drift model
    t_start = time.perf_counter()
    cfg = models.get_config(args.config)
    k_max = max(args.k)
    # The budget holds the largest k's default hot regions; every engine uses its own default.
    planning = copy.copy(args)
    planning.hot_size = HiSparseConfig.default_hot_size(cfg.top_k, args.block_size, k_max)
    sizes = plan_sizes(planning, cfg)
    args.hot_size = None
    model = models.init_model(cfg, seed=0)
    counter = CompileCounter()
    out_json = (Path(args.output) if args.output
                else RESULTS_DIR / f"speculative-{jax.default_backend()}.json")
    config = {"model": cfg.name, "context": args.context, "gen_budget": args.gen_budget,
              "block_size": args.block_size, "top_k": cfg.top_k, "turnover": args.turnover,
              "drafts": "AcceptanceRateDraft (placeholder drafts accepted with the rate)",
              "prefill": "synthetic (random KV rows written straight into the caches)",
              "hot_size": "default per k: 2 (1 + k) top_k",
              "warmup_steps": args.warmup_steps, "measure_steps": args.measure_steps,
              "rounds": args.rounds, **sizes}
    print(f"[spec] {cfg.name} on {jax.devices()[0].device_kind}: {json.dumps(sizes)}",
          flush=True)
    c_max = max(args.concurrency)
    mid_rate = sorted(args.rates)[len(args.rates) // 2]
    groups: list[tuple[int, dict[str, Any], list[str]]] = []
    for c in sorted(set(args.concurrency), reverse=True):
        groups.append((c, {"k": 0}, args.modes))
        groups += [(c, {"k": k, "rate": rate, "union": True}, args.modes)
                   for k in args.k for rate in args.rates]
        if not args.no_ablation and c == c_max and "hisparse" in args.modes:
            groups.append((c, {"k": k_max, "rate": mid_rate, "union": False}, ["hisparse"]))
        groups.append((c, {"k": 0}, args.modes))
    results: list[dict[str, Any]] = []
    pool = None
    if any(m != "all-resident" for m in args.modes):
        pool = HostPool(num_layers=cfg.num_layers, block_size=args.block_size,
                        row_width=cfg.row_width, dtype=cfg.kv_dtype,
                        num_blocks=1 + (c_max + 1) * sizes["pages_per_request"])
        config["host_pool_gib"] = pool.nbytes / 2**30
    try:
        for c, spec, modes in groups:
            if time.perf_counter() - t_start > args.time_budget:
                results += [{"mode": m, "concurrency": c, "turnover": args.turnover,
                             "speculation": spec, "skipped": "time budget"} for m in modes]
                continue
            extra = {}
            if spec["k"]:
                extra = {"speculative": Speculative(num_tokens=spec["k"],
                                                    draft=AcceptanceRateDraft(spec["rate"])),
                         "per_row": not spec["union"]}
            for r in run_group(model, args, sizes, modes=modes, concurrency=c,
                               turnover=args.turnover, pool=pool, counter=counter,
                               extra=extra):
                r["speculation"] = spec
                results.append(r)
                print(f"[spec] {_label(r)}", end=" ")
                _print(r)
            gc.collect()
            write_result("speculative", {"config": config, "results": results,
                                         "ratios": ratios(results)}, out_json)
    finally:
        if pool is not None:
            pool.close()
    print(json.dumps(ratios(results), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
