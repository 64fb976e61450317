"""Sparse MLA decode attention over the resolver's flat rows: `sparse_mla_decode`.

The resolver hands attention one flat device row per selected token (-1 = invalid); this op
consumes that contract. One latent KV "head" is shared by all query heads (MQA, DeepSeek-V3.2
absorbed MLA: each row is 512 latent + 64 rope dims, the value is the first `v_width` dims).

Backends (`backend=`):
  "reference":  jnp gather + float32 softmax (`pallas_kernels.sparse_mla_ref`); any platform.
  "mosaic_gpu": Pallas Mosaic GPU kernel with wgmma (`pallas_kernels.sparse_mla_mgpu`);
                Hopper GPUs, jax >= 0.11, bf16/f16, D and v_width multiples of 64 / 128.
  "triton":     Pallas kernel through the (deprecated) Triton lowering
                (`pallas_kernels.triton_kernels`): vector-index row gathers; bf16/f16,
                v_width a power of two and the rest of the row power-of-two pieces (576 = 512
                + 64).
  None:         `DEFAULT_GPU_BACKEND` on a GPU when it supports the inputs, else the reference.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _compat
from pallas_kernels.sparse_mla_ref import sparse_mla_decode_ref

BACKENDS = ("reference", "mosaic_gpu", "triton")
# The kernel `backend=None` picks on a GPU: whichever `bench/bench_sparse_mla.py` measured faster.
DEFAULT_GPU_BACKEND = "triton"  # measured 2.9x faster than mosaic_gpu on the H200 (run 2)
_Q_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _validate(q: Any, kv_cache: Any, attention_rows: Any, sm_scale: Any, v_width: Any,
              backend: Any) -> None:
    """Raises ValueError / TypeError naming the argument and the rule; no device work."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None or one of {BACKENDS}, got {backend!r}")
    for name, x in (("q", q), ("kv_cache", kv_cache), ("attention_rows", attention_rows)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in _Q_DTYPES]:
        raise TypeError(f"q must be bfloat16, float16 or float32, got {q.dtype}")
    if q.ndim not in (3, 4):
        raise ValueError(
            f"q must be [N, h_q, D] or, for the multi-query-row form, [N, s_q, h_q, D]; "
            f"got shape {tuple(q.shape)}")
    if jnp.dtype(kv_cache.dtype) != jnp.dtype(q.dtype):
        raise TypeError(f"kv_cache dtype must equal q's dtype {q.dtype}, got {kv_cache.dtype}")
    if kv_cache.ndim not in (2, 3):
        raise ValueError(
            f"kv_cache must be [num_blocks, B, D] (or flat rows [R, D]), got shape "
            f"{tuple(kv_cache.shape)}")
    width = q.shape[-1]
    if kv_cache.shape[-1] != width:
        raise ValueError(f"kv_cache row width {kv_cache.shape[-1]} != q width {width}")
    if jnp.dtype(attention_rows.dtype) != jnp.dtype(jnp.int32):
        raise TypeError(f"attention_rows must be int32, got {attention_rows.dtype}")
    lead = tuple(q.shape[:-2])  # (N,) or (N, s_q)
    form = "[N, K]" if q.ndim == 3 else "[N, s_q, K]"
    if attention_rows.ndim != len(lead) + 1 or tuple(attention_rows.shape[:-1]) != lead:
        raise ValueError(
            f"attention_rows must be int32 {form} with leading dims {lead} equal to q's, got "
            f"shape {tuple(attention_rows.shape)}")
    if attention_rows.shape[-1] < 1:
        raise ValueError("attention_rows must select at least one entry per row (K >= 1)")
    if (not isinstance(v_width, (int, np.integer)) or isinstance(v_width, bool)
            or not 0 < v_width <= width):
        raise ValueError(f"v_width must be an int in [1, {width}] (the row width), got {v_width!r}")
    if isinstance(sm_scale, jax.Array) or not isinstance(sm_scale, numbers.Real) \
            or isinstance(sm_scale, bool):
        raise TypeError(f"sm_scale must be a Python float (static), got {type(sm_scale).__name__}")
    if not (np.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a finite positive float, got {sm_scale!r}")


def kernel_supports(q: Any, kv_cache: Any, v_width: int, backend: str = "mosaic_gpu"
                    ) -> str | None:
    """None when kernel `backend` handles these inputs, else the reason it does not."""
    if backend == "triton":
        from pallas_kernels.triton_kernels import attention_supports as supports

        return supports(q.dtype, q.shape[-1], v_width, math.prod(kv_cache.shape))
    if jnp.dtype(q.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"the mosaic_gpu kernel needs bfloat16 or float16 inputs, got {q.dtype}"
    width = q.shape[-1]
    if width % 64:
        return f"the mosaic_gpu kernel needs the row width to be a multiple of 64, got {width}"
    if v_width % 128 or v_width > 512:
        return f"the mosaic_gpu kernel needs v_width a multiple of 128 and <= 512, got {v_width}"
    return None


def sparse_mla_decode(
    q: jax.Array,
    kv_cache: jax.Array,
    attention_rows: jax.Array,
    *,
    sm_scale: float,
    v_width: int = 512,
    backend: str | None = None,
    config: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Sparse MLA decode attention over the selected flat rows of a paged latent KV cache.

    Args:
      q: [N, h_q, D] query rows (D = 576 for DeepSeek-V3.2: 512 latent + 64 rope), bf16
        (f16 / f32 accepted; f32 only by the reference). Multi-query-row form for speculative
        decode: [N, s_q, h_q, D].
      kv_cache: [num_blocks, B, D] (or flat [R, D]) of q's dtype, viewed as flat rows
        [num_blocks * B, D]; one latent head shared by all query heads.
      attention_rows: int32 [N, K] (or [N, s_q, K]): flat row per selected token, -1 = masked,
        anywhere in the row. Valid entries must be < num_blocks * B (not checked: values are
        data).
      sm_scale: softmax scale (static Python float), e.g. 1 / sqrt(192) for DSV3.2.
      v_width: value width, the leading `v_width` dims of a row (512).
      backend: "reference", "mosaic_gpu", "triton" or None (`DEFAULT_GPU_BACKEND` on a GPU
        when it supports the inputs, else the reference).
      config: optional knobs of the kernel: `pallas_kernels.sparse_mla_mgpu.TuningConfig`
        (mosaic_gpu) or `pallas_kernels.triton_kernels.AttentionTuning` (triton).

    Returns:
      out: [N, h_q, v_width] (or [N, s_q, h_q, v_width]) in q's dtype;
      lse: float32 [N, h_q] (or [N, s_q, h_q]), natural-log sum of exp of the scaled scores.
      A row with no valid entry gives out = 0 and lse = -inf.
    """
    _validate(q, kv_cache, attention_rows, sm_scale, v_width, backend)
    sm_scale = float(sm_scale)
    v_width = int(v_width)
    lead = tuple(q.shape[:-2])
    h_q, width = q.shape[-2:]
    q_rows = q.reshape(-1, h_q, width)
    rows = attention_rows.reshape(-1, attention_rows.shape[-1])
    kv_rows = kv_cache.reshape(-1, width)

    if backend is None:
        use_kernel = (_compat.has_gpu()
                      and kernel_supports(q, kv_cache, v_width, DEFAULT_GPU_BACKEND) is None)
        backend = DEFAULT_GPU_BACKEND if use_kernel else "reference"
        config = config if use_kernel else None
    if backend != "reference":
        reason = kernel_supports(q, kv_cache, v_width, backend)
        if reason is not None:
            raise ValueError(reason)
    if backend == "mosaic_gpu":
        from pallas_kernels import sparse_mla_mgpu  # deferred: needs jax >= 0.11 Mosaic GPU

        out, lse = sparse_mla_mgpu.sparse_mla_decode_mgpu(
            q_rows, kv_rows, rows, sm_scale=sm_scale, v_width=v_width, config=config)
    elif backend == "triton":
        from pallas_kernels import triton_kernels

        out, lse = triton_kernels.sparse_mla_decode_triton(
            q_rows, kv_rows, rows, sm_scale=sm_scale, v_width=v_width, config=config)
    else:
        out, lse = sparse_mla_decode_ref(q_rows, kv_rows, rows, sm_scale=sm_scale,
                                         v_width=v_width)
    return out.reshape(*lead, h_q, v_width), lse.reshape(*lead, h_q)
