"""Sparse MLA decode attention over the resolver's flat rows: `sparse_mla_decode`.

The resolver hands attention one flat device row per selected token (-1 = invalid); this op
consumes that contract. One latent KV "head" is shared by all query heads (MQA, DeepSeek-V3.2
absorbed MLA: each row is 512 latent + 64 rope dims, the value is the first `v_width` dims).

Backends (`backend=`, through `hisparse_jax.ops._registry`):
  "reference":  jnp gather + float32 softmax (`pallas_kernels/sparse_mla_decode/reference.py`);
                any platform, bf16/f16/f32.
  "triton":     Pallas kernel through the Triton lowering (`.../triton.py`): vector-index row
                gathers; bf16/f16, v_width a power of two and the rest of the row power-of-two
                pieces (576 = 512 + 64). The default on a GPU when it supports the inputs.
  "mosaic_gpu": Pallas Mosaic GPU kernel with wgmma (`.../mosaic_gpu.py`); Hopper GPUs,
                jax >= 0.11, bf16/f16, D a multiple of 64, v_width a multiple of 128. Opt-in.
  None:         "triton" on a GPU when it supports the inputs, else "reference".

KV row formats (`kv_format=`, `pallas_kernels/kv_format.py`, `docs/kv_format.md`): "bf16" (rows
of q's float dtype) on every backend; "fp8_ds_mla" (uint8[656] rows: fp8 latent with 4
float32 scales, bf16 rope) on "reference" and "triton", not "mosaic_gpu".
"""

from __future__ import annotations

from typing import Any

import jax

from hisparse_jax.ops import _checks, _registry


def sparse_mla_decode(
    q: jax.Array,
    kv_cache: jax.Array,
    attention_rows: jax.Array,
    *,
    sm_scale: float,
    v_width: int = 512,
    kv_format: str = "bf16",
    backend: str | None = None,
    config: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Sparse MLA decode attention over the selected flat rows of a paged latent KV cache.

    Args:
      q: [N, h_q, D] query rows (D = 576 for DeepSeek-V3.2: 512 latent + 64 rope), bf16
        (f16 / f32 accepted; f32 only by the reference). Multi-query-row form for speculative
        decode: [N, s_q, h_q, D].
      kv_cache: [num_blocks, B, D] (or flat [R, D]) of q's dtype, viewed as flat rows
        [num_blocks * B, D]; one latent head shared by all query heads. With
        kv_format="fp8_ds_mla": uint8 [num_blocks, B, 656] (or [R, 656]) rows of that format
        (`pallas_kernels/kv_format.py`), D = 576.
      attention_rows: int32 [N, K] (or [N, s_q, K]): flat row per selected token, -1 = masked,
        anywhere in the row. Valid entries must be < num_blocks * B (not checked: values are
        data).
      sm_scale: softmax scale (static Python float), e.g. 1 / sqrt(192) for DSV3.2.
      v_width: value width, the leading `v_width` dims of a row (512); with "fp8_ds_mla"
        at most 512 (the value is the dequantized latent part; the triton kernel takes
        multiples of 128).
      kv_format: "bf16" (rows stored in q's float dtype) or "fp8_ds_mla" (rows quantized
        by `pallas_kernels.kv_format.quantize`, dequantized inside attention; q bfloat16
        for the triton kernel, any float q for the reference).
      backend: "reference", "triton", "mosaic_gpu" or None (module docstring).
      config: optional tuning of the kernel that runs:
        `pallas_kernels.sparse_mla_decode.triton.AttentionTuning` (triton) or
        `pallas_kernels.sparse_mla_decode.mosaic_gpu.TuningConfig` (mosaic_gpu); ignored
        by the reference.

    Returns:
      out: [N, h_q, v_width] (or [N, s_q, h_q, v_width]) in q's dtype;
      lse: float32 [N, h_q] (or [N, s_q, h_q]), natural-log sum of exp of the scaled scores.
      A row with no valid entry gives out = 0 and lse = -inf. Masked entries are never
      read, on every backend: a NaN or Inf in a row that no entry of query row t selects
      cannot reach row t's outputs. A NaN in q[.., h, :] (or in a selected row) gives NaN
      out and NaN lse for that head wherever the row has a valid entry (lse = -inf only
      ever means "no valid entry").
    """
    _checks.validate_attention(q, kv_cache, attention_rows, sm_scale, v_width, kv_format)
    sm_scale = float(sm_scale)
    v_width = int(v_width)
    lead = tuple(q.shape[:-2])
    h_q, width = q.shape[-2:]
    q_rows = q.reshape(-1, h_q, width)
    rows = attention_rows.reshape(-1, attention_rows.shape[-1])
    kv_rows = kv_cache.reshape(-1, kv_cache.shape[-1])
    kw = {"sm_scale": sm_scale, "v_width": v_width, "kv_format": kv_format}
    backend = _registry.select("sparse_mla_decode", backend, q_rows, kv_rows, rows, **kw)
    attend = _registry.implementation("sparse_mla_decode", backend)
    if backend == "reference":
        out, lse = attend(q_rows, kv_rows, rows, **kw)
    else:
        out, lse = attend(q_rows, kv_rows, rows, tuning=config, **kw)
    return out.reshape(*lead, h_q, v_width), lse.reshape(*lead, h_q)
