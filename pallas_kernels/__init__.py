"""Pallas GPU kernels of hisparse-jax, one folder per op, each kernel beside its jnp reference.

  resolve_residency/         reference.py, triton.py
  gather_compact/            reference.py, triton.py  (gather_compact and the multi-layer,
                                                        one-launch gather_compact_group)
  mirror_rows/               reference.py, triton.py
  invalidate_written_rows/   reference.py, triton.py
  stage_prefill_rows/        reference.py, triton.py  (a prefill chunk's selected rows into
                                                        every layer's staging buffer, one launch)
  sparse_mla_decode/         reference.py, triton.py, mosaic_gpu.py (jax >= 0.11 only)
  grouped_matmul/            reference.py, triton.py, mosaic_gpu.py (jax's Hopper kernel,
                                                        wrapped; Hopper GPUs only)

In each module the entry function is named after the op and takes the arguments of the
reference; a kernel module adds the keywords `interpret` (True off the GPU: the same kernel
runs in the Pallas interpreter) and `tuning` (its tuning dataclass; `DEFAULT` when omitted)
and a `supports(...)` that returns None when the kernel can run the inputs, else the reason.
Shared pieces: `_triton.py` (Triton-lowering helpers), `_rows.py` (position -> flat row
through a block table), `_compat.py` (every jax-version difference), `kv_format.py` (the KV
row formats "bf16" and "fp8_ds_mla": the 656-byte row layout, quantize / dequantize;
`docs/kv_format.md`).

This package imports only jax, numpy and itself, and knows nothing of the host-tier
coordinator; the validated public ops and the backend registry live in `hisparse_jax.ops`.
"""
