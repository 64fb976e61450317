"""Host time of one engine decode step at high concurrency (CPU, no model).

The host work between two model steps is on the critical path: the device waits for it.
This benchmark runs every part of an engine step that needs no model, on a `Coordinator`
sized like the e2e setting (C requests of `--context` tokens, block 64, ~20K device blocks,
hot regions of 64 blocks; the device pool is short, so requests move to hot regions and
unpin their pages), with a transfer worker that completes every copy at the next poll:

  * `Scheduler.schedule` (worker reports, scheduling every running request, admission,
    `Coordinator.build_plan`, the residency choice);
  * the runner's decode inputs (`hisparse_jax.engine.runner.fill_decode_inputs`);
  * the collection of the sampled tokens (`hisparse_jax.engine.step.record_decode`:
    `Scheduler.collected` / `record` per request), with token 5 sampled by every request.

Timed apart, after each step (not in the step's figures): the asynchronous engine's
`Coordinator.set_token_ids` call (the real id of every running request's last token, the
update list built as `Engine._land` builds it), reported as `set_token_ids`.

Two simulations run the same workload side by side, measured in alternating blocks of steps:
"batched" (the engine's path: one `Coordinator.schedule_batch` call for the running
requests) and "per_request" (the baseline: one `Coordinator.schedule` call per request).
Both start measuring once every request runs and the prompts' write-back backlog is spilled.

    python3 -m bench.host_step                        # C = 256, 64K tokens, 200 steps
    python3 -m bench.host_step --profile              # plus cProfile of the batched steps

Results: `bench/results/host_step-cpu.json` (ms per step, p50 and mean, per mode).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import write_result
from hisparse_jax.cache import HiSparse
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine.metrics import Metrics
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.runner import DecodeResult, fill_decode_inputs
from hisparse_jax.engine.scheduler import Scheduler
from hisparse_jax.engine.step import record_decode
from host_tier import Coordinator
from host_tier.plan import StepPlan, TransferReport

BLOCK_SIZE = 64
NUM_GPU_BLOCKS = 20012  # the e2e budget at C = 256: ~8% of the requests' pages
HOT_PAGES = 64
MAX_NEW_TOKENS = 1024
TOKEN = 5  # every sampled token (never a stop token)
BLOCK_STEPS = 20  # steps per measured block; the modes alternate


class InstantTransfers:
    """A transfer worker whose copies are all enqueued and completed at the next poll."""

    num_in_flight = 0

    def __init__(self) -> None:
        self.pending: list[int] = []

    def take(self, plan: StepPlan) -> None:
        self.pending += [s.transfer_id for s in plan.spills]
        self.pending += [r.transfer_id for r in plan.restores]

    def poll(self, wait: bool = False) -> TransferReport | None:
        del wait  # everything completes at once
        ids, self.pending = self.pending, []
        return TransferReport(enqueued=tuple(ids), completed=tuple(ids)) if ids else None


class PerRequest:
    """The coordinator, scheduled with one `schedule` call per request (the baseline)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coordinator, name)

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._coordinator

    def schedule_batch(self, request_ids: Sequence[Hashable],
                       new_token_ids: Sequence[Sequence[int]],
                       num_lookahead_tokens: Sequence[int] | None = None) -> list[Any]:
        lookahead = num_lookahead_tokens or [0] * len(request_ids)
        return [self._coordinator.schedule(rid, new_token_ids=tokens, num_lookahead_tokens=la)
                for rid, tokens, la in zip(request_ids, new_token_ids, lookahead, strict=True)]


class Simulation:
    """One engine's host side: coordinator, scheduler and the decode step's host parts."""

    def __init__(self, concurrency: int, context: int, *, per_request: bool) -> None:
        max_model_len = context + MAX_NEW_TOKENS
        pages = -(-max_model_len // BLOCK_SIZE)
        self.cfg = HiSparseConfig(
            top_k=2048, hot_size=HOT_PAGES * BLOCK_SIZE, block_size=BLOCK_SIZE,
            max_num_reqs=concurrency, row_width=576, kv_dtype="bfloat16",
            max_model_len=max_model_len, num_gpu_blocks=NUM_GPU_BLOCKS,
            num_host_blocks=1 + (concurrency + 1) * pages)
        self.coordinator = Coordinator.from_config(self.cfg, enable_prefix_caching=False)
        manager = PerRequest(self.coordinator) if per_request else self.coordinator
        self.transfers = InstantTransfers()
        self.scheduler = Scheduler(manager, self.transfers, self.cfg, HiSparse(), Metrics())
        prompt = (1,) * context
        for i in range(concurrency):
            self.scheduler.submit(Request(i, prompt, MAX_NEW_TOKENS, i))
        S = concurrency
        self.result = DecodeResult(tokens=np.full((S, 1), TOKEN, np.int32),
                                   counts=np.ones(S, np.int32), hits=0, misses=0,
                                   attention=None, seconds=0.0)
        self.steps = 0
        self.set_token_samples: list[float] = []  # seconds per `set_token_ids` call

    def step(self) -> None:
        sch = self.scheduler
        scheduled = sch.schedule()
        if scheduled is None:
            return
        self.steps += 1
        self.transfers.take(scheduled.plan)
        if scheduled.decode:
            S = self.cfg.max_num_reqs
            fill_decode_inputs(scheduled.decode, (
                np.zeros(S, np.int32), np.full(S, -1, np.int32), np.full(S, -1, np.int32),
                np.zeros(S, np.float32), np.zeros(S, np.int32), np.zeros(S, np.int32)))
        for req in scheduled.admitted:  # prefill "ran"
            sch.start(req)
            sch.record(req, TOKEN)
        record_decode(sch, sch.metrics, scheduled.decode, self.result)

    def ramp(self) -> int:
        """Steps until every request runs and the prompts' write-back backlog is spilled."""
        sch, coord = self.scheduler, self.coordinator
        while (len(sch.running) < self.cfg.max_num_reqs or sch.waiting
               or coord.num_dirty_sealed_pages > self.cfg.max_num_reqs):
            self.step()
        return self.steps

    def set_token_ids(self) -> None:
        """The asynchronous engine's update of every running request's last token the
        coordinator counted (the ids it already has: nothing changes)."""
        self.coordinator.set_token_ids(
            [(req.request_id, len(req.prompt) + i, req.generated[i])
             for req in self.scheduler.running.values() if req.counted
             for i in (req.counted - 1,)])

    def timed_steps(self, n: int) -> list[float]:
        """Runs n steps and returns their times; times a `set_token_ids` after each (kept in
        `set_token_samples`)."""
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.step()
            t1 = time.perf_counter()
            self.set_token_ids()
            self.set_token_samples.append(time.perf_counter() - t1)
            out.append(t1 - t0)
        return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--context", type=int, default=65536, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=200, help="measured steps per mode")
    p.add_argument("--warmup-steps", type=int, default=50, help="steps after the ramp")
    p.add_argument("--profile", action="store_true",
                   help="print a cProfile (tottime) of the batched mode's steps")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    for name in ("concurrency", "context", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")

    sims = {mode: Simulation(args.concurrency, args.context, per_request=mode == "per_request")
            for mode in ("per_request", "batched")}
    ramps = {}
    for mode, sim in sims.items():
        ramps[mode] = sim.ramp()
        sim.timed_steps(args.warmup_steps)
    samples: dict[str, list[float]] = {mode: [] for mode in sims}
    for sim in sims.values():
        sim.set_token_samples.clear()  # the ramp's and warmup's
    while len(samples["batched"]) < args.steps:
        n = min(BLOCK_STEPS, args.steps - len(samples["batched"]))
        for mode, sim in sims.items():
            samples[mode] += sim.timed_steps(n)
    for mode, sim in sims.items():
        running = len(sim.scheduler.running)
        assert running == args.concurrency, (
            f"{mode}: only {running} requests still run (they generate at most "
            f"{MAX_NEW_TOKENS} tokens); measure fewer --steps")
    a, b = sims["per_request"].coordinator, sims["batched"].coordinator
    assert a.stats == b.stats, "the two modes diverged"

    figures = {}
    for mode, xs in samples.items():
        figures[mode] = {"p50_ms": 1e3 * statistics.median(xs),
                         "mean_ms": 1e3 * statistics.fmean(xs),
                         "p95_ms": 1e3 * float(np.percentile(xs, 95)), "steps": len(xs),
                         "ramp_steps": ramps[mode]}
        print(f"{mode}: per step p50 {figures[mode]['p50_ms']:.3f} ms, mean "
              f"{figures[mode]['mean_ms']:.3f} ms, p95 {figures[mode]['p95_ms']:.3f} ms "
              f"({len(xs)} steps after a ramp of {ramps[mode]})", flush=True)
    ratio = figures["per_request"]["p50_ms"] / figures["batched"]["p50_ms"]
    print(f"per_request / batched (p50): {ratio:.2f}x")
    xs = sims["batched"].set_token_samples
    set_tokens = {"p50_ms": 1e3 * statistics.median(xs), "mean_ms": 1e3 * statistics.fmean(xs),
                  "p95_ms": 1e3 * float(np.percentile(xs, 95)), "calls": len(xs)}
    print(f"set_token_ids (batched, apart from the step): p50 {set_tokens['p50_ms']:.3f} ms, "
          f"mean {set_tokens['mean_ms']:.3f} ms, p95 {set_tokens['p95_ms']:.3f} ms")

    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        sims["batched"].timed_steps(min(args.steps, 100))
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)

    payload = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "setting": {"block_size": BLOCK_SIZE, "num_gpu_blocks": NUM_GPU_BLOCKS,
                    "hot_pages": HOT_PAGES, "hot_grants": b.stats["hot_grants"],
                    "unpinned_pages": b.stats["unpinned_pages"],
                    "lost_pages": b.stats["lost_pages"]},
        "modes": figures,
        "set_token_ids": set_tokens,
        "figure": {"name": "host ms per decode step (p50), batched",
                   "value": figures["batched"]["p50_ms"],
                   "baseline": "per_request (one Coordinator.schedule call per request), "
                               "same run",
                   "baseline_value": figures["per_request"]["p50_ms"],
                   "ratio": figures["batched"]["p50_ms"] / figures["per_request"]["p50_ms"]},
        "note": "CPU only, no model: Scheduler.schedule + fill_decode_inputs + record_decode "
                "per step; copies complete at the next poll; set_token_ids (the async "
                "engine's per-step update of every running request's last token) timed apart",
    }
    path = write_result("host_step", payload, args.output)
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
