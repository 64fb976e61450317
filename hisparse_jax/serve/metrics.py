"""The server's Prometheus metrics: one `CollectorRegistry` per server (no global state).

Names follow vLLM's where vLLM has the metric (its `vllm:` prefix, so that dashboards built
for vLLM read them); the rest are under `hisparse_jax:`. prometheus_client appends `_total`
to a counter's name in the text format (`vllm:generation_tokens` is exported as
`vllm:generation_tokens_total`). Every metric carries a `model_name` label.

Requests and tokens:
  vllm:num_requests_running (gauge): requests holding a seat.
  vllm:num_requests_waiting (gauge): requests waiting for one (in the engine's queue, or
    handed to the engine thread and not yet added).
  vllm:prompt_tokens (counter): prompt tokens the prefills computed (a preempted request's
    prompt counts again when it is prefilled again).
  vllm:generation_tokens (counter): generated tokens reported to clients.
  vllm:request_success (counter, label finished_reason: stop, length, abort, error): finished
    requests (abort: cancelled, e.g. by a client that disconnected).
  vllm:num_preemptions (counter).
  vllm:time_to_first_token_seconds (histogram): arrival at the server -> first token.
  vllm:inter_token_latency_seconds (histogram): between a request's successive token
    reports (one per engine step that gave it tokens).
  vllm:e2e_request_latency_seconds (histogram): arrival -> finish.
  hisparse_jax:requests_rejected (counter, label reason: queue_full, draining, invalid).

The engine and its pools:
  hisparse_jax:engine_step_seconds (histogram): wall time of each engine step.
  hisparse_jax:engine_step_failures (counter): steps that raised (the engine recovered).
  vllm:hisparse_cache_hits / vllm:hisparse_cache_misses (counters): hot-buffer lookups that
    hit / missed (lookups = hits + misses; summed over index groups).
  vllm:hisparse_host_to_device_bytes (counter), hisparse_jax:host_to_device_rows (counter):
    KV rows copied host -> device by decode steps (a miss counts once per layer of its
    index group).
  vllm:kv_cache_usage_perc (gauge), hisparse_jax:device_blocks_used /
    hisparse_jax:device_blocks_total (gauges): the device KV pool's blocks in use.
  vllm:hisparse_host_blocks_used / vllm:hisparse_host_blocks_total /
    vllm:hisparse_host_blocks_usage (gauges): the host pool's blocks in use (HiSparse only).
  vllm:hisparse_pending_spills (gauge): sealed pages whose host copy has not completed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from hisparse_jax.engine import Engine
from hisparse_jax.serve.engine_loop import Job, LoopObserver

# The engine's finish reasons -> vLLM's finished_reason label.
FINISHED_REASON = {"stop": "stop", "length": "length", "max_model_len": "length",
                   "cancelled": "abort", "error": "error"}
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5,
                    5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_E2E_BUCKETS = (0.05, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)
# Engine counters (`Metrics` fields) exported as counters of their increments.
_ENGINE_COUNTERS = (("prompt_tokens", "vllm:prompt_tokens",
                     "Prompt tokens computed by prefills."),
                    ("preemptions", "vllm:num_preemptions", "Requests preempted."),
                    ("hot_hits", "vllm:hisparse_cache_hits",
                     "HiSparse hot-buffer lookups that hit."),
                    ("hot_misses", "vllm:hisparse_cache_misses",
                     "HiSparse hot-buffer lookups that missed (copied from host)."),
                    ("bytes_moved", "vllm:hisparse_host_to_device_bytes",
                     "KV bytes copied host -> device by decode steps."),
                    ("rows_moved", "hisparse_jax:host_to_device_rows",
                     "KV rows copied host -> device by decode steps (one per layer)."))


class ServerMetrics(LoopObserver):
    """The collectors of one server, fed by the engine loop (`LoopObserver`) and the HTTP
    side (`rejected`); `exposition()` renders them."""

    def __init__(self, model_name: str) -> None:
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        labels = ("model_name",)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=registry).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Requests holding a seat.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting for a seat.")
        self.generation_tokens = counter("vllm:generation_tokens",
                                         "Generated tokens reported to clients.")
        self._success = Counter("vllm:request_success", "Finished requests by reason.",
                                (*labels, "finished_reason"), registry=registry)
        self._rejected = Counter("hisparse_jax:requests_rejected",
                                 "Requests refused before the engine, by reason.",
                                 (*labels, "reason"), registry=registry)
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Arrival at the server to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Between a request's successive token reports.",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to finish.",
                             _E2E_BUCKETS)
        self.step_time = histogram("hisparse_jax:engine_step_seconds",
                                   "Wall time of an engine step.", _LATENCY_BUCKETS)
        self.step_failures = counter("hisparse_jax:engine_step_failures",
                                     "Engine steps that raised (recovered).")
        self._engine_counters = {field: counter(name, doc)
                                 for field, name, doc in _ENGINE_COUNTERS}
        self._seen = {field: 0 for field, _, _ in _ENGINE_COUNTERS}
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "Fraction of the device KV pool's blocks in use.")
        self.device_used = gauge("hisparse_jax:device_blocks_used",
                                 "Device KV pool blocks in use.")
        self.device_total = gauge("hisparse_jax:device_blocks_total",
                                  "Device KV pool blocks (the null block excluded).")
        self.host_used = gauge("vllm:hisparse_host_blocks_used",
                               "Host pool blocks in use.")
        self.host_total = gauge("vllm:hisparse_host_blocks_total",
                                "Host pool blocks (the null block excluded).")
        self.host_usage = gauge("vllm:hisparse_host_blocks_usage",
                                "Fraction of the host pool's blocks in use.")
        self.pending_spills = gauge("vllm:hisparse_pending_spills",
                                    "Sealed pages whose host copy has not completed.")
        for reason in ("stop", "length", "abort", "error"):  # present from the start
            self._success.labels(model_name, reason)
        for reason in ("queue_full", "draining", "invalid"):
            self._rejected.labels(model_name, reason)

    def exposition(self) -> tuple[bytes, str]:
        """The text format of every metric, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    # ------------------------------------------------------------------ LoopObserver

    def on_step(self, engine: Engine, seconds: float, failed: bool) -> None:
        self.step_time.observe(seconds)
        if failed:
            self.step_failures.inc()
        m = engine.metrics
        for field, counter in self._engine_counters.items():
            value = getattr(m, field)
            if value > self._seen[field]:
                counter.inc(value - self._seen[field])
            self._seen[field] = value
        self._pools(engine)

    def on_state(self, engine: Engine, pending: int) -> None:
        self.running.set(len(engine.running))
        self.waiting.set(len(engine.waiting) + pending)

    def _pools(self, engine: Engine) -> None:
        manager = engine.scheduler.manager
        device = manager.device_pool
        total = getattr(device, "num_usable", None)
        if total is None:  # all-resident: every seat's full-length rows
            total = engine.config.sizes.max_seats * manager.max_pages
        used = total - device.num_free
        self.device_used.set(used)
        self.device_total.set(total)
        self.kv_usage.set(used / total if total else 0.0)
        host = getattr(manager, "host_pool", None)
        if host is not None:
            used = host.num_usable - host.num_free
            self.host_used.set(used)
            self.host_total.set(host.num_usable)
            self.host_usage.set(used / host.num_usable if host.num_usable else 0.0)
            self.pending_spills.set(manager.num_dirty_sealed_pages)

    def on_tokens(self, job: Job, count: int, now: float) -> None:
        self.generation_tokens.inc(count)
        if job.first_token_at is None:
            self.ttft.observe(now - job.arrival)
        else:
            self.itl.observe(now - job.last_token_at)

    def on_finish(self, job: Job, reason: str, now: float) -> None:
        if reason == "rejected":
            self.rejected("invalid")
            return
        self._success.labels(self.model_name, FINISHED_REASON.get(reason, reason)).inc()
        self.e2e.observe(now - job.arrival)
