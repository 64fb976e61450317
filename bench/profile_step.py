"""Where the time of one engine step goes: host phases and device kernels (issue 15).

Builds the end-to-end benchmark's engine (`bench/e2e_decode.py`: same model, budget, synthetic
prompts, drift top-k) for one mode and concurrency, steps it to its steady state (the same
`ramp`: every seat busy, the prompts' write-back drained), then

  1. times `--steps` whole steps with the host phases of `Engine._step` timed separately
     (schedule, tables, restores, dispatch, spills, reports, waiting for the device, the
     per-request bookkeeping after it): wall time only, no profiler running; each step's
     record (phases, garbage-collection time, drains, rows read from host) is kept, and the
     steps slower than 1.5x the median are listed with the phases that grew (`tail`);
  2. traces `--profile-steps` more steps with the jax profiler and sums the device's kernel
     and copy time per step by category (attention, resolve, host->device gather, GEMMs,
     memcpy, other XLA fusions), the device's busy time (the union of every stream's
     intervals) and its idle time within the traced steps;
  3. with `--floors`, times the attention and the host gather alone at the step's shapes
     (the gather from the engine's own pool: its span sets the rate), and sets each device
     part's floor to the lower of its in-step and alone time: the step's p50 over their sum
     is the issue-15 figure "step p50 / device floors".

The result (JSON, and a Markdown table of both parts) goes to
`bench/results/profile_step-<backend>-<mode>-c<C>.json`; the raw trace stays under `--trace-dir`
(not committed: tens of MB).

    python3 -m bench.profile_step --mode hisparse --concurrency 256          # GPU
    python3 -m bench.profile_step --config tiny --context 2048 --block-size 16 \\
        --concurrency 4 --steps 4 --profile-steps 2                          # CPU smoke run
"""

from __future__ import annotations

import argparse
import collections
import gc
import gzip
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "96")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import _models as bench_models  # noqa: E402
from bench import e2e_decode as e2e  # noqa: E402
from bench._common import RESULTS_DIR, HelpFormatter, write_result  # noqa: E402
from hisparse_jax import models  # noqa: E402
from hisparse_jax.topk_sources import DriftTopK  # noqa: E402
from host_tier import HostPool  # noqa: E402
from pallas_kernels import kv_format as kvf  # noqa: E402

# Host phases of one step, in the order `Engine._step` runs them: (object, method, label).
PHASES = (
    ("scheduler", "schedule", "schedule (coordinator, admission, plan)"),
    ("runner", "apply_plan_state", "tables and hot-slot updates to the device"),
    ("runner", "restore", "restores handed to the worker"),
    ("runner", "dispatch_decode", "decode inputs + jitted dispatch"),
    ("runner", "after_forward", "spills handed to the worker"),
    ("scheduler", "deliver", "worker reports to the coordinator"),
    ("runner", "wait", "waiting for the device (tokens ready)"),
    ("runner", "collect_decode", "tokens to the host"),
)

# Device event categories: the first pattern that matches the lower-cased event name.
CATEGORIES = (
    ("attention (sparse MLA)", r"sparse_mla|mla_decode|_attend|flash"),
    ("resolve residency", r"resolve"),
    ("host -> device gather", r"gather_compact|gather"),
    ("hot-slot invalidate / mirror", r"invalidate|mirror"),
    ("memcpy host -> device", r"memcpy.*(h2d|htod)|(h2d|htod).*memcpy"),
    ("memcpy device -> host", r"memcpy.*(d2h|dtoh)|(d2h|dtoh).*memcpy"),
    ("memcpy / memset other", r"memcpy|memset"),
    ("GEMM", r"gemm|cublas|nvjet|cutlass|xmma|sm\d+_|dot|matmul"),
    ("indexer / top-k", r"top_?k|sort|indexer"),
)


def categorise(name: str) -> str:
    low = name.lower()
    for label, pattern in CATEGORIES:
        if re.search(pattern, low):
            return label
    return "other XLA fusions"


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by [start, end) intervals (overlaps counted once)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


def device_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Complete events ("ph": "X") on the GPU's stream lines of a Chrome/Perfetto trace
    (the derived "XLA Ops" / "XLA Modules" lines repeat the same work and are left out)."""
    events, pnames, tnames = _lines(trace)
    gpu = {pid for pid, name in pnames.items() if "gpu" in name.lower()}
    out = []
    for ev in events:
        if ev.get("ph") != "X" or ev.get("pid") not in gpu:
            continue
        line = tnames.get((ev["pid"], ev.get("tid")), "")
        if re.search(r"xla (ops|modules)|steps|launch stats|source", line.lower()):
            continue
        out.append(ev)
    return out


def _lines(trace: dict[str, Any] | list[Any]
           ) -> tuple[list[dict[str, Any]], dict[Any, str], dict[tuple[Any, Any], str]]:
    """A trace's events, its process names by pid and its thread names by (pid, tid)."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    pnames, tnames = {}, {}
    for ev in events:
        if ev.get("ph") == "M" and ev.get("name") == "process_name":
            pnames[ev["pid"]] = str(ev.get("args", {}).get("name", ""))
        elif ev.get("ph") == "M" and ev.get("name") == "thread_name":
            tnames[(ev["pid"], ev.get("tid"))] = str(ev.get("args", {}).get("name", ""))
    return events, pnames, tnames


def host_summary(trace: dict[str, Any], num_steps: int, top: int = 30) -> list[dict[str, Any]]:
    """The host threads' busiest event names (runtime TraceMe events: jit dispatch, executable
    launch, transfers), per step; nested events each count their own duration."""
    events, pnames, tnames = _lines(trace)
    host = {pid for pid, name in pnames.items() if "host" in name.lower()}
    by_name: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for ev in events:
        if (ev.get("ph") == "X" and ev.get("pid") in host
                and not re.search(r"profiler\.py|contextlib\.py", ev["name"])):
            key = (tnames.get((ev["pid"], ev.get("tid")), "?"), ev["name"])
            by_name[key][0] += float(ev.get("dur", 0.0))
            by_name[key][1] += 1
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"thread": t[:60], "name": n[:160], "us_per_step": d / num_steps,
             "calls_per_step": c / num_steps} for (t, n), (d, c) in rows]


def summarise_device(events: list[dict[str, Any]], num_steps: int) -> dict[str, Any]:
    """Per-step device figures of a traced window of `num_steps` steps: busy (union over
    streams), span (first start to last end), time per category and the top kernels."""
    if not events:
        return {"events": 0}
    by_cat: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for ev in events:
        dur = float(ev.get("dur", 0.0))
        by_cat[categorise(ev["name"])] += dur
        by_name[ev["name"]][0] += dur
        by_name[ev["name"]][1] += 1
    starts = [float(ev["ts"]) for ev in events]
    ends = [float(ev["ts"]) + float(ev.get("dur", 0.0)) for ev in events]
    busy = union_length(zip(starts, ends, strict=True))
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:25]
    return {
        "events": len(events),
        "busy_us_per_step": busy / num_steps,
        "span_us_per_step": (max(ends) - min(starts)) / num_steps,
        "kernel_us_per_step_by_category": {k: v / num_steps for k, v in
                                           sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "us_per_step": t / num_steps,
                         "calls_per_step": c / num_steps, "category": categorise(n)}
                        for n, (t, c) in top],
    }


def load_trace(trace_dir: Path) -> dict[str, Any] | None:
    files = sorted(trace_dir.rglob("*.trace.json.gz")) + sorted(trace_dir.rglob("*.json.gz"))
    if not files:
        return None
    with gzip.open(files[-1], "rt") as f:
        return json.load(f)


class PhaseTimer:
    """Wraps the engine's phase methods (instance attributes, so only this engine) and sums
    their wall time per step; `wait` blocks on a dispatched step's tokens before the host
    copies them."""

    def __init__(self, engine: Any) -> None:
        self.totals: dict[str, list[float]] = collections.defaultdict(list)
        self.current: dict[str, float] = collections.defaultdict(float)
        self.active = False
        self.dropped = 0
        # Per timed step: what it did besides the phases (garbage collections, drains of the
        # async pipeline, rows read from host), to explain the slow ones.
        self.per_step: list[dict[str, float]] = []
        self._gc_start: float | None = None
        gc.callbacks.append(self._on_gc)
        owners = {"scheduler": engine.scheduler, "runner": engine.runner}
        for owner, method, _ in PHASES:
            if method == "wait":
                continue
            obj = owners[owner]
            setattr(obj, method, self._wrap(method, getattr(obj, method)))
        collect = engine.runner.collect_decode

        def collect_with_wait(pending: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            jax.block_until_ready(pending.tokens)
            if self.active:
                self.current["wait"] += time.perf_counter() - t0
            return collect(pending, **kwargs)

        engine.runner.collect_decode = collect_with_wait

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if not self.active:
            return
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.current["gc"] += time.perf_counter() - self._gc_start
            self.current[f"gc{info.get('generation', 0)}"] += 1
            self._gc_start = None

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.active:
                    self.current[name] += time.perf_counter() - t0
        return timed

    def step(self, engine: Any, counter: e2e.CompileCounter) -> None:
        """Times one step; a step in which something compiled (a first bucket of some jitted
        helper: not steady state) is counted in `dropped`, not timed."""
        self.current.clear()
        compiles = counter.count
        m = engine.metrics
        drains, rows = m.drains, m.rows_moved
        self.active = counter.active = True
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        self.active = counter.active = False
        if counter.count != compiles:
            self.dropped += 1
            return
        for _, method, _ in PHASES:
            self.totals[method].append(self.current.get(method, 0.0))
        self.totals["step"].append(wall)
        self.per_step.append({
            "step_ms": 1e3 * wall,
            **{method: 1e3 * self.current.get(method, 0.0) for _, method, _ in PHASES},
            "gc_ms": 1e3 * self.current.get("gc", 0.0),
            **{f"gc_gen{g}": int(self.current.get(f"gc{g}", 0)) for g in range(3)},
            "drains": m.drains - drains, "rows_from_host": m.rows_moved - rows,
            "running": len(engine.running)})

    def tail(self, factor: float = 1.5) -> dict[str, Any]:
        """The steps slower than `factor` x the median step: for each, its wall time, what
        its phases took above their medians, its garbage-collection time and drains."""
        if not self.per_step:
            return {}
        walls = np.asarray([s["step_ms"] for s in self.per_step])
        p50 = float(np.median(walls))
        medians = {method: float(np.median([s[method] for s in self.per_step]))
                   for _, method, _ in PHASES}
        slow = []
        for i, s in enumerate(self.per_step):
            if s["step_ms"] <= factor * p50:
                continue
            excess = {method: round(s[method] - medians[method], 3) for _, method, _ in PHASES
                      if s[method] - medians[method] > 0.1}
            slow.append({"index": i, "step_ms": round(s["step_ms"], 3),
                         "phase_excess_ms": excess, "gc_ms": round(s["gc_ms"], 3),
                         "gc_gen2": s["gc_gen2"], "drains": s["drains"],
                         "rows_from_host": s["rows_from_host"]})
        gc_ms = np.asarray([s["gc_ms"] for s in self.per_step])
        return {"factor": factor, "step_ms_p95": float(np.percentile(walls, 95)),
                "step_ms_max": float(walls.max()),
                "p95_over_p50": float(np.percentile(walls, 95)) / p50,
                "gc_ms_total": float(gc_ms.sum()),
                "gc_ms_max": float(gc_ms.max()),
                "gc_gen2_collections": int(sum(s["gc_gen2"] for s in self.per_step)),
                "drains": int(sum(s["drains"] for s in self.per_step)),
                "slow_steps": slow}

    def result(self) -> dict[str, Any]:
        def ms(values: list[float]) -> dict[str, float]:
            a = 1e3 * np.asarray(values)
            return {"p50": float(np.median(a)), "mean": float(a.mean())}

        step = ms(self.totals["step"])
        phases = {label: ms(self.totals[method]) for _, method, label in PHASES}
        accounted = sum(v["mean"] for v in phases.values())
        return {"step_ms": step, "phases_ms": phases,
                "rest_of_step_ms_mean": step["mean"] - accounted,
                "timed_steps": len(self.totals["step"]),
                "steps_dropped_for_compiles": self.dropped,
                "tail": self.tail(), "per_step": self.per_step}


def isolated_floors(engine: Any, pool: HostPool | None, cfg: models.ModelSpec,
                    rows_from_host_per_step: float, *, reps: int) -> dict[str, Any]:
    """Device time of the step's two largest parts, each run alone at the step's shapes in
    this process (wall time of `reps` calls chained in one jit): sparse MLA attention over
    `len(engine.running)` query rows and a cache of the engine's size, per layer; and the
    gather of one layer's misses per step (`rows_from_host_per_step` / layers distinct
    random rows) from the engine's own pinned pool (its span sets the gather's rate)."""
    from bench import gather_pool
    from bench.ops import sparse_mla_decode as attn_bench
    from hisparse_jax.ops import sparse_mla_decode

    n, layers = len(engine.running), cfg.num_layers
    cache_rows = engine.num_gpu_blocks * engine.config.sizes.block_size
    key = jax.random.key(0)
    kq, kk, kr = jax.random.split(key, 3)
    q = jax.random.normal(kq, (reps, n, cfg.num_heads, cfg.row_width), jnp.bfloat16)
    kv = jax.random.normal(kk, (cache_rows, cfg.row_width), jnp.bfloat16)
    rows = jax.random.randint(kr, (reps, n, cfg.top_k), 0, cache_rows, jnp.int32)

    def attend(q, kv, rows):
        return sparse_mla_decode(q, kv, rows, sm_scale=cfg.sm_scale, v_width=cfg.kv_lora_rank)

    seconds, _ = attn_bench._timed(attend, q, kv, rows, iters=5)
    del q, kv, rows
    out: dict[str, Any] = {"attention_us_per_layer": 1e6 * seconds,
                           "attention_us_per_step": 1e6 * seconds * layers,
                           "attention_shape": {"N": n, "h_q": cfg.num_heads, "K": cfg.top_k,
                                               "cache_rows": cache_rows}}
    per_layer = int(round(rows_from_host_per_step / layers))
    if pool is not None and per_layer > 0:
        # One layer's misses from the first pool array (the engine's per-layer layout reads
        # each layer's pool alone; every pool array has the same span).
        fig = gather_pool._time([pool.arrays[0]], per_layer, reps, np.random.default_rng(0),
                                layers=1)
        out.update(gather_us_per_layer=fig["us_per_gather"],
                   gather_us_per_step=fig["us_per_gather"] * layers,
                   gather_rows_per_layer=per_layer, gather_GBps=fig["GBps"],
                   gather_pool_gib=fig["pool_gib"])
    return out


def floors_table(result: dict[str, Any]) -> dict[str, Any] | None:
    """The step's device floors: each part at the lower of its in-step kernel time (the
    trace) and its time run alone (`isolated_floors`) where there is one; their sum against
    the step's p50."""
    dev, iso = result.get("device") or {}, result.get("isolated") or {}
    cats = dict(dev.get("kernel_us_per_step_by_category") or {})
    if not cats:
        return None
    alone = {"attention (sparse MLA)": iso.get("attention_us_per_step"),
             "host -> device gather": iso.get("gather_us_per_step")}
    parts = {}
    for label, us in cats.items():
        other = alone.get(label)
        parts[label] = {"in_step_us": us, "alone_us": other,
                        "floor_us": min(us, other) if other is not None else us}
    total = sum(p["floor_us"] for p in parts.values())
    p50 = 1e3 * result["host"]["step_ms"]["p50"]
    return {"parts": parts, "sum_us": total, "step_p50_us": p50,
            "step_p50_over_floors": p50 / total if total else None}


def markdown(result: dict[str, Any]) -> str:
    lines = [f"### {result['mode']}, {result['concurrency']} requests "
             f"({result['machine']['device']}, jax {result['machine']['jax']})", "",
             "| host phase | ms / step (mean) | p50 |", "| --- | ---: | ---: |"]
    host = result["host"]
    for label, v in host["phases_ms"].items():
        lines.append(f"| {label} | {v['mean']:.2f} | {v['p50']:.2f} |")
    lines.append(f"| rest of the step (Python between phases) | "
                 f"{host['rest_of_step_ms_mean']:.2f} | |")
    lines.append(f"| **whole step** | **{host['step_ms']['mean']:.2f}** | "
                 f"**{host['step_ms']['p50']:.2f}** |")
    tail = host.get("tail") or {}
    if tail:
        lines.append(f"| step p95 / max | {tail['step_ms_p95']:.2f} / {tail['step_ms_max']:.2f} "
                     f"| p95/p50 {tail['p95_over_p50']:.2f} |")
        lines.append(f"| garbage collection (all steps; gen-2 runs) | "
                     f"{tail['gc_ms_total'] / max(host['timed_steps'], 1):.2f} | "
                     f"{tail['gc_gen2_collections']} |")
        labels = {method: label for _, method, label in PHASES}
        for slow in tail["slow_steps"]:
            parts = ", ".join(f"{labels[k].split(' (')[0]} +{v:.2f}"
                              for k, v in slow["phase_excess_ms"].items())
            lines.append(f"| slow step {slow['index']}: {slow['step_ms']:.2f} ms | "
                         f"{parts or '-'}; gc {slow['gc_ms']:.2f} ms, drains "
                         f"{slow['drains']} | |")
    dev = result.get("device") or {}
    if dev.get("events"):
        lines += ["", "| device | us / step |", "| --- | ---: |"]
        for label, us in dev["kernel_us_per_step_by_category"].items():
            lines.append(f"| {label} | {us:.0f} |")
        lines.append(f"| **busy (union of streams)** | **{dev['busy_us_per_step']:.0f}** |")
        lines.append(f"| traced step wall time | {1e3 * result['traced_step_ms_mean']:.0f} |")
        idle = 1e3 * result["traced_step_ms_mean"] - dev["busy_us_per_step"]
        lines.append(f"| device idle | {idle:.0f} |")
    floors = result.get("floors")
    if floors:
        lines += ["", "| part | in the step (us) | alone (us) | floor (us) |",
                  "| --- | ---: | ---: | ---: |"]
        for label, part in floors["parts"].items():
            alone = f"{part['alone_us']:.0f}" if part["alone_us"] is not None else "-"
            lines.append(f"| {label} | {part['in_step_us']:.0f} | {alone} | "
                         f"{part['floor_us']:.0f} |")
        lines.append(f"| **sum of floors** | | | **{floors['sum_us']:.0f}** |")
        lines.append(f"| step p50 / sum of floors | | | "
                     f"**{floors['step_p50_over_floors']:.2f}x** |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--config", default="dsv32-2l", choices=bench_models.NAMES,
                   help="a synthetic config or a real architecture's slice (bench/_models.py)")
    p.add_argument("--num-layers", type=int, default=None,
                   help="layers of the model (default: the config's)")
    p.add_argument("--kv-format", default=kvf.BF16, choices=(kvf.BF16, kvf.FP8_DS_MLA),
                   help="KV row format (docs/kv_format.md)")
    p.add_argument("--indexer", action="store_true",
                   help="the model's own indexer over synthetic unit-normal index keys picks "
                        "the top-k (default: the drift model, --turnover)")
    p.add_argument("--mode", default="hisparse", choices=e2e.MODES)
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--budget-concurrency", type=int, default=None,
                   help="size the GPU KV budget as the e2e benchmark does for this many "
                        "requests (default: --concurrency)")
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--gen-budget", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--async-scheduling", action="store_true",
                   help="EngineConfig.async_scheduling (step t + 1 dispatched before step t "
                        "is collected)")
    p.add_argument("--hot-size", type=int, default=None)
    p.add_argument("--no-position-map", action="store_true",
                   help="hot states without the position map (resolve searches the hot region)")
    e2e.add_copy_flags(p)
    p.add_argument("--gpu-blocks", type=int, default=None)
    p.add_argument("--turnover", type=float, default=0.05)
    p.add_argument("--warmup-steps", type=int, default=8)
    p.add_argument("--max-ramp-steps", type=int, default=2000)
    p.add_argument("--steps", type=int, default=32, help="host-phase timed steps")
    p.add_argument("--profile-steps", type=int, default=6, help="steps under the profiler")
    p.add_argument("--trace-dir", default=None, help="default: a temporary directory")
    p.add_argument("--floors", action="store_true",
                   help="also time the attention and the host gather alone at the step's "
                        "shapes (needs --profile-steps for the other parts)")
    p.add_argument("--floor-reps", type=int, default=8,
                   help="calls chained in one jit per isolated timing")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    for name in ("concurrency", "context", "gen_budget", "steps"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be positive")
    if args.profile_steps < 0:
        raise SystemExit("--profile-steps must be >= 0")

    try:
        model = bench_models.build(args.config, num_layers=args.num_layers)
    except ValueError as e:
        raise SystemExit(f"--config / --num-layers: {e}") from None
    cfg = model.spec
    sizing = argparse.Namespace(**vars(args))
    sizing.concurrency = [args.budget_concurrency or args.concurrency]
    sizes = e2e.plan_sizes(sizing, cfg)
    pool = None
    if args.mode != "all-resident":
        pool = HostPool(num_layers=cfg.num_layers, block_size=args.block_size,
                        row_width=kvf.storage_width(args.kv_format, cfg.row_width),
                        dtype=kvf.storage_dtype(args.kv_format, cfg.kv_dtype),
                        num_blocks=1 + (args.concurrency + 1) * sizes["pages_per_request"])
    engine = e2e.make_engine(model, sizing, sizes, mode=args.mode,
                             concurrency=args.concurrency,
                             source=(None if args.indexer
                                     else DriftTopK(turnover=args.turnover, seed=1)),
                             pool=pool, kv_format=args.kv_format)
    timer = None
    try:
        ramp = e2e.ramp(engine, args)
        timer, counter = PhaseTimer(engine), e2e.CompileCounter()
        while len(timer.totals["step"]) < args.steps and timer.dropped < args.steps:
            timer.step(engine, counter)
        traced: list[float] = []
        device: dict[str, Any] = {}
        if args.profile_steps:
            trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="hisparse-trace-"))
            jax.block_until_ready(engine.runner.cache)
            try:
                with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
                    for _ in range(args.profile_steps):
                        t0 = time.perf_counter()
                        engine.step()
                        traced.append(time.perf_counter() - t0)
                    jax.block_until_ready(engine.runner.cache)
            except Exception as e:  # noqa: BLE001 - keep the host part of the record
                device = {"events": 0, "note": f"profiler failed: {type(e).__name__}: {e}"}
            else:
                trace = load_trace(trace_dir)
                device = (summarise_device(device_events(trace), args.profile_steps)
                          if trace is not None else {"events": 0, "note": "no trace file"})
                if trace is not None:
                    device["host_events"] = host_summary(trace, args.profile_steps)
            device["trace_dir"] = str(trace_dir)
        host = timer.result()
        isolated = None
        if args.floors:
            steps = max(host["timed_steps"], 1)
            rows = sum(st["rows_from_host"] for st in timer.per_step) / steps
            isolated = isolated_floors(engine, pool, cfg, rows, reps=args.floor_reps)
        result = {
            "benchmark": "profile_step", "mode": args.mode, "concurrency": args.concurrency,
            "running": len(engine.running), "seats": engine.config.sizes.max_seats,
            "config": {"model": cfg.name, "context": args.context, "block_size": args.block_size,
                       "turnover": None if args.indexer else args.turnover,
                       "topk_source": "indexer" if args.indexer else "drift model",
                       "kv_format": args.kv_format,
                       "num_layers": cfg.num_layers, "prefill": "synthetic",
                       "async_scheduling": args.async_scheduling,
                       "position_map": not args.no_position_map,
                       "copy_programs": args.copy_programs,
                       "copy_with_attention": engine.config.tuning.copy_with_attention, **sizes},
            "ramp": ramp, "host": host,
            "traced_step_ms_mean": float(np.mean(traced)) * 1e3 if traced else None,
            "device": device, "isolated": isolated,
        }
        result["floors"] = floors_table(result)
    finally:
        if timer is not None:
            timer.close()
        engine.close()
        if pool is not None:
            pool.close()
    out = Path(args.output) if args.output else (
        RESULTS_DIR / f"profile_step-{jax.default_backend()}-{args.mode}-c{args.concurrency}.json")
    path = write_result("profile_step", result, out)
    result["machine"] = json.loads(path.read_text()).get("machine", {})
    table = markdown(result)
    path.with_suffix(".md").write_text(table)
    print(table)
    for row in result["device"].get("host_events", [])[:20]:
        print(f"host {row['us_per_step']:9.0f} us/step {row['calls_per_step']:6.1f} calls  "
              f"[{row['thread'][:20]}] {row['name'][:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
