"""End-to-end decode throughput: HiSparse against all-resident and naive offload.

The same model (default `dsv32-2l`: the DeepSeek-V3.2 attention dimensions, 2 layers), the
same requests and the same GPU KV budget (device blocks per layer) in three modes:

  * `all-resident`: every KV row on the device; admission is capped by the budget
    (`(budget - 1) // pages_per_request` requests at once, the rest wait);
  * `naive-offload`: every row lives on the host; every step copies every selected row that is
    not in the request's pinned tail from the pinned pool (no reuse across steps);
  * `hisparse`: resident pages while the pool has room, hot regions (LRU over host rows)
    once it does not; misses are copied from host inside the step.

Prompts are long (default 65,536 tokens). Their prefill is SYNTHETIC: deterministic random KV
rows are written straight into the device pages (then spilled to host like any prefill), the
model is not run over the prompt; decode runs the model for real. The top-k comes from a drift
model (`hisparse_jax.topk_sources.DriftTopK`: a set turnover per step), a trace file
(`--trace`, format in `hisparse_jax/topk_sources.py`), or, with `--indexer`, the model's own
indexer over synthetic unit-normal index keys (its full cost at the prompt length: keys of every
row read and ranked each step; the selections, and so the turnover, are whatever it picks).
`--num-layers` deepens the config (every layer its own attention; index groups as configured).

For each (mode, concurrency C, turnover) the benchmark submits C requests, steps the engine
until its steady state (C running, or all-resident's cap running with the rest waiting), runs
`--warmup-steps` more, then times `--measure-steps` whole engine steps (scheduler, transfers,
jitted decode, sampling; wall clock). Reported: decode tokens/s, inter-token latency p50 / p95
(the step times; with async scheduling the drain that closes each measured block counts in
tokens/s but not in the latencies), hot-buffer hit rate, rows and bytes host -> device per
step, compiles seen in the measured window (should be 0), memory. Results go to
`bench/results/e2e_decode-<backend>.json` (written after every run) and a PNG plot (`--plot`,
matplotlib).

`--kv-format bf16,fp8_ds_mla` runs every group once per KV row format (`docs/kv_format.md`;
one pinned pool per format, the same GPU KV budget in blocks), records each run's row bytes,
bytes host -> device per step and host pool bytes per request, and adds the ratios fp8 / bf16
(tokens/s, bytes per step) and, per format, HiSparse / all-resident; the record then goes to
`e2e_decode-<backend>-<formats>.json`.

`--attention-backend` picks `EngineConfig.tuning.attention` (the `sparse_mla_decode` backend:
"reference", "triton", "mosaic_gpu", or "default", the registry's choice: on a Hopper GPU
"mosaic_gpu" over fp8_ds_mla rows, "triton" over bf16 rows).
Each comma-separated entry is a backend for every `--kv-format`, or `FORMAT:BACKEND` for that
format only; every group runs once per (kv format, backend) pair, in `--kv-format` order, each
format's backends in the flag's order (pairs run one after another, not interleaved). Each run
records its `attention_backend`; with more than one pair the ratios add "over_first_variant"
(tokens/s over the first pair's, same mode and concurrency, base turnover) and "by_variant",
and "fp8_over_bf16" compares the two formats on the same backend (the first that ran both).
Every pair is checked against the model and the budget before the first run
(`EngineConfig.check_platform`: the op registry's reason why a backend cannot run the
attention), and the default file name gets `-<backends>` unless every pair runs the default.
fp8 rows, the Triton and the Mosaic GPU row-copy attention, against bf16 rows on Triton, at 256
requests of DeepSeek-V3.2's real-dimension slice (32K contexts: bf16 rows of 64K contexts for
257 requests need a 73 GiB pinned pool, which the GPU machine's host allocator did not give, as
`bench/NOTES-e2e.md` says; fp8 rows at 64K need 42 GiB):

    python3 -m bench.e2e_decode --config dsv32-real --num-layers 4 --async-scheduling \\
        --context 32768 --kv-format bf16,fp8_ds_mla \\
        --attention-backend triton,fp8_ds_mla:mosaic_gpu --concurrency 256 --modes hisparse \\
        --turnover-sweep= --warmup-steps 4 --measure-steps 16 --rounds 2 --no-plot

`--speculative-tokens K` verifies K draft tokens per request and step (`AcceptanceRateDraft`
at `--acceptance-rate`, default 0.8: the random model's MTP drafts would almost never be
accepted), with or without `--async-scheduling`; `bench/speculative.py` sweeps K and rates.

    python3 -m bench.e2e_decode                                   # the full sweep (GPU)
    python3 -m bench.e2e_decode --config tiny --context 2048 --concurrency 1,4 \\
        --block-size 16 --measure-steps 8                         # a CPU smoke run
    python3 -m bench.e2e_decode --plot-only bench/results/e2e_decode-async-s20-gpu.json
    python3 -m bench.e2e_decode --kv-format bf16,fp8_ds_mla --modes hisparse,all-resident \\
        --concurrency 1,64,256 --turnover-sweep ""                # fp8 against bf16 rows (GPU)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

# Room for the pinned pools of the largest runs (must be set before JAX initialises).
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "96")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from bench import _models as bench_models  # noqa: E402
from bench._common import RESULTS_DIR, HelpFormatter, write_result  # noqa: E402
from hisparse_jax import models  # noqa: E402
from hisparse_jax.config import HiSparseConfig  # noqa: E402
from hisparse_jax.draft_sources import AcceptanceRateDraft  # noqa: E402
from hisparse_jax.engine import (  # noqa: E402
    AllResident,
    Engine,
    EngineConfig,
    HiSparse,
    NaiveOffload,
    PrefillPolicy,
    Sizes,
    Speculative,
    Tuning,
)
from hisparse_jax.ops import registered_backends  # noqa: E402
from hisparse_jax.topk_sources import DriftTopK, TraceTopK  # noqa: E402
from host_tier import HostPool  # noqa: E402
from host_tier.sizes import cdiv  # noqa: E402
from pallas_kernels import kv_format as kvf  # noqa: E402

MODES = ("all-resident", "naive-offload", "hisparse")
DEFAULT_BACKEND = "default"
"""How runs and `--attention-backend` name `EngineConfig.tuning.attention=None`."""


class CompileCounter:
    """Counts XLA compilations (jax.monitoring events) while `active`."""

    def __init__(self) -> None:
        self.active = False
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_: Any) -> None:
        if self.active and event.endswith("backend_compile_duration"):
            self.count += 1


def plan_sizes(args: argparse.Namespace, spec: models.ModelSpec) -> dict[str, int]:
    B = args.block_size
    max_model_len = args.context + args.gen_budget
    pages = cdiv(max_model_len, B)
    # The default hot region: 2 (1 + k) top_k rows with k speculative tokens.
    hot_blocks = cdiv(args.hot_size or HiSparseConfig.default_hot_size(
        spec.top_k, B, getattr(args, "speculative_tokens", 0)), B)
    c_max = max(args.concurrency)
    # Default budget: HiSparse's C_max hot regions plus pinned tails, one prompt being admitted
    # and a tenth for the watermark; all-resident gets (budget - 1) // pages requests of it.
    budget = args.gpu_blocks or int(1.1 * (c_max * (hot_blocks + 3) + pages)) + 1
    return {"max_model_len": max_model_len, "pages_per_request": pages,
            "hot_blocks": hot_blocks, "gpu_blocks": budget,
            "all_resident_cap": (budget - 1) // pages}


class Skip(Exception):
    """A run that cannot reach its steady state (recorded, not fatal)."""


def engine_config(args: argparse.Namespace, sizes: dict[str, int], *, mode: str,
                  concurrency: int, source: Any, kv_format: str = kvf.BF16,
                  attention: str | None = None, shards: int = 1,
                  extra: dict[str, Any] | None = None) -> EngineConfig:
    """The `EngineConfig` of one run (`make_engine`'s arguments); `attention`:
    `EngineConfig.tuning.attention` (None: the registry's default). Skip when the GPU KV
    budget holds no full request (all-resident)."""
    seats = (min(concurrency, shards * sizes["all_resident_cap"]) if mode == "all-resident"
             else concurrency)
    if seats < 1:
        raise Skip("the GPU KV budget holds no full request")
    extra = dict(extra or {})
    per_row = extra.pop("per_row", False)
    return EngineConfig(
        sizes=Sizes(max_seats=seats, max_model_len=sizes["max_model_len"],
                    block_size=args.block_size,
                    hot_size=None if mode == "naive-offload" else args.hot_size,
                    num_gpu_blocks=None if mode == "all-resident" else sizes["gpu_blocks"]),
        residency=(AllResident() if mode == "all-resident" else NaiveOffload()
                   if mode == "naive-offload" else HiSparse(per_row=per_row)),
        topk_source=source, prefill=PrefillPolicy(bucket=args.context, synthetic=True), seed=0,
        kv_format=kv_format,
        tuning=Tuning(attention=attention,
                      position_map=not getattr(args, "no_position_map", False),
                      copy_programs=getattr(args, "copy_programs", None),
                      copy_with_attention=getattr(args, "copy_with_attention", True)),
        async_scheduling=getattr(args, "async_scheduling", False), **extra)


def make_engine(model: models.ServedModel, args: argparse.Namespace, sizes: dict[str, int], *,
                mode: str, concurrency: int, source: Any, pool: Any,
                kv_format: str = kvf.BF16, attention: str | None = None, build: Any = None,
                shards: int = 1, extra: dict[str, Any] | None = None) -> Engine:
    """`build(model, config)` makes the engine instead of `Engine` (`bench/mesh_decode.py`:
    a mesh engine of `shards` data shards, each with the `sizes` budget); `attention`:
    `EngineConfig.tuning.attention`; `extra`: more `EngineConfig` fields
    (`bench/speculative.py`: speculation), and "per_row" for the HiSparse residency's
    per-row ablation."""
    ec = engine_config(args, sizes, mode=mode, concurrency=concurrency, source=source,
                       kv_format=kv_format, attention=attention, shards=shards, extra=extra)
    engine = (Engine(model, ec, host_pool=None if mode == "all-resident" else pool)
              if build is None else build(model, ec))
    rng = np.random.default_rng(0)
    for _ in range(concurrency):
        # Token ids only matter for the last one (the first decode input): synthetic prefill.
        prompt = [1] * (args.context - 1) + [int(rng.integers(2, model.spec.vocab_size))]
        engine.add_request(prompt, max_new_tokens=sizes["max_model_len"] - args.context)
    return engine


def ramp(engine: Engine, args: argparse.Namespace) -> dict[str, Any]:
    """Steps until the steady state: every seat busy (all-resident: the rest waiting) and,
    for the host-tier modes, nobody waiting and the prompts' write-back backlog drained (at
    most one sealed page per running request without its host copy: right after the last
    admission every prompt page may still wait for its spill, and a window measured then
    times hundreds of page spills per step, which steady decoding never does); then
    `--warmup-steps` more."""
    t0 = time.perf_counter()
    steps = 0
    target = engine.config.sizes.max_seats
    manager = engine.scheduler.manager

    def backlog() -> int:
        return getattr(manager, "num_dirty_sealed_pages", 0)

    while (len(engine.running) < target
           or (engine.waiting and not isinstance(engine.config.residency, AllResident))
           or backlog() > len(engine.running)):
        engine.step()
        steps += 1
        if steps > args.max_ramp_steps:
            raise Skip(f"no steady state after {steps} steps (running {len(engine.running)}, "
                       f"waiting {len(engine.waiting)}, write-back backlog {backlog()} pages)")
    seconds = time.perf_counter() - t0
    for _ in range(args.warmup_steps):
        engine.step()
    return {"steps_to_steady_state": steps, "ramp_seconds": seconds,
            "write_back_backlog_pages": backlog()}


class Window:
    """Measured steps of one engine (possibly in several blocks)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.times: list[float] = []
        self.drains: list[float] = []  # async: each block's closing drain (see `measure`)
        self.tokens: list[int] = []
        self.running: list[int] = []
        self.dropped = 0
        self.compiles = 0
        self.hits = self.misses = self.rows = self.decode_steps = self.fast_steps = 0

    def measure(self, num_steps: int, counter: CompileCounter) -> None:
        m = self.engine.metrics
        h0, x0, r0, d0, f0 = (m.hot_hits, m.hot_misses, m.rows_moved, m.decode_steps,
                              m.fast_steps)
        done = dropped = 0
        if self.engine.config.async_scheduling:
            self.engine.drain()  # a step left in flight by the ramp: not this window's
        counter.active = True
        while done < num_steps and dropped < num_steps:
            g0, c0 = m.generated_tokens, counter.count
            n_running = len(self.engine.running)
            t0 = time.perf_counter()
            self.engine.step()
            dt = time.perf_counter() - t0
            if counter.count != c0:  # a first call of some bucketed helper: not steady state
                dropped += 1
                self.compiles += counter.count - c0
                continue
            done += 1
            self.running.append(n_running)
            self.times.append(dt)
            self.tokens.append(m.generated_tokens - g0)
        if self.engine.config.async_scheduling and self.times:
            # The block's last step is still in flight: collect it inside the window (its
            # tokens and its wait count), so that blocks of engines measured in turn do not
            # overlap and tokens/s stays tokens over time. The drain is the harness's, not
            # the engine's (continuous serving never drains): its time counts in tokens/s but
            # is kept out of the per-step latencies, which it would inflate once per block.
            g0 = m.generated_tokens
            t0 = time.perf_counter()
            self.engine.drain()
            self.drains.append(time.perf_counter() - t0)
            self.tokens[-1] += m.generated_tokens - g0
        counter.active = False
        self.dropped += dropped
        self.hits += m.hot_hits - h0
        self.misses += m.hot_misses - x0
        self.rows += m.rows_moved - r0
        self.decode_steps += m.decode_steps - d0
        self.fast_steps += m.fast_steps - f0

    def result(self) -> dict[str, Any]:
        e, t = self.engine, np.asarray(self.times)
        lookups = self.hits + self.misses
        steps = max(self.decode_steps, 1)
        s = e.summary()
        return {
            "kv_format": e.config.kv_format,
            "attention_backend": backend_label(e.config.tuning.attention_backend),
            "async_scheduling": e.config.async_scheduling,
            "row_bytes": e.row_bytes,
            "seats": e.config.sizes.max_seats,
            "decode_tokens_per_s": float(np.sum(self.tokens) / (t.sum() + sum(self.drains))),
            "itl_ms_p50": float(1e3 * np.percentile(t, 50)),
            "itl_ms_p95": float(1e3 * np.percentile(t, 95)),
            "itl_ms_mean": float(1e3 * t.mean()),
            "block_end_drains_ms": [1e3 * d for d in self.drains],
            "running_min": int(min(self.running)), "running_max": int(max(self.running)),
            "hit_rate": self.hits / lookups if lookups else None,
            "rows_h2d_per_step": self.rows / steps,
            "bytes_h2d_per_step": self.rows * e.row_bytes / steps,
            "fast_path_steps": self.fast_steps,
            "measured_steps": len(self.times),
            "measured_tokens": int(np.sum(self.tokens)),
            "steps_dropped_for_compiles": self.dropped,
            "compiles_in_window": self.compiles,
            "preemptions": e.metrics.preemptions,
            "hot_grants": s["hot_grants"], "lost_pages": s["lost_pages"],
            "device_bytes": s["device_bytes"],
            "device_allocator_bytes": s["device_allocator_bytes"],
            "host_pool_bytes": s["host_bytes"],
            "host_pool_bytes_per_request": s["host_bytes_per_request"],
            # Speculation (whole run, ramp included): drafts accepted, tokens per request-step.
            "acceptance_rate": s["acceptance_rate"] if s["draft_tokens"] else None,
            "tokens_per_request_step": s["tokens_per_request_step"],
        }


def run_group(model: models.ServedModel, args: argparse.Namespace, sizes: dict[str, int], *,
              modes: list[str], concurrency: int, turnover: float, pool: Any,
              counter: CompileCounter, kv_format: str = kvf.BF16,
              attention: str | None = None,
              extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """One concurrency and turnover. Naive offload runs alone; HiSparse and all-resident
    (when both are asked for) are alive together and measured in alternating blocks, so
    clock and host drift hit both alike. Host-tier engines run one at a time on `pool`.
    `attention`: `EngineConfig.tuning.attention` of every engine of the group; `extra`: more
    `EngineConfig` fields for every engine of the group."""
    out: list[dict[str, Any]] = []
    paired = [m for m in ("hisparse", "all-resident") if m in modes]
    groups = [[m] for m in modes if m == "naive-offload"] + ([paired] if paired else [])
    for group in groups:
        t_group = time.perf_counter()
        engines: dict[str, Engine] = {}
        info: dict[str, dict[str, Any]] = {}
        try:
            for mode in group:
                source = (None if args.indexer else TraceTopK.load(args.trace) if args.trace
                          else DriftTopK(turnover=turnover, seed=1))
                t0 = time.perf_counter()
                engines[mode] = make_engine(model, args, sizes, mode=mode,
                                            concurrency=concurrency, source=source, pool=pool,
                                            kv_format=kv_format, attention=attention,
                                            extra=extra)
                info[mode] = {"setup_seconds": time.perf_counter() - t0,
                              **ramp(engines[mode], args)}
            windows = {mode: Window(e) for mode, e in engines.items()}
            rounds = args.rounds if len(windows) > 1 else 1
            block = cdiv(args.measure_steps, rounds)
            for r in range(rounds):
                for mode in (list(windows) if r % 2 == 0 else list(windows)[::-1]):
                    windows[mode].measure(block, counter)
            for mode, w in windows.items():
                others = [m for m in windows if m != mode]
                out.append({"mode": mode, "concurrency": concurrency, "turnover": turnover,
                            **w.result(), **info[mode],
                            "measurement": (f"interleaved with {others[0]}: {rounds} blocks "
                                            f"of {block} steps each" if others
                                            else f"{block} consecutive steps"),
                            "group_seconds": time.perf_counter() - t_group})
        except Skip as e:
            out += [{"mode": m, "concurrency": concurrency, "turnover": turnover,
                     "kv_format": kv_format, "attention_backend": backend_label(attention),
                     "skipped": str(e)} for m in group]
        finally:
            for e in engines.values():
                e.close()
            engines.clear()
            gc.collect()
    return out


def _groups(args: argparse.Namespace) -> list[tuple[int, float, list[str]]]:
    """(concurrency, turnover, modes), most important first: a cut run keeps those."""
    cs = sorted(set(args.concurrency))
    order = list(dict.fromkeys([cs[0], cs[-1], *cs[1:-1][::-1]]))
    groups = [(c, args.turnover, list(args.modes)) for c in order]
    at = args.turnover_sweep_at or cs[-1]
    offload = [m for m in args.modes if m != "all-resident"]
    groups += [(at, tv, offload) for tv in args.turnover_sweep if offload]
    return groups


def _print(r: dict[str, Any]) -> None:
    head = (f"[e2e] {r['mode']:13s} {r.get('kv_format', kvf.BF16):10s} "
            f"{r.get('attention_backend', DEFAULT_BACKEND):10s} C={r['concurrency']:4d} "
            f"turnover={r['turnover']:.2f}:")
    if "skipped" in r:
        print(f"{head} skipped ({r['skipped']})", flush=True)
        return
    hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.1%}"
    print(f"{head} {r['decode_tokens_per_s']:9.1f} tok/s, ITL p50 {r['itl_ms_p50']:7.2f} ms "
          f"p95 {r['itl_ms_p95']:7.2f} ms mean {r['itl_ms_mean']:7.2f}, hit {hit}, "
          f"{r['bytes_h2d_per_step'] / 2**20:8.2f} MiB/step h2d, seats {r['seats']}, "
          f"fast {r['fast_path_steps']}, dropped {r['steps_dropped_for_compiles']}, "
          f"ramp {r['steps_to_steady_state']} steps {r['ramp_seconds']:.1f} s", flush=True)


def _of_variant(results: list[dict[str, Any]], variant: str) -> list[dict[str, Any]]:
    """The runs of one "<kv format>:<attention backend>" pair (records without the backend:
    "default")."""
    return [r for r in results if variant_of(r) == variant]


def variant_of(r: dict[str, Any]) -> str:
    """A run's "<kv format>:<attention backend>" pair."""
    return (f"{r.get('kv_format', kvf.BF16)}:"
            f"{r.get('attention_backend', DEFAULT_BACKEND)}")


def summarise(results: list[dict[str, Any]], base_turnover: float,
              kv_formats: list[str] | None = None,
              variants: list[str] | None = None) -> dict[str, Any]:
    """Ratios of the targets. `variants`: the "<kv format>:<attention backend>" pairs in run
    order (default: each of `kv_formats`, default bf16, on the default backend). At the top
    level for the first pair, and for each format's first pair under "by_kv_format" (more
    than one format) and each pair under "by_variant" (more than one pair): HiSparse /
    all-resident (every concurrency, base turnover), HiSparse / naive-offload. With bf16
    and fp8_ds_mla rows both run on one backend: "fp8_over_bf16", per concurrency at the
    base turnover, of HiSparse's tokens/s and bytes host -> device per step, on the first
    backend that ran both formats (named in its "attention_backend"; every such backend under
    "fp8_over_bf16_by_attention_backend" when there are several). With more than one pair:
    "over_first_variant", each later pair's tokens/s over the first pair's, per mode and
    concurrency at the base turnover."""
    kv_formats = kv_formats or [kvf.BF16]
    variants = variants or [f"{f}:{DEFAULT_BACKEND}" for f in kv_formats]
    out = _mode_ratios(_of_variant(results, variants[0]), base_turnover)
    if len(kv_formats) > 1:
        firsts = {v.split(":")[0]: v for v in reversed(variants)}
        out["by_kv_format"] = {f: _mode_ratios(_of_variant(results, firsts[f]), base_turnover)
                               for f in kv_formats if f in firsts}
    if len(variants) > 1:
        out["by_variant"] = {v: _mode_ratios(_of_variant(results, v), base_turnover)
                             for v in variants}
        out["over_first_variant"] = _variant_ratios(results, base_turnover, variants)
    both = [b for b in dict.fromkeys(v.split(":")[1] for v in variants)
            if {f"{kvf.BF16}:{b}", f"{kvf.FP8_DS_MLA}:{b}"} <= set(variants)]
    if both:
        by_backend = {b: _format_ratios(results, base_turnover, b) for b in both}
        out["fp8_over_bf16"] = by_backend[both[0]]
        if len(both) > 1:
            out["fp8_over_bf16_by_attention_backend"] = by_backend
    return out


def _variant_ratios(results: list[dict[str, Any]], base_turnover: float,
                    variants: list[str]) -> dict[str, Any]:
    """Each pair after the first: tokens/s over the first pair's run of the same mode and
    concurrency at the base turnover, as {pair: {mode: {concurrency: ratio}}}."""
    by = {(variant_of(r), r["mode"], r["concurrency"]): r for r in results
          if "decode_tokens_per_s" in r and r["turnover"] == base_turnover}
    out: dict[str, Any] = {"base": variants[0], "tokens_per_s": {}}
    for (v, mode, c), r in sorted(by.items(), key=lambda kv: kv[0][2]):
        b = by.get((variants[0], mode, c))
        if v == variants[0] or b is None:
            continue
        out["tokens_per_s"].setdefault(v, {}).setdefault(mode, {})[c] = (
            r["decode_tokens_per_s"] / b["decode_tokens_per_s"])
    return out


def _format_ratios(results: list[dict[str, Any]], base_turnover: float,
                   backend: str = DEFAULT_BACKEND) -> dict[str, Any]:
    """fp8_ds_mla / bf16 of HiSparse's tokens/s and bytes per step, per concurrency, both
    on the attention `backend`."""
    by = {(r.get("kv_format", kvf.BF16), r["concurrency"]): r for r in results
          if "decode_tokens_per_s" in r and r["mode"] == "hisparse"
          and r["turnover"] == base_turnover
          and r.get("attention_backend", DEFAULT_BACKEND) == backend}
    out: dict[str, Any] = {"attention_backend": backend, "hisparse_tokens_per_s": {},
                           "hisparse_bytes_h2d_per_step": {}}
    for (f, c), r in sorted(by.items(), key=lambda kv: kv[0][1]):
        b = by.get((kvf.BF16, c))
        if f != kvf.FP8_DS_MLA or b is None:
            continue
        out["hisparse_tokens_per_s"][c] = r["decode_tokens_per_s"] / b["decode_tokens_per_s"]
        if b["bytes_h2d_per_step"]:
            out["hisparse_bytes_h2d_per_step"][c] = (r["bytes_h2d_per_step"]
                                                     / b["bytes_h2d_per_step"])
    return out


def _mode_ratios(results: list[dict[str, Any]], base_turnover: float) -> dict[str, Any]:
    """HiSparse / all-resident at the base turnover and HiSparse / naive-offload, per
    concurrency, over runs of one row format."""
    by = {(r["mode"], r["concurrency"], r["turnover"]): r for r in results
          if "decode_tokens_per_s" in r}
    out: dict[str, Any] = {"hisparse_over_all_resident": {}, "hisparse_over_naive": {}}
    for (mode, c, tv), r in sorted(by.items(), key=lambda kv: kv[0][1]):
        if mode != "hisparse":
            continue
        a = by.get(("all-resident", c, base_turnover))
        if a is not None and tv == base_turnover:
            out["hisparse_over_all_resident"][c] = (r["decode_tokens_per_s"]
                                                    / a["decode_tokens_per_s"])
        n = by.get(("naive-offload", c, tv))
        if n is not None:
            out["hisparse_over_naive"][f"C={c},turnover={tv}"] = (r["decode_tokens_per_s"]
                                                                  / n["decode_tokens_per_s"])
    return out


def plot(path_json: Path, path_png: Path, sweep_json: Path | None = None) -> None:
    """Throughput against concurrency per mode (left) and against turnover (right, from
    `sweep_json` when given: e.g. an earlier run that completed the turnover sweep)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = json.loads(Path(path_json).read_text())
    # One (row format, attention backend) pair per plot: the first the run lists (records
    # before formats: bf16; before backends: the default).
    cfg = record["config"]
    shown = cfg.get("variants", [f"{cfg.get('kv_formats', [kvf.BF16])[0]}:{DEFAULT_BACKEND}"])[0]
    record["results"] = _of_variant(record["results"], shown)
    base = record["config"]["turnover"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, style in zip(MODES, ("s--", "^:", "o-"), strict=True):
        pts = sorted((r["concurrency"], r["decode_tokens_per_s"]) for r in record["results"]
                     if r["mode"] == mode and r["turnover"] == base and "decode_tokens_per_s" in r)
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=mode)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    cs = sorted({r["concurrency"] for r in record["results"]})
    ax.set_xticks(cs, [str(c) for c in cs])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("decode tokens/s")
    pair = f" ({shown})" if len(cfg.get("variants", [])) > 1 else ""
    ax.set_title(f"{cfg['model']}{pair}, {cfg['context']} context, top-k turnover {base:.0%}\n"
                 f"GPU KV budget {cfg['gpu_blocks']} blocks/layer "
                 f"(all-resident cap {cfg['all_resident_cap']})", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    sweep_record = json.loads(Path(sweep_json).read_text()) if sweep_json else record
    sweep = [r for r in sweep_record["results"]
             if "decode_tokens_per_s" in r and r["mode"] != "all-resident"]
    at = sweep_record["config"].get("turnover_sweep_at") or max(
        (r["concurrency"] for r in sweep if r["turnover"] != base), default=None)
    for mode, style in (("naive-offload", "^:"), ("hisparse", "o-")):
        # The median step: the sweep's means carry host stalls unrelated to the turnover.
        pts = sorted((r["turnover"], 1e3 * r["running_max"] / r["itl_ms_p50"]) for r in sweep
                     if r["mode"] == mode and r["concurrency"] == at)
        if pts:
            ax2.plot([100 * x for x, _ in pts], [y for _, y in pts], style, label=mode)
    ax2.set_xlabel("top-k set turnover per step (%)")
    ax2.set_ylabel("decode tokens/s at the median step time")
    ax2.set_title(f"turnover sweep at {at} concurrent requests"
                  + (f"\n(from {Path(sweep_json).name}, {sweep_record['date']})"
                     if sweep_json else ""), fontsize=9)
    ax2.grid(True, alpha=0.3)
    ax2.legend()
    fig.suptitle(f"hisparse-jax end-to-end decode on {record['machine']['device']} "
                 f"(jax {record['machine']['jax']}, {record['date']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _formats(text: str) -> list[str]:
    formats = list(dict.fromkeys(x for x in text.split(",") if x))
    bad = [f for f in formats if f not in kvf.KV_FORMATS]
    if bad or not formats:
        raise argparse.ArgumentTypeError(f"must list formats of {kvf.KV_FORMATS}, got {text!r}")
    return formats


def backend_label(backend: str | None) -> str:
    """`EngineConfig.tuning.attention` as runs and flags name it (None: "default")."""
    return DEFAULT_BACKEND if backend is None else backend


def _attention_backends(text: str) -> list[tuple[str | None, str | None]]:
    """`--attention-backend`: (kv format or None for every format, backend or None for the
    registry's default) per entry, in order, repeats dropped."""
    names = (DEFAULT_BACKEND, *registered_backends("sparse_mla_decode"))
    entries: list[tuple[str | None, str | None]] = []
    for item in (x for x in text.split(",") if x):
        fmt, _, name = item.rpartition(":")
        if (fmt and fmt not in kvf.KV_FORMATS) or name not in names:
            raise argparse.ArgumentTypeError(
                f"each entry must be BACKEND or FORMAT:BACKEND with BACKEND of {names} (the "
                f"sparse_mla_decode backends) and FORMAT of {kvf.KV_FORMATS}, got {item!r} "
                f"in {text!r}")
        entries.append((fmt or None, None if name == DEFAULT_BACKEND else name))
    if not entries:
        raise argparse.ArgumentTypeError(f"must name at least one backend, got {text!r}")
    return list(dict.fromkeys(entries))


def variants_of(formats: list[str], entries: list[tuple[str | None, str | None]]
                ) -> list[tuple[str, str | None]]:
    """(kv format, attention backend) pairs to run: each format of `formats` in order with
    every backend of `entries` that names it or no format, in `entries`' order. SystemExit
    when an entry names a format `formats` lacks, or a format gets no backend."""
    stray = [f for f, _ in entries if f is not None and f not in formats]
    if stray:
        raise SystemExit(f"--attention-backend names --kv-format {stray[0]}, which --kv-format "
                         f"{','.join(formats)} does not run")
    pairs = [(f, b) for f in formats for g, b in entries if g in (None, f)]
    pairs = list(dict.fromkeys(pairs))
    bare = [f for f in formats if f not in {p for p, _ in pairs}]
    if bare:
        raise SystemExit(f"--kv-format {bare[0]} has no --attention-backend entry (give a "
                         f"BACKEND for every format or {bare[0]}:BACKEND)")
    return pairs


def check_variants(model: models.ServedModel, args: argparse.Namespace,
                   sizes: dict[str, int], variants: list[tuple[str, str | None]],
                   extra: dict[str, Any] | None = None) -> None:
    """Before anything runs: every named attention backend can run the attention calls of
    every engine the groups build (`EngineConfig.check_platform`, which asks the op
    registry with the decode and prefill shapes), so a refused pair stops the run with the
    registry's reason instead of after the pairs before it. `extra`: `run_group`'s."""
    spec = model.spec
    for kv_format, attention in variants:
        if attention is None:  # the registry picks what runs
            continue
        for c, modes in dict.fromkeys((c, tuple(m)) for c, _, m in _groups(args)):
            for mode in modes:
                try:
                    ec = engine_config(args, sizes, mode=mode, concurrency=c, source=None,
                                       kv_format=kv_format, attention=attention, extra=extra)
                    ec.check_platform(spec, ec.hisparse_config(spec))
                except Skip:
                    continue
                except ValueError as e:
                    raise SystemExit(f"--attention-backend {kv_format}:{attention} ({mode}, "
                                     f"{c} requests): {e}") from None


def add_copy_flags(p: argparse.ArgumentParser) -> None:
    """The engine's copy options (--copy-programs, --copy-with-attention), read by
    `make_engine`'s EngineConfig; shared with `bench.profile_step`."""
    p.add_argument("--copy-programs", type=int, default=None,
                   help="EngineConfig.tuning.copy_programs: at most this many GPU programs move a "
                        "step's copies from host (default: a program per chunk of misses)")
    p.add_argument("--copy-with-attention", action=argparse.BooleanOptionalAction,
                   default=True,
                   help="EngineConfig.tuning.copy_with_attention: each index group after the first "
                        "looked up ahead, its copies from host in the launch of the previous "
                        "group's first attention")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--config", default="dsv32-2l", choices=bench_models.NAMES,
                   help="model: a synthetic config (hisparse_jax.models.CONFIGS) or a real "
                        "architecture's slice at its real dimensions (bench/_models.py), "
                        "randomly initialised")
    p.add_argument("--context", type=int, default=65536, help="prompt tokens per request")
    p.add_argument("--gen-budget", type=int, default=1024,
                   help="room for generated tokens (max_model_len = context + this)")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 64, 128, 256],
                   help="concurrent requests (engine seats) of each run, comma-separated")
    p.add_argument("--modes", type=lambda t: t.split(","), default=list(MODES),
                   help=f"modes to run, comma-separated, of {', '.join(MODES)}")
    p.add_argument("--turnover", type=float, default=0.05, help="drift model: set turnover/step")
    p.add_argument("--turnover-sweep", type=_floats, default=[0.02, 0.10, 0.25],
                   help="more turnovers, at --turnover-sweep-at concurrency (not all-resident)")
    p.add_argument("--turnover-sweep-at", type=int, default=None,
                   help="the concurrency of the turnover sweep (default: the largest "
                        "--concurrency)")
    p.add_argument("--trace", default=None, help="replay this top-k trace file instead")
    p.add_argument("--indexer", action="store_true",
                   help="the model's own indexer selects (over synthetic unit-normal index "
                        "keys) instead of the drift model; the turnover flags do not apply")
    p.add_argument("--num-layers", type=int, default=None,
                   help="override the config's layer count (a deeper model)")
    p.add_argument("--index-group-size", type=int, default=None,
                   help="override the config's layers per index group (layers sharing one "
                        "indexer's top-k: one resolve and one swap plan per group)")
    p.add_argument("--host-pool-layout", choices=("packed", "per-layer"), default="packed",
                   help="the host pool's arrays: an index group's layers side by side in one "
                        "(packed, the engine's default) or one per layer")
    p.add_argument("--no-position-map", action="store_true",
                   help="hot states without the position map: resolve searches the hot region "
                        "(the search rule)")
    add_copy_flags(p)
    p.add_argument("--kv-format", type=_formats, default=[kvf.BF16],
                   help=f"KV row formats to run, comma-separated, of {', '.join(kvf.KV_FORMATS)} "
                        "(fp8_ds_mla needs 512 + 64 rows: dsv32-2l, tiny576)")
    p.add_argument("--attention-backend", type=_attention_backends,
                   default=[(None, None)], metavar="[FORMAT:]BACKEND,...",
                   help="EngineConfig.tuning.attention, comma-separated: BACKEND (every "
                        "--kv-format) or FORMAT:BACKEND (that format only), of default (the "
                        "registry's choice; the flag's default), "
                        + ", ".join(registered_backends("sparse_mla_decode"))
                        + "; every group runs once per (kv format, backend) pair, e.g. "
                        "--kv-format bf16,fp8_ds_mla --attention-backend "
                        "triton,fp8_ds_mla:mosaic_gpu")
    p.add_argument("--block-size", type=int, default=64, help="KV rows per block (page)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="EngineConfig.async_scheduling: plan and dispatch step t + 1 while "
                        "step t runs on the device")
    p.add_argument("--speculative-tokens", type=int, default=0, metavar="K",
                   help="EngineConfig.speculative.num_tokens: K draft tokens verified per "
                        "request and step, drafted by AcceptanceRateDraft (the random model's "
                        "MTP drafts would almost never be accepted; bench/speculative.py "
                        "sweeps K and rates); works with --async-scheduling")
    p.add_argument("--acceptance-rate", type=float, default=None, metavar="R",
                   help="with --speculative-tokens: each draft accepted with probability R "
                        "(default 0.8)")
    p.add_argument("--hot-size", type=int, default=None,
                   help="hot-region rows per request (default: 2 * top_k)")
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="GPU KV budget, blocks per layer (default: sized for max concurrency)")
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="untimed engine steps after the ramp to the steady state")
    p.add_argument("--measure-steps", type=int, default=48,
                   help="timed engine steps per run (split over --rounds)")
    p.add_argument("--rounds", type=int, default=4,
                   help="HiSparse and all-resident alternate in this many measured blocks")
    p.add_argument("--max-ramp-steps", type=int, default=2000,
                   help="a run that has not reached its steady state after this many steps "
                        "is skipped")
    p.add_argument("--time-budget", type=float, default=float("inf"),
                   help="seconds, shared equally by the (kv format, attention backend) "
                        "pairs; runs that would start later are skipped")
    p.add_argument("--output", default=None,
                   help="JSON path (default: bench/results/e2e_decode-<backend>.json)")
    p.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    p.add_argument("--no-plot", action="store_true", help="write no plot")
    p.add_argument("--plot-only", default=None, help="draw the plot of an existing JSON and exit")
    p.add_argument("--sweep-from", default=None,
                   help="with --plot-only: take the turnover panel from this JSON")
    args = p.parse_args(argv)

    if args.plot_only:
        src = Path(args.plot_only)
        plot(src, Path(args.plot or src.with_suffix(".png")), args.sweep_from)
        return 0
    t_start = time.perf_counter()
    if args.context < 1 or args.gen_budget < 1:
        raise SystemExit("--context and --gen-budget must be positive")
    if args.indexer and args.trace:
        raise SystemExit("--indexer and --trace exclude each other (one top-k source)")
    if args.num_layers is not None and args.num_layers < 1:
        raise SystemExit(f"--num-layers must be >= 1, got {args.num_layers}")
    if args.index_group_size is not None and args.index_group_size < 1:
        raise SystemExit(f"--index-group-size must be >= 1, got {args.index_group_size}")
    k = args.speculative_tokens
    if not 0 <= k < args.block_size:
        raise SystemExit(f"--speculative-tokens must be in [0, --block-size {args.block_size}) "
                         f"(a step's draft rows open at most one page), got {k}")
    if args.acceptance_rate is not None and not k:
        raise SystemExit("--acceptance-rate needs --speculative-tokens >= 1")
    rate = 0.8 if args.acceptance_rate is None else args.acceptance_rate
    if not 0.0 <= rate <= 1.0:
        raise SystemExit(f"--acceptance-rate must be in [0, 1], got {rate}")
    if args.indexer:
        args.turnover_sweep = []  # turnover is the drift model's knob
    variants = variants_of(args.kv_format, args.attention_backend)
    try:
        model = bench_models.build(args.config, num_layers=args.num_layers,
                                   index_group_size=args.index_group_size)
    except ValueError as e:
        raise SystemExit(f"--config / --num-layers / --index-group-size: {e}") from None
    spec = model.spec
    if args.hot_size is not None and k and args.hot_size < (1 + k) * spec.top_k:
        raise SystemExit(f"--hot-size {args.hot_size} must be >= (1 + --speculative-tokens "
                         f"{k}) x top_k {spec.top_k} (one step's union of selected rows)")
    sizes = plan_sizes(args, spec)
    speculation = ({"speculative": Speculative(num_tokens=k, draft=AcceptanceRateDraft(rate))}
                   if k else None)
    counter = CompileCounter()
    name = "e2e_decode"
    formats = args.kv_format
    for kv_format in formats:
        if kv_format == kvf.FP8_DS_MLA and (spec.kv_lora_rank, spec.rope_dim) != (
                kvf.LATENT_DIM, kvf.ROPE_DIM):
            raise SystemExit(f"--kv-format {kv_format} needs 512 + 64 rows; --config "
                             f"{spec.name} has {spec.kv_lora_rank} + {spec.rope_dim}")
    check_variants(model, args, sizes, variants, extra=speculation)
    labels = [f"{f}:{backend_label(b)}" for f, b in variants]
    backends = list(dict.fromkeys(backend_label(b) for _, b in variants))
    suffix = (("" if formats == [kvf.BF16] else "-" + "+".join(formats))
              + ("" if backends == [DEFAULT_BACKEND] else "-" + "+".join(backends)))
    out_json = (Path(args.output) if args.output
                else RESULTS_DIR / f"{name}-{jax.default_backend()}{suffix}.json")
    config = {"model": spec.name, "context": args.context, "gen_budget": args.gen_budget,
              "block_size": args.block_size, "top_k": spec.top_k,
              "hot_size": args.hot_size or 2 * spec.top_k, "turnover": args.turnover,
              "num_layers": spec.num_layers, "group_layers": list(spec.group_layers),
              "host_pool_layout": args.host_pool_layout,
              "position_map": not args.no_position_map, "copy_programs": args.copy_programs,
              "copy_with_attention": args.copy_with_attention,
              "topk_source": ("the model's indexer over synthetic unit-normal index keys"
                              if args.indexer else f"trace {args.trace}" if args.trace
                              else "drift model"),
              "prefill": "synthetic (random KV rows written straight into the caches)",
              "warmup_steps": args.warmup_steps, "measure_steps": args.measure_steps,
              "rounds": args.rounds, "turnover_sweep_at": _groups(args)[-1][0],
              "kv_formats": formats, "attention_backends": backends, "variants": labels,
              "async_scheduling": args.async_scheduling,
              "speculative_tokens": k, "acceptance_rate": rate if k else None, **sizes}
    results: list[dict[str, Any]] = []
    print(f"[e2e] {spec.name} on {jax.devices()[0].device_kind}: {json.dumps(sizes)}", flush=True)
    # One pinned pool per row format for every host-tier engine (they run one at a time):
    # pinning and unpinning tens of GiB per run would cost more than the runs, and a pool
    # freed while the next engine runs stalls it.
    for kv_format in formats:
        pool = None
        if any(m != "all-resident" for m in args.modes):
            pool = HostPool(num_layers=spec.num_layers, block_size=args.block_size,
                            row_width=kvf.storage_width(kv_format, spec.row_width),
                            dtype=kvf.storage_dtype(kv_format, spec.kv_dtype),
                            num_blocks=1 + (max(args.concurrency) + 1)
                            * sizes["pages_per_request"],
                            layers_per_array=(spec.group_layers[0]
                                              if args.host_pool_layout == "packed"
                                              and len(set(spec.group_layers)) == 1 else 1))
            config.setdefault("host_pool_gib_by_kv_format", {})[kv_format] = pool.nbytes / 2**30
            if kv_format == formats[0]:
                config["host_pool_gib"] = pool.nbytes / 2**30
        try:
            for attention in [b for f, b in variants if f == kv_format]:
                # Each pair gets an equal share of --time-budget (what one leaves, the next
                # gets).
                j = variants.index((kv_format, attention))
                deadline = t_start + args.time_budget * (j + 1) / len(variants)
                for c, tv, modes in _groups(args):
                    if time.perf_counter() > deadline:
                        results += [{"mode": m, "concurrency": c, "turnover": tv,
                                     "kv_format": kv_format,
                                     "attention_backend": backend_label(attention),
                                     "skipped": "time budget"} for m in modes]
                    else:
                        for r in run_group(model, args, sizes, modes=modes, concurrency=c,
                                           turnover=tv, pool=pool, counter=counter,
                                           kv_format=kv_format, attention=attention,
                                           extra=speculation):
                            results.append(r)
                            _print(r)
                    write_result(name, {"config": config, "results": results,
                                        "ratios": summarise(results, args.turnover, formats,
                                                            labels)}, out_json)
        finally:
            if pool is not None:
                pool.close()
    print(json.dumps(summarise(results, args.turnover, formats, labels), indent=1))
    if not args.no_plot:
        try:
            plot(out_json, Path(args.plot or out_json.with_suffix(".png")))
        except ImportError:
            print("[e2e] matplotlib is not installed: no plot (pip install matplotlib)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
