"""Every difference between the supported jax versions and every use of a private jax API.

Supported: jax 0.10.2 (the newest for Python 3.11), 0.11.x and 0.12.x (Python 3.12). Nothing
else in the project tests `jax.__version__` or imports `jax._src`; code that needs a
version-dependent or private API calls the helper here. This module sits in the bottom layer
(`pallas_kernels`, which imports only jax and numpy), so every layer above may use it.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as _jex_core
from jax.experimental.compute_on import compute_on as _compute_on

# Loading Pallas' fuser defines a trace-context option (jax >= 0.11). Pallas loads it lazily,
# with the first interpret-mode kernel, so a jitted function traced before that would trace
# (and compile) again after it: load it now, before anything is traced.
from jax.experimental.pallas import fuser as _pallas_fuser  # noqa: F401
from jax.interpreters import mlir as _mlir

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# jax 0.11 turned `compute_on` from a context manager into a function transformation.
_COMPUTE_ON_IS_FUNCTION = JAX_VERSION >= (0, 11, 0)
# jax 0.10's Pallas interpreter cannot read operands that live in host memory; 0.11's can.
PALLAS_INTERPRET_READS_HOST = JAX_VERSION >= (0, 11, 0)


def on_host(fn: Callable[..., Any], *args: Any) -> Any:
    """Runs `fn(*args)` on the host ("device_host" compute) inside a jitted computation.

    The arguments must already live in host memory (`pinned_host`); the results stay there.
    """
    if _COMPUTE_ON_IS_FUNCTION:
        return _compute_on(fn, compute_type="device_host",
                           out_memory_spaces=jax.memory.Space.Host)(*args)
    with _compute_on("device_host"):
        return jax.jit(fn)(*args)


def has_gpu() -> bool:
    """True when the default backend is an NVIDIA GPU."""
    try:
        return jax.default_backend() == "gpu"
    except RuntimeError:
        return False


@contextlib.contextmanager
def triton_lowering_allowed():
    """Silences the Pallas Triton deprecation warning for the code inside, and nowhere else.

    Used only around the Triton-lowered kernels (`pallas_kernels/*/triton.py`; why they use
    that lowering: `pallas_kernels/_triton.py`). The warning is
    raised when XLA lowers the kernel (the first call of the enclosing jit), not when it is
    traced: wrap kernels with `quiet_triton_call` so the lowering itself runs in here.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*[Tt]riton.*deprecat.*")
        warnings.filterwarnings("ignore", message=r".*jax-pallas-triton.*")
        yield


def memory_kinds(device: jax.Device | None = None) -> Sequence[str]:
    device = device or jax.devices()[0]
    return [m.kind for m in device.addressable_memories()]


def in_host_memory(x: Any) -> bool:
    """True when `x` (array or tracer) lives in host memory (`pinned_host`/`unpinned_host`)."""
    return jax.typeof(x).memory_space == jax.memory.Space.Host


def to_host(x: jax.Array) -> jax.Array:
    """Moves `x` to host memory; usable inside jit."""
    return jax.device_put(x, jax.memory.Space.Host)


def to_device(x: jax.Array) -> jax.Array:
    """Moves `x` to device memory; usable inside jit."""
    return jax.device_put(x, jax.memory.Space.Device)


# --------------------------------------------------------------------------- Pallas helpers

_quiet_triton_p = _jex_core.Primitive("hisparse_triton_call")
_quiet_triton_p.multiple_results = True


@_quiet_triton_p.def_abstract_eval
def _quiet_triton_abstract_eval(*avals, fn, out_avals):
    del avals, fn
    return out_avals


def _quiet_triton_impl(*args, fn, out_avals):
    del out_avals
    with triton_lowering_allowed():
        return jax.jit(fn)(*args)


def _quiet_triton_lowering(ctx, *args, fn, out_avals):
    del out_avals
    with triton_lowering_allowed():
        return _mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


_quiet_triton_p.def_impl(_quiet_triton_impl)
_mlir.register_lowering(_quiet_triton_p, _quiet_triton_lowering)


def quiet_triton_call(fn: Callable[..., Sequence[jax.Array]], *args: jax.Array
                      ) -> tuple[jax.Array, ...]:
    """`fn(*args)` (a function of arrays returning a tuple of arrays), lowered inside
    `triton_lowering_allowed()`.

    The Pallas Triton deprecation warning fires while XLA lowers a `pallas_call`, long after
    the kernel wrapper returned; binding the call as its own primitive whose lowering rule
    holds the filter keeps the silencing local to these kernels. `fn` must be pure and its
    `pallas_call`s free of effects.
    """
    out_avals = tuple(jax.core.ShapedArray(o.shape, o.dtype)
                      for o in jax.eval_shape(lambda *a: tuple(fn(*a)), *args))
    return tuple(_quiet_triton_p.bind(*args, fn=fn, out_avals=out_avals))


def interpret_operand(x: jax.Array) -> jax.Array:
    """An operand of a Pallas kernel run in interpret mode: moved to device memory where this
    jax's interpreter cannot read host memory (0.10.x), else unchanged."""
    if not PALLAS_INTERPRET_READS_HOST and in_host_memory(x):
        return to_device(x)
    return x


@functools.cache
def mosaic_gpu_interpret_available() -> bool:
    """Whether this jax runs Mosaic GPU Pallas kernels in interpret mode on the CPU (jax 0.11
    and later: `jax.experimental.pallas.mosaic_gpu.InterpretGPUParams`). Imports that module
    only when called."""
    try:
        from jax.experimental.pallas import mosaic_gpu
    except ImportError:  # pragma: no cover - a jax without Mosaic GPU Pallas
        return False
    return hasattr(mosaic_gpu, "InterpretGPUParams")


def not_hopper() -> str | None:
    """None when the default device is a Hopper GPU (compute capability 9.x: wgmma,
    setmaxnreg, what the Mosaic GPU kernels here are written for), else what it is."""
    try:
        device = jax.devices()[0]
    except RuntimeError as e:  # pragma: no cover - no backend at all
        return f"no device ({e})"
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or capability is None:
        return f"a {device.platform} device"
    if not str(capability).startswith("9."):
        return f"{getattr(device, 'device_kind', 'a GPU')} (compute capability {capability})"
    return None


def backends_initialized() -> bool:
    """Whether JAX has initialised its backends (after which XLA flags and allocator limits
    read from the environment no longer change). Private API; True when it cannot tell."""
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - layout of jax internals changed
        return True  # assume the worst: callers only check, never set
    if hasattr(xla_bridge, "backends_are_initialized"):
        return bool(xla_bridge.backends_are_initialized())
    return bool(getattr(xla_bridge, "_backends", {}))


def jit_cache_size(fn: Callable[..., Any]) -> int:
    """Executables a `jax.jit` function holds (one per distinct argument signature; private
    API on both supported versions, so it lives here)."""
    return int(fn._cache_size())


def lower_for_cuda(fn: Callable[..., Any], *args: Any) -> str | None:
    """The StableHLO text of `jax.jit(fn)(*args)` exported for CUDA from a machine without a
    GPU (args may be `jax.ShapeDtypeStruct`s), or None when this jax's internals moved.

    Runs the whole Pallas -> Triton lowering, so a non-power-of-two shape or a primitive the
    Triton backend lacks fails on a CPU machine (CI) rather than on the GPU machine. The
    Triton lowering asks for the GPU's properties; the private hook that answers them is
    pointed at an H200's for the duration of the call.
    """
    try:
        from jax._src.pallas.triton import pallas_call_registration as reg
    except ImportError:  # pragma: no cover - layout of jax internals changed
        return None
    try:
        from jax._src.pallas.triton import gpu_info
    except ImportError:
        try:  # jax >= 0.12.1: the module moved up, same API
            from jax._src import gpu_info
        except ImportError:
            gpu_info = None
    patched = None
    if gpu_info is not None and hasattr(reg, "gpu_info_lib"):
        info = gpu_info._get_gpu_info_impl(gpu_info.GpuVersion.H200)
        patched = reg.gpu_info_lib.get_gpu_info
        reg.gpu_info_lib.get_gpu_info = lambda: info
    try:
        exported = jax.export.export(
            jax.jit(fn), platforms=["cuda"],
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(
                "__gpu$xla.gpu.triton")])(*args)
        return exported.mlir_module()
    finally:
        if patched is not None:
            reg.gpu_info_lib.get_gpu_info = patched


# --------------------------------------------------------------------------- meshes
# (issue 18: the mesh engine, `hisparse_jax/engine/mesh.py`)


def shard_map(fn: Callable[..., Any], *, mesh: jax.sharding.Mesh, in_specs: Any,
              out_specs: Any, manual_axes: Sequence[str]) -> Callable[..., Any]:
    """`fn` mapped over the blocks of `mesh`'s `manual_axes`; the mesh's other axes stay with
    the partitioner (GSPMD shards them by the operands' shardings). Replication is not
    checked. jax 0.10.2 .. 0.12 have `jax.shard_map(axis_names=, check_vma=)`; older ones
    only `jax.experimental.shard_map.shard_map(auto=, check_rep=)`."""
    manual = frozenset(manual_axes)
    if hasattr(jax, "shard_map"):
        return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=manual, check_vma=False)
    from jax.experimental.shard_map import shard_map as _legacy  # pragma: no cover

    return _legacy(fn, mesh, in_specs, out_specs, check_rep=False,  # pragma: no cover
                   auto=frozenset(mesh.axis_names) - manual)


def initialize_distributed(coordinator_address: str, num_processes: int,
                           process_id: int) -> None:
    """`jax.distributed.initialize` for a multi-process run, with cross-process collectives
    on the CPU (gloo, where this jax has the option and it is not set already)."""
    try:
        if jax.config.jax_cpu_collectives_implementation in (None, "", "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # pragma: no cover - a jax without the option
        pass
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id)


def process_allgather(x: Any) -> Any:
    """Every process's `x` (numpy), stacked on a new leading axis, on every process
    (`jax.experimental.multihost_utils.process_allgather`)."""
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(x)
