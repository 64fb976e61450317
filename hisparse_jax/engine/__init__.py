"""The decode engine, in parts: `Engine` (engine.py) composes the `Scheduler`
(scheduler.py), a residency manager (the host tier's `Coordinator`, or `StaticResidency` of
residency.py), the `Runner` (runner.py: device arrays and jitted steps), `Metrics`
(metrics.py), `Request` (request.py), sampling (sampler.py) and `EngineConfig` (config.py).
"""

from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.engine import Engine
from hisparse_jax.engine.metrics import Metrics
from hisparse_jax.engine.request import Request

__all__ = ["Engine", "EngineConfig", "Metrics", "Request"]
