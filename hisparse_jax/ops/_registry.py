"""The one backend registry of the data-plane ops: op -> {backend: kernel module}.

Vocabulary (`BACKENDS`): "reference" (the jnp definition, any platform), "triton" (a Pallas
kernel through the Triton lowering), "mosaic_gpu" (a Pallas Mosaic GPU kernel). Each
implementation is the function named after the op in a `pallas_kernels/<op folder>/<backend>.py`
module; a kernel module also has `supports(*args, **kwargs) -> str | None` (None: it can run
these inputs, else the reason), called with the arguments of the function and `interpret`.
Modules are imported on first use: `mosaic_gpu.py` needs a jax with Mosaic GPU Pallas.

`select(op, backend, *args, **kwargs)` picks the backend a call runs:
  * None: on a GPU, the first backend of the op's preference order (for the call's
    `kv_format`, where that has its own) whose `supports` accepts the inputs; off a GPU (or
    when none does), "reference";
  * a name: that backend, or ValueError with the reason it cannot run the inputs (or that the
    op has no such backend); an unknown name is a ValueError listing `BACKENDS`;
  * "pallas" (the former name of the Triton data-plane kernels) is accepted as a deprecated
    alias of "triton" (DeprecationWarning).
Off a GPU, kernels run in Pallas interpret mode (`implementation(...)` binds `interpret`).

A fused op (`FUSED_PARTS`: one launch doing the work of several ops) has a fallback: where
the requested backend has no implementation of it, its caller runs the parts instead, one
after the other, with the same results. `runs_fused(op, backend)` answers which: the fused op
for every backend it registers and for None (`select` then picks per platform, "reference"
at worst), unless for None the caller passes the inputs of the op's last part and the
backend None picks for that part has no fused implementation (fp8_ds_mla rows on a Hopper
GPU: the row-copy attention); the parts for any other backend. Callers ask it rather than
test names.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

from pallas_kernels import _compat

BACKENDS: tuple[str, ...] = ("reference", "triton", "mosaic_gpu")
_DEPRECATED_ALIASES = {"pallas": "triton"}

# op -> (pallas_kernels folder, registered backends). The entry function of each module is
# named after the op (gather_compact_group lives beside gather_compact).
_OPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "resolve_residency": ("resolve_residency", ("reference", "triton")),
    "resolve_residency_mapped": ("resolve_residency", ("reference", "triton")),
    "invalidate_written_rows": ("invalidate_written_rows", ("reference", "triton")),
    "gather_compact": ("gather_compact", ("reference", "triton")),
    "gather_compact_group": ("gather_compact", ("reference", "triton")),
    "mirror_rows": ("mirror_rows", ("reference", "triton")),
    "stage_prefill_rows": ("stage_prefill_rows", ("reference", "triton")),
    "sparse_mla_decode": ("sparse_mla_decode", ("reference", "triton", "mosaic_gpu")),
    "sparse_mla_decode_with_copies": ("sparse_mla_decode", ("reference", "triton")),
    "grouped_matmul": ("grouped_matmul", ("reference", "triton", "mosaic_gpu")),
}

# What `backend=None` tries on a GPU, in order ("reference" always runs); per kv_format
# overrides in PREFERENCE_BY_FORMAT. The Mosaic GPU attention kernels are opt-in over bf16
# rows: the TMA-box kernel is slower than Triton's, and the row-copy kernel (faster alone at
# 128 heads) is not measured end to end over bf16 rows and runs them only when given its
# `RowTuning`. So is jax's Mosaic GPU grouped matmul: it runs a full tile for every group,
# empty or not (`pallas_kernels/grouped_matmul/mosaic_gpu.py`), where the Triton kernel skips
# the empty ones.
PREFERENCE: dict[str, tuple[str, ...]] = {
    "resolve_residency": ("triton", "reference"),
    "resolve_residency_mapped": ("triton", "reference"),
    "invalidate_written_rows": ("triton", "reference"),
    "gather_compact": ("triton", "reference"),
    "gather_compact_group": ("triton", "reference"),
    "mirror_rows": ("triton", "reference"),
    "stage_prefill_rows": ("triton", "reference"),
    "sparse_mla_decode": ("triton", "reference"),
    "sparse_mla_decode_with_copies": ("triton", "reference"),
    "grouped_matmul": ("triton", "reference"),
}

# (op, kv_format) -> the order `backend=None` tries for calls with that `kv_format` keyword.
# fp8_ds_mla rows: the Mosaic GPU row-copy kernel first (Hopper, jax >= 0.11; elsewhere its
# `supports` refuses and the Triton kernel runs). It is about 3x the Triton kernel alone and
# the faster of the two in the engine's decode step at 256 requests, with another group's
# host copies run before it rather than inside the Triton launch
# (`bench/NOTES-sparse_mla.md`). The fused op with copies stays Triton's: where the
# attention's default has no fused implementation, callers run the parts (`runs_fused`).
PREFERENCE_BY_FORMAT: dict[tuple[str, str], tuple[str, ...]] = {
    ("sparse_mla_decode", "fp8_ds_mla"): ("mosaic_gpu", "triton", "reference"),
}


# Fused op -> the ops it does the work of, in the order its fallback runs them.
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "sparse_mla_decode_with_copies": ("gather_compact_group", "sparse_mla_decode"),
}


def ops() -> tuple[str, ...]:
    """Every registered op name."""
    return tuple(_OPS)


def registered_backends(op: str) -> tuple[str, ...]:
    """The backends registered for `op`, in `BACKENDS` order."""
    return _OPS[op][1]


def normalize(backend: str | None) -> str | None:
    """`backend` in the vocabulary (the "pallas" alias mapped, with a DeprecationWarning);
    ValueError listing `BACKENDS` for an unknown name."""
    if backend is None:
        return None
    if isinstance(backend, str) and backend in _DEPRECATED_ALIASES:
        new = _DEPRECATED_ALIASES[backend]
        warnings.warn(f"backend={backend!r} is deprecated; use backend={new!r}",
                      DeprecationWarning, stacklevel=4)
        return new
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return backend


def runs_fused(op: str, backend: str | None, *part_args: Any, **part_kwargs: Any) -> bool:
    """Whether a call of the fused `op` with `backend=` runs `op` itself (True) or its parts,
    `FUSED_PARTS[op]`, one after the other (False: `op` has no `backend` implementation).
    With backend None and `part_args` / `part_kwargs` (the arguments `select` takes for the
    last part, e.g. the attention's flat q, rows and ids and its keywords), `backend` is the
    one None picks for that part. The rule is the module docstring's; the deprecated alias
    counts as its new name, silently (the op's own call warns).

    Raises:
      KeyError: `op` is not a fused op.
      ValueError: `backend` is neither None nor a name of `BACKENDS`.
    """
    if op not in FUSED_PARTS:
        raise KeyError(f"no fused op {op!r}; the fused ops are {tuple(FUSED_PARTS)}")
    if backend is None:
        if not part_args:
            return True
        backend = select(FUSED_PARTS[op][-1], None, *part_args, **part_kwargs)
    name = _DEPRECATED_ALIASES.get(backend, backend) if isinstance(backend, str) else backend
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    return name in registered_backends(op)


@functools.cache
def module(op: str, backend: str) -> ModuleType:
    """The module holding `op`'s `backend` implementation (imported on first use)."""
    folder, backends = _OPS[op]
    if backend not in backends:
        raise ValueError(f"backend={backend!r} has no implementation of {op}; its backends "
                         f"are {backends}")
    return importlib.import_module(f"pallas_kernels.{folder}.{backend}")


def unsupported(op: str, backend: str, *args: Any, **kwargs: Any) -> str | None:
    """None when `backend` can run `op` on these inputs (the op's arguments, arrays or
    `jax.ShapeDtypeStruct`s, validated), else the reason it cannot."""
    try:
        mod = module(op, backend)
    except ImportError as e:
        return f"the {backend} implementation of {op} does not import on jax " \
               f"{'.'.join(map(str, _compat.JAX_VERSION))}: {e}"
    supports = getattr(mod, "supports", None)
    if supports is None:                              # the references run every input
        return None
    return supports(*args, interpret=not _compat.has_gpu(), **kwargs)


def select(op: str, backend: str | None, *args: Any, **kwargs: Any) -> str:
    """The backend that runs `op` on these inputs (rules in the module docstring)."""
    if op not in _OPS:
        raise KeyError(f"no op {op!r}; the ops are {ops()}")
    backend = normalize(backend)
    if backend is None:
        if not _compat.has_gpu():
            return "reference"
        order = PREFERENCE_BY_FORMAT.get((op, kwargs.get("kv_format")), PREFERENCE[op])
        for candidate in order:
            if unsupported(op, candidate, *args, **kwargs) is None:
                return candidate
        return "reference"
    if backend not in registered_backends(op):
        raise ValueError(f"backend={backend!r} has no implementation of {op}; its backends "
                         f"are {registered_backends(op)}")
    reason = unsupported(op, backend, *args, **kwargs)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot run these inputs of {op}: {reason}")
    return backend


def implementation(op: str, backend: str) -> Callable[..., Any]:
    """The function that runs `op` on `backend` (a name `select` returned): the reference
    itself, or the kernel with `interpret` bound (True off the GPU)."""
    fn = getattr(module(op, backend), op)
    if backend == "reference":
        return fn
    return functools.partial(fn, interpret=not _compat.has_gpu())
