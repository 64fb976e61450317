"""The data-plane ops of hisparse-jax: one name per op, one backend registry.

  resolve_residency, Resolution    hot-region lookup + LRU update (`hot_region.py`)
  invalidate_written_rows          drop stale hot copies of rewritten rows (`hot_region.py`)
  gather_compact                   host pool -> device cache rows, one layer (`copies.py`)
  gather_compact_group             the same plan into every layer of an index group
  mirror_rows                      device cache -> host pool rows (`copies.py`)
  mirror_rows_group                the same row list into every layer's pool, one call
  restore_rows                     host -> device rows of the host tier's restores
  stage_prefill_rows, StagedRows   a prefill chunk's selected rows -> per-layer staging
                                   buffers, resident copy first, else host (`staging.py`)
  sparse_mla_decode                attention over the selected flat rows (`attention.py`)
  sparse_mla_decode_with_copies    the same, and in the same launch another index group's
                                   copies from host (`gather_compact_group`) beside it
  grouped_matmul                   rows sorted by group times their group's matrix: the
                                   MoE's token-expert pairs times their experts (`moe.py`)

Every op validates its arguments before any work (ValueError / TypeError naming the argument
and the rule); the index-taking ops check their index values as `validate=` says (default:
on the host for concrete arrays, checkify-able under jit, `sparse_mla_decode` masking rows
past the cache: `docs/semantics.md`, value checks), and every op takes `backend=`: one of
`BACKENDS` ("reference", "triton", "mosaic_gpu") or None (the best backend that supports the
inputs on a GPU, else "reference"); the rules are in `_registry.py`. Semantics of the
hot-region ops: `docs/semantics.md`; of the prefill staging copy: `docs/prefill_staging.md`.
KV rows come in two formats (`KV_FORMATS`, `pallas_kernels/kv_format.py`,
`docs/kv_format.md`): the copies move either as rows of any dtype (fp8_ds_mla rows are
uint8[656]); `sparse_mla_decode` takes `kv_format=`.
"""

from hisparse_jax.ops._registry import BACKENDS, registered_backends
from hisparse_jax.ops.attention import sparse_mla_decode, sparse_mla_decode_with_copies
from hisparse_jax.ops.copies import (
    gather_compact,
    gather_compact_group,
    mirror_rows,
    mirror_rows_group,
    restore_rows,
)
from hisparse_jax.ops.hot_region import Resolution, invalidate_written_rows, resolve_residency
from hisparse_jax.ops.moe import grouped_matmul
from hisparse_jax.ops.staging import StagedRows, stage_prefill_rows
from pallas_kernels.kv_format import KV_FORMATS

__all__ = [
    "BACKENDS",
    "KV_FORMATS",
    "Resolution",
    "StagedRows",
    "gather_compact",
    "gather_compact_group",
    "grouped_matmul",
    "invalidate_written_rows",
    "mirror_rows",
    "mirror_rows_group",
    "registered_backends",
    "resolve_residency",
    "restore_rows",
    "sparse_mla_decode",
    "sparse_mla_decode_with_copies",
    "stage_prefill_rows",
]
