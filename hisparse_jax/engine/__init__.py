"""The decode engine, in parts: `Engine` (engine.py) composes the `Scheduler`
(scheduler.py), a residency manager (the host tier's `Coordinator`, or `StaticResidency` of
static_residency.py), the `Runner` (runner.py: dispatch and collection, over `StepBuilder` in
step_builder.py: the jitted steps, `DeviceState` in device_state.py: the arrays and their
rebuild, and warmup.py), a step loop (loops.py) over the one step path (step.py: `execute`
runs a scheduled plan), the request front (front.py: `Intake`), `Metrics` (metrics.py),
`Request` (request.py), sampling (sampler.py: per-request keys), prefix caching's index keys
(page_keys.py over prefix_keys.py) and `EngineConfig` (config.py, its groups in
config_groups.py: `Sizes`, `PrefillPolicy`, `Speculative`, `Tuning`, `Debug`; the residency
values `HiSparse`, `AllResident`, `NaiveOffload` come from `hisparse_jax.cache`; validated at
construction); compile_cache.py turns on jax's persistent compilation cache. `MeshEngine`
(mesh.py, mesh_step.py) composes the same parts per data shard of a mesh. The engines serve
any model implementing `hisparse_jax.models.ServedModel`. The request lifecycle
(validation, errors, cancel, recovery after a failed step) is in engine.py's docstring.
"""

from hisparse_jax.cache import AllResident, HiSparse, NaiveOffload
from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.config_groups import Debug, PrefillPolicy, Sizes, Speculative, Tuning
from hisparse_jax.engine.engine import Engine
from hisparse_jax.engine.metrics import Metrics
from hisparse_jax.engine.request import FINISH_REASONS, Request

__all__ = ["FINISH_REASONS", "AllResident", "Debug", "Engine", "EngineConfig", "HiSparse",
           "Metrics", "NaiveOffload", "PrefillPolicy", "Request", "Sizes", "Speculative",
           "Tuning"]
