"""The decode engine, in parts: `Engine` (engine.py) composes the `Scheduler`
(scheduler.py), a residency manager (the host tier's `Coordinator`, or `StaticResidency` of
residency.py), the `Runner` (runner.py: device arrays, jitted steps, warmup), `Metrics`
(metrics.py), `Request` (request.py), sampling (sampler.py: per-request keys) and
`EngineConfig` (config.py, validated at construction); compile_cache.py turns on jax's
persistent compilation cache. The request lifecycle (validation, errors, cancel, recovery
after a failed step) is in engine.py's docstring.
"""

from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.engine import Engine
from hisparse_jax.engine.metrics import Metrics
from hisparse_jax.engine.request import FINISH_REASONS, Request

__all__ = ["FINISH_REASONS", "Engine", "EngineConfig", "Metrics", "Request"]
