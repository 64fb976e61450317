"""`HiSparseKVCache`: the KV-cache handle of HiSparse (the counterpart of vLLM's
HiSparseCacheHandle), passed into a model's step and returned by it, never module state.

A model layer needs two things from its KV cache in a decode step: store the row of the
token it computes (`write`) and find the device rows of the positions it attends to
(`lookup`). Where those rows live is the handle's business, decided by its residency type
(static: each type traces its own step):

  * `AllResident`: every row a step reads is in a resident page; positions map straight
    through the resident block table (no host tier; also the engine's fast path when every
    scheduled request's pages are resident).
  * `HiSparse`: resident pages plus a per-request hot region, an LRU over host rows. A lookup
    drops stale hot copies of the rows this step wrote (`invalidate_written_rows`), resolves
    the top-k once per index group (`resolve_residency`) and copies the misses from the
    pinned host pools into every layer of the group (`gather_compact_group`).
  * `NaiveOffload`: the baseline without reuse: the hot state is emptied before every
    resolve, so every selected row that is not resident is copied from host again.

The residency semantics (which row a position reads, when a hot slot is valid) are in
`docs/semantics.md`.

Data and shapes (N batch rows, S state rows, P pages per request, Hb hot pages, K top-k,
B rows per page, W row width, Ws stored row width):

  * Row format (`HiSparseKVCache.kv_format`, `docs/kv_format.md`): "bf16" stores each row as
    its W values (kv_dtype; Ws = W); "fp8_ds_mla" stores uint8[656] rows (Ws = 656: fp8
    latent with one float32 scale per 128 values, bf16 rope). Rows are quantized where they
    are written (`write` / `write_rows`, through `encode`); copies move the stored bytes
    unchanged, and attention dequantizes them (pass `kv_format` to `sparse_mla_decode`), so
    every residency reads the same values.
  * `HiSparseKVCache.caches[l]`: [num_blocks, B, Ws] (storage dtype), layer l's device KV cache:
    resident pages and hot regions of every request; flat row r is `[r // B, r % B]`; block 0
    is the null block (never read through a table). Donated with the cache at a jit boundary.
  * `HiSparseKVCache.hot[g]`: the `HotState` (int32/int16[S, H], and the position map
    int16[S, P] when the config keeps one) of index group g: group g is layers
    [offset_g, offset_g + n_g) (`HiSparseKVCache.group_sizes`; the groups may differ in
    size, e.g. GLM-5's (1, 2, 2): a layer with an indexer, then layers reusing its top-k).
  * `CacheBatch`: per-step inputs, read only: state_rows int32[N] (-1: padding row),
    positions int32[N] (the position each batch row writes this step), the batch rows'
    block-table rows src / res int32[N, P] and hot int32[N, Hb] (0: null block), and the
    per-layer pinned host pools [host_blocks, B, Ws] (kept out of the donated cache: a spill
    writes them after the step).
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp

from hisparse_jax.config import HiSparseConfig
from hisparse_jax.index_groups import (
    checked_group_layers,
    equal_group_layers,
    group_sizes,
    layer_group,
    layers_per_pool_array,
)
from hisparse_jax.index_groups import group_slice as _group_slice
from hisparse_jax.ops import (
    gather_compact_group,
    invalidate_written_rows,
    resolve_residency,
    sparse_mla_decode,
    sparse_mla_decode_with_copies,
)
from hisparse_jax.ops.attention import runs_with_copies
from hisparse_jax.state import HotState, empty_like, init_hot_state
from pallas_kernels import kv_format as kvf
from pallas_kernels._rows import flat_rows

_STATIC = {"static": True}


def write_cache_rows(cache: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """cache[row] := values for rows >= 0; cache [num_blocks, B, W], rows int32[T] (flat rows),
    values [T, W] (cast to the cache's dtype). Rows must be distinct where >= 0."""
    flat = cache.reshape(-1, cache.shape[-1])
    idx = jnp.where(rows >= 0, rows, flat.shape[0])
    return flat.at[idx].set(values.astype(cache.dtype), mode="drop").reshape(cache.shape)


# --------------------------------------------------------------------------- residency types


@dataclasses.dataclass(frozen=True)
class AllResident:
    """Every row is read from a resident page: positions map through the resident table."""

    name: ClassVar[str] = "all-resident"
    reads_host: ClassVar[bool] = False  # lookups never read the host pools
    resident_fast_path: ClassVar[bool] = True

    def lookup(self, cache: HiSparseKVCache, group: int, topk: jax.Array,
               batch: CacheBatch, *, ahead: bool = False) -> tuple[HiSparseKVCache, Lookup]:
        del group, ahead  # nothing to copy
        rows = flat_rows(batch.res, topk, cache.block_size)
        rows = jnp.where(batch.live[:, None], rows, -1)
        zeros = jnp.zeros(topk.shape[:1], jnp.int32)
        return cache, Lookup(rows, zeros, zeros)


@dataclasses.dataclass(frozen=True)
class HiSparse:
    """Resident pages plus per-request hot regions over the pinned host pools.

    With several query rows per request (`CacheBatch.rows_per_request` > 1, speculative
    verification) the request's rows are resolved as one pass over the union of their
    positions (`resolve_residency(query_rows_per_request=r)`). `per_row=True` is the ablation:
    one resolve-and-copy pass per row index, in row order (the LRU moves r times per step; a
    later row may evict what an earlier row of the same step attends to unless the hot region
    holds r * top_k rows beyond the previous step's, which the default size does).
    """

    per_row: bool = False

    name: ClassVar[str] = "hisparse"
    reads_host: ClassVar[bool] = True
    # A step whose scheduled requests have every page resident may run as `AllResident`.
    resident_fast_path: ClassVar[bool] = True

    def lookup(self, cache: HiSparseKVCache, group: int, topk: jax.Array,
               batch: CacheBatch, *, ahead: bool = False
               ) -> tuple[HiSparseKVCache, Lookup | PendingLookup]:
        written = jnp.where(batch.live, flat_rows(batch.src, batch.positions, cache.block_size),
                            -1)
        hot = invalidate_written_rows(cache.hot[group], batch.state_rows, written,
                                      backend=cache.ops_backend)
        r = batch.rows_per_request
        if not self.per_row or r == 1:
            return cache._resolve_and_gather(group, hot, topk, batch, ahead=ahead)
        lookups = []
        for i in range(r):  # the ablation: one pass per row index, in order
            cache, found = cache._resolve_and_gather(group, hot, topk[i::r], batch.rows(i))
            hot = cache.hot[group]
            lookups.append(found)
        rows = jnp.stack([f.attention_rows for f in lookups], 1).reshape(topk.shape)
        return cache, Lookup(rows, sum(f.hits for f in lookups),
                             sum(f.misses for f in lookups))


@dataclasses.dataclass(frozen=True)
class NaiveOffload:
    """The naive-offload baseline: every non-resident selected row is copied every step."""

    name: ClassVar[str] = "naive-offload"
    reads_host: ClassVar[bool] = True
    resident_fast_path: ClassVar[bool] = False  # the baseline always reads through the host

    def lookup(self, cache: HiSparseKVCache, group: int, topk: jax.Array,
               batch: CacheBatch, *, ahead: bool = False
               ) -> tuple[HiSparseKVCache, Lookup | PendingLookup]:
        return cache._resolve_and_gather(group, empty_like(cache.hot[group]), topk, batch,
                                         ahead=ahead)


Residency = AllResident | HiSparse | NaiveOffload


def _replace(items: tuple, index: int, value) -> tuple:
    """`items` with entry `index` replaced by `value`."""
    return (*items[:index], value, *items[index + 1:])


# --------------------------------------------------------------------------- pytrees


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Lookup:
    """Result of `HiSparseKVCache.lookup` for N batch rows and K selected positions.

    Attributes:
      attention_rows: int32[N, K], flat device row of each selected position in the layer
        caches of the group (-1: masked: no entry, past the context, or a padding row).
      hits: int32[N], selected rows found in the hot region (0 for `AllResident`).
      misses: int32[N], selected rows copied from host this step (0 for `AllResident`).
    """

    attention_rows: jax.Array
    hits: jax.Array
    misses: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingLookup:
    """Result of `HiSparseKVCache.lookup_ahead`: a lookup whose copies from host may not have
    run yet. `HiSparseKVCache.land` completes it and returns its `Lookup`; attend only through
    that.

    Attributes:
      group: the index group looked up (static).
      found: the `Lookup` (its rows are valid in the caches once landed).
      plan: with `HiSparseKVCache.copy_with_attention`, the copies not yet run, as the swap
        plan (swap_src, swap_dst, swap_counts): `HiSparseKVCache.attend` runs them beside
        an attention, or `land` runs them; None once run (or with nothing to copy).
    """

    group: int = dataclasses.field(metadata=_STATIC)
    found: Lookup
    plan: tuple[jax.Array, jax.Array, jax.Array] | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheBatch:
    """Per-step, read-only inputs of the handle for N batch rows (see the module docstring).

    Attributes:
      state_rows: int32[N], state row of each batch row, -1 for padding rows.
      positions: int32[N], the position whose row each batch row writes this step.
      src: int32[N, P], host block of each page (0: none).
      res: int32[N, P], resident device block of each page (0: read from host).
      hot: int32[N, Hb], device blocks of the hot region (0: none).
      host_pools: the pinned host pool's arrays: one per layer [host_blocks, B, Ws], or one
        per G consecutive layers side by side [host_blocks, B, G * Ws] (G dividing the index
        group size: `group_pools`); may be empty for lookups that never read the host
        (`AllResident`).
      rows_per_request: r (static): the batch rows come in groups of r adjacent rows of one
        request (one state row, consecutive positions: speculative verification), resolved
        together (`HiSparse`). A row of position -1 inside a live request writes nothing.
    """

    state_rows: jax.Array
    positions: jax.Array
    src: jax.Array
    res: jax.Array
    hot: jax.Array
    host_pools: tuple[jax.Array, ...] = ()
    rows_per_request: int = dataclasses.field(default=1, metadata=_STATIC)

    @classmethod
    def from_tables(cls, state_rows: jax.Array, positions: jax.Array, *, src: jax.Array,
                    res: jax.Array, hot: jax.Array, host_pools: Sequence[jax.Array] = (),
                    rows_per_request: int = 1) -> CacheBatch:
        """The batch rows' table rows gathered by `state_rows` from per-STATE-row tables
        src / res [S, P] and hot [S, Hb] (usable inside jit; padding rows read row 0)."""
        srow = jnp.where(state_rows >= 0, state_rows, 0)
        return cls(state_rows, positions, src[srow], res[srow], hot[srow], tuple(host_pools),
                   rows_per_request)

    def group_pools(self, group: int, group_layers: int | Sequence[int],
                    num_layers: int | None = None) -> tuple[jax.Array, ...]:
        """The pool arrays holding index group `group`'s layers, for the group copies.

        Args:
          group: the index group (group g: layers [offset_g, offset_g + n_g), offset_g the
            layers of the groups before it).
          group_layers: every group's layer count n_g (a tuple, in layer order), or an int:
            every group that many layers (group g: layers [g * n, (g + 1) * n)).
          num_layers: L (needed with an int group_layers; with a tuple, its sum when given).

        Raises:
          ValueError: the arrays do not split the layers into whole groups (their number
            must divide L, and the layers per array divide every group's size:
            `layers_per_pool_array`).
        """
        groups = group_sizes(group_layers, num_layers)
        total = sum(groups) if num_layers is None else num_layers
        pack = layers_per_pool_array(len(self.host_pools), total, group_layers
                                     if isinstance(group_layers, numbers.Integral) else groups)
        start = sum(groups[:group]) // pack
        return self.host_pools[start:start + groups[group] // pack]

    def rows(self, index: int) -> CacheBatch:
        """The batch of row `index` of every request (rows_per_request 1)."""
        r = self.rows_per_request
        return CacheBatch(self.state_rows[index::r], self.positions[index::r],
                          self.src[index::r], self.res[index::r], self.hot[index::r],
                          self.host_pools)

    @property
    def live(self) -> jax.Array:
        """bool[N]: the batch rows that serve a request."""
        return self.state_rows >= 0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HiSparseKVCache:
    """The KV-cache handle: device state (pytree leaves) and static layout (see the module
    docstring for shapes). Methods return a new handle; donate it at the jit boundary.

    Attributes:
      caches: per layer, the device KV cache [num_blocks, B, Ws] (stored rows).
      hot: per index group, the `HotState` of the hot regions (shared by the group's layers;
        unused by `AllResident` lookups).
      residency: `AllResident()`, `HiSparse()` or `NaiveOffload()` (static).
      block_size: B (static).
      index_group_size: layers per index group when the groups are of equal size (static):
        group g is layers [g * size, (g + 1) * size) and its lookup serves all of them. 0
        when `group_layers` gives groups of unequal size (derived from it then).
      group_layers: None (default: equal groups of index_group_size), or the layer count
        n_g of each index group in layer order (static; groups of unequal size, e.g. GLM-5's
        (1, 2, 2): a layer with an indexer, then the layers reusing its top-k): group g is
        layers [offset_g, offset_g + n_g), offset_g the layers of the groups before it.
        Equal counts are kept as index_group_size (one representation, one trace).
        `group_sizes` reads the layout either way.
      host_rows: rows of one layer's host pool (static); host rows >= it read as missing.
      ops_backend: backend of the data-plane ops (static; None: picked per platform).
      kv_format: the stored row format, "bf16" or "fp8_ds_mla" (static).
      copy_programs: None (default), or an int P >= 1 (static): at most P GPU programs move
        a lookup's copies from host (`gather_compact_group`), each looping over its share,
        instead of a program per chunk of every row's plan. Same results.
      copy_with_attention: False (default), or True (static): a
        `lookup_ahead` resolves but copies nothing; `attend` with its `PendingLookup` runs
        the copies in the attention's own launch (`sparse_mla_decode_with_copies`, by
        copy_programs programs, 32 when None) beside another layer's attention, so the PCIe
        wait overlaps that attention inside one kernel. `land` runs copies still pending.
        Same results.
    """

    caches: tuple[jax.Array, ...]
    hot: tuple[HotState, ...]
    residency: Residency = dataclasses.field(metadata=_STATIC)
    block_size: int = dataclasses.field(metadata=_STATIC)
    index_group_size: int = dataclasses.field(default=1, metadata=_STATIC)
    group_layers: tuple[int, ...] | None = dataclasses.field(default=None, metadata=_STATIC)
    host_rows: int = dataclasses.field(default=0, metadata=_STATIC)
    ops_backend: str | None = dataclasses.field(default=None, metadata=_STATIC)
    kv_format: str = dataclasses.field(default=kvf.BF16, metadata=_STATIC)
    copy_programs: int | None = dataclasses.field(default=None, metadata=_STATIC)
    copy_with_attention: bool = dataclasses.field(default=False, metadata=_STATIC)

    def __post_init__(self) -> None:
        # The layout has one representation: equal group_layers become index_group_size;
        # unequal ones set index_group_size to 0 (no common size).
        if self.group_layers is not None:
            groups = tuple(int(n) for n in self.group_layers)
            equal = len(set(groups)) == 1
            object.__setattr__(self, "group_layers", None if equal else groups)
            object.__setattr__(self, "index_group_size", groups[0] if equal else 0)

    @classmethod
    def create(cls, cfg: HiSparseConfig, *, num_layers: int, residency: Residency,
               index_group_size: int = 1, group_layers: Sequence[int] | None = None,
               ops_backend: str | None = None, copy_programs: int | None = None,
               copy_with_attention: bool = False) -> HiSparseKVCache:
        """Zero caches [cfg.num_gpu_blocks, B, cfg.storage_width] (cfg.storage_dtype) per
        layer and an empty hot state per index group; host_rows and kv_format from cfg (no
        host pool: host_rows 0). The groups: `group_layers` (each group's layer count, in
        layer order; e.g. a model's `ModelSpec.group_layers`) when given, else groups of
        `index_group_size` layers.

        Raises:
          ValueError: group_layers are not positive ints adding up to num_layers (or
            index_group_size does not divide num_layers, or both are given and differ),
            copy_programs is neither None nor an int >= 1, or copy_with_attention is not a
            bool.
        """
        if copy_programs is not None and (not isinstance(copy_programs, int)
                                          or isinstance(copy_programs, bool)
                                          or copy_programs < 1):
            raise ValueError(f"copy_programs must be None or an int >= 1, got {copy_programs!r}")
        if not isinstance(copy_with_attention, bool):
            raise ValueError(f"copy_with_attention must be a bool, got {copy_with_attention!r}")
        groups = checked_group_layers(num_layers, index_group_size, group_layers)
        num_blocks = cfg.require("num_gpu_blocks")
        shape = (num_blocks, cfg.block_size, cfg.storage_width)
        return cls(
            caches=tuple(jnp.zeros(shape, cfg.storage_dtype) for _ in range(num_layers)),
            hot=tuple(init_hot_state(cfg) for _ in groups),
            residency=residency, block_size=cfg.block_size, group_layers=groups,
            host_rows=cfg.host_rows, ops_backend=ops_backend, kv_format=cfg.kv_format,
            copy_programs=copy_programs, copy_with_attention=copy_with_attention)

    @property
    def num_layers(self) -> int:
        return len(self.caches)

    @property
    def group_sizes(self) -> tuple[int, ...]:
        """n_g, the layer count of each index group in layer order (sum: num_layers)."""
        if self.group_layers is not None:
            return self.group_layers
        return equal_group_layers(self.num_layers, self.index_group_size)

    @property
    def num_groups(self) -> int:
        """G, the index groups (one hot state and one lookup per step each)."""
        return len(self.group_sizes)

    def group_slice(self, group: int) -> slice:
        """The layers of index group `group`: [offset_g, offset_g + n_g)."""
        return _group_slice(self.group_sizes, group)

    def layer_group(self, layer: int) -> tuple[int, int]:
        """(g, i): layer `layer` is the i-th layer of index group g (i == 0: the group's
        first layer, which selects its top-k in a model with one indexer per group)."""
        return layer_group(self.group_sizes, layer)

    def group_pools(self, group: int, batch: CacheBatch) -> tuple[jax.Array, ...]:
        """The arrays of `batch.host_pools` holding index group `group`'s layers
        (`CacheBatch.group_pools` with this handle's groups)."""
        return batch.group_pools(group, self.group_sizes, self.num_layers)

    def with_residency(self, residency: Residency) -> HiSparseKVCache:
        """The same arrays under another residency type (another traced step variant)."""
        return dataclasses.replace(self, residency=residency)

    def encode(self, values: jax.Array) -> jax.Array:
        """Float rows [..., W] as the caches store them: cast to the caches' dtype ("bf16"),
        or `pallas_kernels.kv_format.quantize`d to uint8 [..., 656] ("fp8_ds_mla"). Use it
        for rows attention reads straight from a step's values (prefill), so that they are
        the values a later lookup reads."""
        if self.kv_format == kvf.FP8_DS_MLA:
            return kvf.quantize(values)
        return values.astype(self.caches[0].dtype)

    def write_rows(self, layer: int, rows: jax.Array, values: jax.Array) -> HiSparseKVCache:
        """Layer `layer`'s flat rows `rows` (int32[T], -1: skipped) := encode(values [T, W])."""
        caches = list(self.caches)
        caches[layer] = write_cache_rows(caches[layer], rows, self.encode(values))
        return dataclasses.replace(self, caches=tuple(caches))

    def write(self, layer: int, values: jax.Array, batch: CacheBatch) -> HiSparseKVCache:
        """Stores values [N, W] (encoded: `encode`), the row of each live batch row at
        `batch.positions`, in its resident page (through `batch.res`); padding rows write
        nothing."""
        rows = jnp.where(batch.live, flat_rows(batch.res, batch.positions, self.block_size), -1)
        return self.write_rows(layer, rows, values)

    def lookup(self, group: int, topk: jax.Array, batch: CacheBatch
               ) -> tuple[HiSparseKVCache, Lookup]:
        """The device rows of the selected positions topk int32[N, K] (-1: none; valid
        entries distinct per row, at most the position written this step) for every layer of
        index group `group`; `HiSparse` / `NaiveOffload` copy the misses into those layers'
        caches first. Call it once per group per step. Its results do not depend on the
        step's `write`s (those store resident rows, which no lookup reads or copies into), so
        it may come before or after them."""
        return self.residency.lookup(self, group, topk, batch)

    def lookup_ahead(self, group: int, topk: jax.Array, batch: CacheBatch
                     ) -> tuple[HiSparseKVCache, PendingLookup]:
        """`lookup` split in two, so that the copies from host may overlap other work:
        resolves now (the hot state moves now); `land` completes the lookup and returns its
        `Lookup`. With `copy_with_attention` the copies wait for `attend` (which runs them
        beside another group's attention) or `land`; without it they run at once, as in
        `lookup`. The results are the same either way."""
        cache, found = self.residency.lookup(self, group, topk, batch,
                                             ahead=self.copy_with_attention)
        if isinstance(found, PendingLookup):
            return cache, found
        return cache, PendingLookup(group, found)

    def land(self, pending: PendingLookup, batch: CacheBatch
             ) -> tuple[HiSparseKVCache, Lookup]:
        """Completes `lookup_ahead`'s `pending` (same batch): copies still pending (with
        `copy_with_attention`) run now, into the group's caches. Returns the handle and the
        group's `Lookup`."""
        if pending.plan is not None:
            return self._copy_group(pending.group, pending.plan, batch), pending.found
        return self, pending.found

    def attend(self, layer: int, q: jax.Array, attention_rows: jax.Array, batch: CacheBatch,
               *, sm_scale: float, v_width: int = 512, backend: str | None = None,
               pending: PendingLookup | None = None
               ) -> tuple[HiSparseKVCache, jax.Array, jax.Array, PendingLookup | None]:
        """`sparse_mla_decode` of q over layer `layer`'s cache at attention_rows (the handle's
        kv_format; backend as the op's). With a `pending` lookup of another index group whose
        copies have not run (`copy_with_attention`), they run in the same launch
        (`sparse_mla_decode_with_copies`), or before the attention where `backend` has no
        implementation of that op (the registry's fallback, `runs_with_copies`: backend None
        follows the attention's default for these inputs). Returns
        (handle, out, lse, pending with its copies done: `land` it before that group
        attends)."""
        kw = {"sm_scale": sm_scale, "v_width": v_width, "kv_format": self.kv_format,
              "backend": backend}
        if pending is None or pending.plan is None:  # no copies wait for an attention
            return (self, *sparse_mla_decode(q, self.caches[layer], attention_rows, **kw),
                    pending)
        if not runs_with_copies(q, self.caches[layer], attention_rows, **kw):
            cache, _ = self.land(pending, batch)       # its parts: the copies, the attention
            return (cache, *sparse_mla_decode(q, cache.caches[layer], attention_rows, **kw),
                    dataclasses.replace(pending, plan=None))
        group = pending.group
        layers = self.group_slice(group)
        if layers.start <= layer < layers.stop:
            raise ValueError(f"layer {layer} attends while its own index group {group}'s "
                             "copies are pending: land the lookup first")
        out, lse, copied = sparse_mla_decode_with_copies(
            q, self.caches[layer], attention_rows,
            self.group_pools(group, batch),
            self.caches[layers], *pending.plan, copy_programs=self.copy_programs or 32,
            validate=False, **kw)
        return (self._with_group_caches(group, copied), out, lse,
                dataclasses.replace(pending, plan=None))

    def _with_group_caches(self, group: int, caches: Sequence[jax.Array]) -> HiSparseKVCache:
        """The handle with index group `group`'s layer caches replaced by `caches`."""
        new = list(self.caches)
        new[self.group_slice(group)] = caches
        return dataclasses.replace(self, caches=tuple(new))

    def _copy_group(self, group: int, plan: tuple[jax.Array, jax.Array, jax.Array],
                    batch: CacheBatch) -> HiSparseKVCache:
        """The handle after the swap plan's copies from host into every layer of `group`
        (`gather_compact_group`)."""
        copied = gather_compact_group(
            self.group_pools(group, batch),
            self.caches[self.group_slice(group)], *plan, backend=self.ops_backend,
            copy_programs=self.copy_programs, validate=False)
        return self._with_group_caches(group, copied)

    def _resolve_and_gather(self, group: int, hot: HotState, topk: jax.Array,
                            batch: CacheBatch, *, ahead: bool = False
                            ) -> tuple[HiSparseKVCache, Lookup | PendingLookup]:
        resolution, hot = resolve_residency(
            hot, topk, state_rows=batch.state_rows, hot_block_table=batch.hot,
            source_block_table=batch.src, resident_block_table=batch.res,
            block_size=self.block_size, host_rows=self.host_rows, backend=self.ops_backend,
            query_rows_per_request=batch.rows_per_request, validate=False)
        found = Lookup(resolution.attention_rows, resolution.num_hits, resolution.swap_counts)
        plan = (resolution.swap_src, resolution.swap_dst, resolution.swap_counts)
        if ahead and self.copy_with_attention:  # the copies wait for `attend` or `land`
            cache = dataclasses.replace(self, hot=_replace(self.hot, group, hot))
            return cache, PendingLookup(group, found,
                                        plan=plan if resolution.swap_src.size else None)
        cache = self._copy_group(group, plan, batch)
        return dataclasses.replace(cache, hot=_replace(self.hot, group, hot)), found
