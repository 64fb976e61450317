"""`Metrics` (the counters of an engine run) and the summary figures derived from them.

Step times exclude compilation: the first call of each jitted step variant, and any step
during which this process compiled something (a bucketed helper's new size: a spill row
list, a table update, a hot-state update), count in `compile_seconds` instead
(`CompileWatch` counts XLA compilations through `jax.monitoring`). `Engine.warmup` compiles
everything ahead (`warmup_seconds`), so that no served step compiles.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

import jax

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileWatch:
    """XLA compilations of this process, counted through `jax.monitoring` (one listener,
    registered by the first `start()`): `count` and `seconds` only grow."""

    count = 0
    seconds = 0.0
    _lock = threading.Lock()
    _started = False

    @classmethod
    def start(cls) -> None:
        with cls._lock:
            if not cls._started:
                jax.monitoring.register_event_duration_secs_listener(cls._on_event)
                cls._started = True

    @classmethod
    def _on_event(cls, event: str, duration: float, **_: Any) -> None:
        if event == _BACKEND_COMPILE_EVENT:
            with cls._lock:
                cls.count += 1
                cls.seconds += duration


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
    rows_moved: int = 0  # host -> device rows, a miss of index group g counted n_g times
    bytes_moved: int = 0
    decode_seconds: float = 0.0  # steps that compiled excluded (see the module docstring)
    prefill_seconds: float = 0.0
    compile_seconds: float = 0.0  # first calls and calls that compiled (trace + compile + run)
    warmup_seconds: float = 0.0  # Engine.warmup
    wall_seconds: float = 0.0
    rows_moved_per_step: list[int] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    replayed_tokens: int = 0  # tokens fed back after preemptions (not in generated_tokens)
    replay_mismatches: int = 0  # replayed steps that drew another token (0: exact replay)
    waits: int = 0
    device_resets: int = 0  # device arrays rebuilt after a failed step lost them
    draft_tokens: int = 0  # speculative drafts verified
    accepted_tokens: int = 0  # of which accepted
    decode_request_steps: int = 0  # (request, decode step) pairs
    decode_emitted: int = 0  # tokens those steps emitted (1 + accepted drafts each)
    dropped_rows: int = 0  # async scheduling: decode rows of requests finished meanwhile
    drains: int = 0  # async scheduling: steps collected with no next step in flight
    prefix_hit_tokens: int = 0  # prompt tokens reused from published pages (not computed)
    prefix_hit_requests: int = 0  # prefills that reused a published prefix
    # Prefill staging (`EngineConfig.prefix_hit_pages` "stage"): rows chunk prefills staged
    # from the host pool / a device copy, summed over index groups (each row copied into
    # every layer of its group; staged_bytes_host counts those layers).
    staged_rows_host: int = 0
    staged_rows_device: int = 0
    staged_bytes_host: int = 0  # over all layers
    staged_chunks: int = 0  # chunk prefills that ran the staged variant

    def record_staged(self, from_host: int, from_device: int, *, row_bytes: int,
                      host_layer_rows: int | None = None) -> None:
        """One chunk prefill's staged rows (summed over index groups). `row_bytes`: one
        stored row of one layer; `host_layer_rows`: the rows from host counted once per layer
        of their group (each is copied into every layer of its group: `layer_rows`), default
        from_host (groups of one layer)."""
        self.staged_rows_host += from_host
        self.staged_rows_device += from_device
        self.staged_bytes_host += (from_host if host_layer_rows is None
                                   else host_layer_rows) * row_bytes
        self.staged_chunks += int(from_host + from_device > 0)

    def record_decode(self, *, fast: bool, hits: int, misses: int, row_bytes: int,
                      index_group_size: int = 1, rows: int | None = None) -> None:
        """One decode step: `hits` / `misses` hot-region lookups summed over its index groups
        (each miss is copied into every layer of its group). `rows`: the rows moved, each
        miss counted once per layer of its group (sum_g n_g * misses of group g:
        `layer_rows`); default misses * index_group_size (groups of equal size).
        `row_bytes`: one stored row of one layer."""
        self.decode_steps += 1
        self.fast_steps += int(fast)
        self.hot_hits += hits
        self.hot_misses += misses
        if rows is None:
            rows = misses * index_group_size
        self.rows_moved += rows
        self.bytes_moved += rows * row_bytes
        self.rows_moved_per_step.append(rows)


class StepClock:
    """Splits call times into compile time (the first call of each jitted variant: trace,
    compile and run; or a call during which something compiled) and steady-state time, and
    counts the steady-state decode tokens."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.compiled: set[Hashable] = set()
        self.decode_tokens = 0  # tokens of steady-state (timed) decode steps
        self.timed_decode_steps = 0  # decode steps whose time counted

    def account(self, variant: Hashable, seconds: float, field: str, *,
                compiled: bool = False) -> bool:
        """Adds a call's time to `metrics.<field>`, or to compile_seconds for a variant's
        first call or a call during which something `compiled`; True when the time was
        counted as steady-state."""
        if variant in self.compiled and not compiled:
            setattr(self.metrics, field, getattr(self.metrics, field) + seconds)
            self.timed_decode_steps += field == "decode_seconds"
            return True
        self.compiled.add(variant)
        self.metrics.compile_seconds += seconds
        return False

    def mark_compiled(self, variants: Iterable[Hashable]) -> None:
        """Variants compiled ahead (`Engine.warmup`): their first served call is timed."""
        self.compiled.update(variants)


def summarise(m: Metrics, clock: StepClock, *, mode: str, requests_finished: int,
              stats: Mapping[str, int], device_bytes: int, device_allocator_bytes: int | None,
              host_bytes: int, gpu_blocks: int,
              finish_reasons: Mapping[str, int] | None = None, kv_format: str = "bf16",
              row_bytes: int = 0, host_bytes_per_request: int = 0) -> dict[str, Any]:
    """The summary figures of a run (`Engine.summary`). `stats`: the residency manager's
    counters (spills, unpinned_pages, lost_pages, hot_grants, published_pages,
    prefix_restores; absent ones count 0); `finish_reasons`: finished requests per finish
    reason; `kv_format` / `row_bytes`: the stored KV row (bytes moved count `row_bytes` per
    row); `host_bytes_per_request`: host pool bytes of one full-length request, every layer.
    prompt_tokens counts the prompt tokens prefills computed, prefix_hit_tokens those reused
    from published pages (`EngineConfig.prefill.prefix_caching`)."""
    lookups = m.hot_hits + m.hot_misses
    steps = max(m.decode_steps, 1)
    timed_steps = clock.timed_decode_steps
    return {
        "mode": mode,
        "requests_finished": requests_finished,
        "finish_reasons": dict(finish_reasons or {}),
        "prompt_tokens": m.prompt_tokens,
        "prefix_hit_tokens": m.prefix_hit_tokens,
        "prefix_hit_requests": m.prefix_hit_requests,
        "prefix_restored_pages": stats.get("prefix_restores", 0),
        "staged_rows_host": m.staged_rows_host,
        "staged_rows_device": m.staged_rows_device,
        "staged_bytes_host": m.staged_bytes_host,
        "published_pages": stats.get("published_pages", 0),
        "generated_tokens": m.generated_tokens,
        "decode_steps": m.decode_steps,
        "fast_path_steps": m.fast_steps,
        "decode_tokens_per_s": clock.decode_tokens / m.decode_seconds
        if m.decode_seconds else 0.0,
        "decode_step_ms": 1e3 * m.decode_seconds / timed_steps if timed_steps else 0.0,
        "compile_seconds": m.compile_seconds,
        "warmup_seconds": m.warmup_seconds,
        "step_times": "exclude compilation (first calls and steps that compiled count in "
                      "compile_seconds; Engine.warmup in warmup_seconds)",
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
        "replayed_tokens": m.replayed_tokens,
        "replay_mismatches": m.replay_mismatches,
        "waits": m.waits,
        "draft_tokens": m.draft_tokens,
        "accepted_tokens": m.accepted_tokens,
        "acceptance_rate": m.accepted_tokens / m.draft_tokens if m.draft_tokens
        else float("nan"),
        "tokens_per_request_step": m.decode_emitted / m.decode_request_steps
        if m.decode_request_steps else 0.0,
        "dropped_rows": m.dropped_rows,
        "drains": m.drains,
        "device_resets": m.device_resets,
        "device_bytes": device_bytes,
        "device_allocator_bytes": device_allocator_bytes,
        "host_bytes": host_bytes,
        "gpu_blocks": gpu_blocks,
        "kv_format": kv_format,
        "row_bytes": row_bytes,
        "host_bytes_per_request": host_bytes_per_request,
    }
