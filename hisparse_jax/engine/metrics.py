"""`Metrics` (the counters of an engine run) and the summary figures derived from them."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any


@dataclasses.dataclass
class Metrics:
    """Counters of an engine run (see `summarise` for the derived figures)."""

    steps: int = 0
    decode_steps: int = 0
    fast_steps: int = 0
    prefills: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    hot_hits: int = 0
    hot_misses: int = 0
    rows_moved: int = 0
    bytes_moved: int = 0
    decode_seconds: float = 0.0  # first call of each jitted variant excluded (compile)
    prefill_seconds: float = 0.0
    compile_seconds: float = 0.0  # first calls (trace + compile + run)
    wall_seconds: float = 0.0
    rows_moved_per_step: list[int] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    waits: int = 0

    def record_decode(self, *, fast: bool, hits: int, misses: int, index_group_size: int,
                      row_bytes: int) -> None:
        """One decode step: `hits` / `misses` hot-region lookups summed over its index groups
        (each miss is copied into every layer of its group)."""
        self.decode_steps += 1
        self.fast_steps += int(fast)
        self.hot_hits += hits
        self.hot_misses += misses
        rows = misses * index_group_size
        self.rows_moved += rows
        self.bytes_moved += rows * row_bytes
        self.rows_moved_per_step.append(rows)


class StepClock:
    """Splits call times into compile time (the first call of each jitted variant: trace,
    compile and run) and steady-state time, and counts the steady-state decode tokens."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.compiled: set[Hashable] = set()
        self.decode_tokens = 0  # tokens of steady-state (timed) decode steps

    def account(self, variant: Hashable, seconds: float, field: str) -> bool:
        """Adds a call's time to `metrics.<field>`, or to compile_seconds for a variant's
        first call; True when the time was counted as steady-state."""
        if variant in self.compiled:
            setattr(self.metrics, field, getattr(self.metrics, field) + seconds)
            return True
        self.compiled.add(variant)
        self.metrics.compile_seconds += seconds
        return False

    @property
    def timed_decode_steps(self) -> int:
        """Decode steps whose time counted (decode variants are named by str, prefills by
        tuples)."""
        return self.metrics.decode_steps - len([v for v in self.compiled if isinstance(v, str)])


def summarise(m: Metrics, clock: StepClock, *, mode: str, requests_finished: int,
              stats: Mapping[str, int], device_bytes: int, device_allocator_bytes: int | None,
              host_bytes: int, gpu_blocks: int) -> dict[str, Any]:
    """The summary figures of a run (`Engine.summary`). `stats`: the residency manager's
    counters (spills, unpinned_pages, lost_pages, hot_grants; absent ones count 0)."""
    lookups = m.hot_hits + m.hot_misses
    steps = max(m.decode_steps, 1)
    timed_steps = clock.timed_decode_steps
    return {
        "mode": mode,
        "requests_finished": requests_finished,
        "prompt_tokens": m.prompt_tokens,
        "generated_tokens": m.generated_tokens,
        "decode_steps": m.decode_steps,
        "fast_path_steps": m.fast_steps,
        "decode_tokens_per_s": clock.decode_tokens / m.decode_seconds
        if m.decode_seconds else 0.0,
        "decode_step_ms": 1e3 * m.decode_seconds / timed_steps if timed_steps else 0.0,
        "compile_seconds": m.compile_seconds,
        "tokens_per_s": m.generated_tokens / m.wall_seconds if m.wall_seconds else 0.0,
        "hot_lookups": lookups,
        "hot_hit_rate": m.hot_hits / lookups if lookups else float("nan"),
        "rows_moved_h2d": m.rows_moved,
        "bytes_moved_h2d": m.bytes_moved,
        "rows_moved_per_step": m.rows_moved / steps,
        "bytes_moved_per_step": m.bytes_moved / steps,
        "spilled_pages": stats.get("spills", 0),
        "unpinned_pages": stats.get("unpinned_pages", 0),
        "lost_pages": stats.get("lost_pages", 0),
        "hot_grants": stats.get("hot_grants", 0),
        "preemptions": m.preemptions,
        "waits": m.waits,
        "device_bytes": device_bytes,
        "device_allocator_bytes": device_allocator_bytes,
        "host_bytes": host_bytes,
        "gpu_blocks": gpu_blocks,
    }
