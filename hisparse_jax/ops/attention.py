"""Sparse MLA decode attention over the resolver's flat rows: `sparse_mla_decode`.

The resolver hands attention one flat device row per selected token (-1 = invalid); this op
consumes that contract. One latent KV "head" is shared by all query heads (MQA, DeepSeek-V3.2
absorbed MLA: each row is 512 latent + 64 rope dims, the value is the first `v_width` dims).

Backends (`backend=`, through `hisparse_jax.ops._registry`):
  "reference":  jnp gather + float32 softmax (`pallas_kernels/sparse_mla_decode/reference.py`);
                any platform, bf16/f16/f32.
  "triton":     Pallas kernel through the Triton lowering (`.../triton.py`): vector-index row
                gathers; bf16/f16, v_width a power of two and the rest of the row power-of-two
                pieces (576 = 512 + 64). The default on a GPU over bf16 rows (and over fp8
                rows where the row-copy kernel cannot run) when it supports the inputs.
  "mosaic_gpu": Pallas Mosaic GPU kernels with wgmma; Hopper GPUs, jax >= 0.11. bf16 rows
                (opt-in): the TMA-box kernel (`.../mosaic_gpu.py`; bf16/f16, D a multiple of
                64, v_width a multiple of 128), or with a `mosaic_gpu_fp8.RowTuning` config the
                row-copy kernel (`.../mosaic_gpu_fp8.py`: one bulk copy per row, rewritten
                into the wgmma layout in shared memory; bf16 q, D 576, v_width 512);
                fp8_ds_mla rows: the row-copy kernel.
  None:         on a GPU, fp8_ds_mla rows: "mosaic_gpu" where it runs (a Hopper GPU, jax >=
                0.11), else "triton"; bf16 rows: "triton"; either only if it supports the
                inputs, else "reference". Off a GPU, "reference".

KV row formats (`kv_format=`, `pallas_kernels/kv_format.py`, `docs/kv_format.md`): "bf16" (rows
of q's float dtype) on every backend; "fp8_ds_mla" (uint8[656] rows: fp8 latent with 4
float32 scales, bf16 rope) on "reference", "triton" and "mosaic_gpu" (its row-copy kernel).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from hisparse_jax.ops import _checks, _registry, _values
from hisparse_jax.ops.copies import check_plan


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
    validate: bool | None = None,
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
      attention_rows: int32 [N, K] (or [N, s_q, K]): flat row per selected token, -1 (any
        negative) = masked, anywhere in the row; the others must be < R = num_blocks * B.
        An entry >= R is masked as -1 is, on every backend (never read past the cache).
      sm_scale: softmax scale (static Python float), e.g. 1 / sqrt(192) for DSV3.2.
      v_width: value width, the leading `v_width` dims of a row (512); with "fp8_ds_mla"
        at most 512 (the value is the dequantized latent part; the triton kernel takes
        multiples of 128).
      kv_format: "bf16" (rows stored in q's float dtype) or "fp8_ds_mla" (rows quantized
        by `pallas_kernels.kv_format.quantize`, dequantized inside attention; q bfloat16
        for the triton kernel, any float q for the reference).
      backend: "reference", "triton", "mosaic_gpu" or None (module docstring).
      config: optional tuning of the kernel that runs:
        `pallas_kernels.sparse_mla_decode.triton.AttentionTuning` (triton),
        `pallas_kernels.sparse_mla_decode.mosaic_gpu.TuningConfig` (mosaic_gpu, bf16 rows,
        the TMA-box kernel) or `pallas_kernels.sparse_mla_decode.mosaic_gpu_fp8.RowTuning`
        (mosaic_gpu, the row-copy kernel: fp8_ds_mla rows, and bf16 rows when given);
        ignored by the reference.
      validate: None (default): a concrete attention_rows (outside jax.jit) with an entry
        >= R raises a ValueError naming it (the call waits for the array to reach the host);
        traced, nothing more is checked (the kernels mask such entries). True: the same
        host check, a ValueError when traced. False: no check.

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
    flat, kw, unflatten = _flat_rows(q, kv_cache, attention_rows, sm_scale, v_width, kv_format)
    backend = _registry.select("sparse_mla_decode", backend, *flat, **kw)
    _check_rows(validate, "sparse_mla_decode", attention_rows, kv_cache)
    attend = _registry.implementation("sparse_mla_decode", backend)
    if backend != "reference":
        kw["tuning"] = config
    return unflatten(*attend(*flat, **kw))


def runs_with_copies(q: jax.Array, kv_cache: jax.Array, attention_rows: jax.Array, *,
                     sm_scale: float, v_width: int = 512, kv_format: str = "bf16",
                     backend: str | None = None) -> bool:
    """Whether `sparse_mla_decode_with_copies` with these attention arguments runs as one
    launch (True) or as its parts, the copies and then `sparse_mla_decode` (False):
    `_registry.runs_fused` with the attention's operands, so that backend None follows the
    attention's own default (the Mosaic GPU row-copy kernel over fp8_ds_mla rows on a Hopper
    GPU, which has no fused launch)."""
    flat, kw, _ = _flat_rows(q, kv_cache, attention_rows, sm_scale, v_width, kv_format)
    return _registry.runs_fused("sparse_mla_decode_with_copies", backend, *flat, **kw)


def _flat_rows(q, kv_cache, attention_rows, sm_scale, v_width, kv_format):
    """The kernels' operands of validated attention inputs: ((q [T, h_q, D], kv rows [R, Ws],
    rows [T, K]), the static keywords, and a function that gives (out, lse) of those
    operands the leading dims of q ([N] or [N, s_q]))."""
    lead = tuple(q.shape[:-2])
    h_q, width = q.shape[-2:]
    flat = (q.reshape(-1, h_q, width), kv_cache.reshape(-1, kv_cache.shape[-1]),
            attention_rows.reshape(-1, attention_rows.shape[-1]))
    kw = {"sm_scale": float(sm_scale), "v_width": int(v_width), "kv_format": kv_format}

    def unflatten(out, lse):
        return out.reshape(*lead, h_q, int(v_width)), lse.reshape(*lead, h_q)

    return flat, kw, unflatten


def _check_rows(validate, op: str, attention_rows, kv_cache) -> None:
    """The host check of attention_rows' values, where `validate` asks for it (traced rows
    need none: the kernels mask an entry outside the cache)."""
    if _values.mode(validate, op, (("attention_rows", attention_rows),)) == "host":
        _values.attention_host(attention_rows, kv_cache.size // kv_cache.shape[-1])


def sparse_mla_decode_with_copies(
    q: jax.Array,
    kv_cache: jax.Array,
    attention_rows: jax.Array,
    host_pools: Sequence[jax.Array],
    kv_caches: Sequence[jax.Array],
    swap_src: jax.Array,
    swap_dst: jax.Array,
    swap_counts: jax.Array,
    *,
    sm_scale: float,
    v_width: int = 512,
    kv_format: str = "bf16",
    copy_programs: int = 32,
    backend: str | None = None,
    config: Any = None,
    validate: bool | None = None,
) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
    """`sparse_mla_decode(q, kv_cache, attention_rows)` together with another index group's
    copies from host, `gather_compact_group(host_pools, kv_caches, swap_src, swap_dst,
    swap_counts)`: the "triton" backend runs both in ONE launch, `copy_programs` programs
    moving the rows (bound by PCIe) beside the attention's programs (bound by HBM and the
    tensor cores), so the two overlap on the GPU whatever XLA does with separate kernels; the
    "reference" runs the copy, then the attention. Same results as the two ops.

    kv_caches are other layers' caches (they must not hold kv_cache's buffer: the copies
    would race with the attention's reads); donate them at the jit boundary (updated in
    place). Arguments as in the two ops (validate: both ops' value rules); copy_programs: a
    static int >= 1.

    Returns:
      (out, lse, the updated kv_caches as a tuple).
    """
    _checks.validate_attention(q, kv_cache, attention_rows, sm_scale, v_width, kv_format)
    host_pools, kv_caches = tuple(host_pools), tuple(kv_caches)
    _checks.validate_group(host_pools, kv_caches)
    _checks.validate_swap_plan(swap_src, swap_dst, swap_counts)
    copy_programs = _checks.check_static_int("copy_programs", copy_programs, minimum=1)
    flat, kw, unflatten = _flat_rows(q, kv_cache, attention_rows, sm_scale, v_width, kv_format)
    backend = _registry.select("sparse_mla_decode_with_copies", backend, *flat, **kw)
    _check_rows(validate, "sparse_mla_decode_with_copies", attention_rows, kv_cache)
    if kv_caches:
        check_plan(validate, "sparse_mla_decode_with_copies", swap_src, swap_dst, swap_counts,
                   kv_caches[0].size // kv_caches[0].shape[-1])
    run = _registry.implementation("sparse_mla_decode_with_copies", backend)
    if backend != "reference":
        kw.update(tuning=config, copy_programs=copy_programs)
    out, lse, caches = run(*flat, host_pools, kv_caches, swap_src, swap_dst, swap_counts, **kw)
    return (*unflatten(out, lse), tuple(caches))
