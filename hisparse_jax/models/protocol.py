"""`ServedModel`: what a model implements to be served by the engine (`hisparse_jax.engine`).

The engine knows no model class. It takes any Flax NNX module with a `spec` (`ModelSpec`,
the static facts it sizes its parts by) and the methods below, and calls them inside its
jitted steps with the module merged from its parameters (`nnx.split` / `nnx.merge` at the
jit boundary), so they must be traceable and keep no state in module variables: caches go
in and come out as data.

The caches: `DecodeCache` = the KV-cache handle (`hisparse_jax.cache.HiSparseKVCache`,
which the engine builds from the spec: one device KV cache per layer, one hot state per
index group) + the model's own per-seat arrays `index_keys` (built by `init_index_keys`).
A layer stores its new KV row through the handle (`kv.write` in decode, `kv.write_rows` in
a one-shot prefill) and finds the device rows of the positions it attends to through it
(`kv.lookup(group, topk, batch.kv)`, once per index group per step, after choosing the
group's top-k); where those rows live (resident pages, or a hot region filled from the
pinned host pool) is the handle's business. Shapes: S seats (state rows), N decode batch
rows, T padded prompt or chunk tokens, P = ceil(max_model_len / block_size) pages, K top_k,
W = kv_lora_rank + rope_dim values per KV row, V vocab.

Methods (all return `(logits, cache, aux)`; `attention_backend` and `collect_attention` are
passed through from `EngineConfig`; `aux` is a dict of arrays):

  * `init_index_keys(max_seats, max_model_len, *, external_topk)` -> tuple of arrays: the
    model's per-seat arrays beside the KV rows (an indexer's key cache per index group, or
    empty). Each is [S, max_model_len, ...] (seat, position, anything), or any placeholder
    when `external_topk` (the top-k then comes from `DecodeBatch.topk` and the arrays are
    never read). The engine never reads their values: with prefix caching it copies the
    positions of whole pages out of one seat and into another, and its synthetic prefill
    (benchmarks) fills a prompt's positions with unit-normal values.
  * `prefill(cache, tokens, length, state_row, write_rows)`: one request's prompt,
    tokens int32[T] (the first `length` real), KV rows written to the flat device rows
    write_rows int32[T] (-1: not written; `kv.write_rows`), per-seat arrays at seat
    `state_row` (int32 scalar; out of range: dropped). logits float32[V] of the last real
    token. aux may hold "attention" [L, h, v] (collect_attention).
  * `prefill_chunk(cache, tokens, start, length, state_row, pages, *, host_pages=None,
    host_pools=())`: prompt tokens at positions [start, start + T) of the request at
    `state_row` whose resident block-table row is pages int32[P] (every page up to the last
    real position resident; earlier chunks' rows are read through it). logits as prefill.
    With host_pages int32[P] (the host block-table row) and host_pools (the pinned pool's
    arrays), pages before the chunk may be host-only (`EngineConfig.prefill.prefix_hit_pages`
    "stage"); aux must then hold "staged_rows_host" / "staged_rows_device" (rows per layer:
    int32 scalars summed over the index groups when the groups are equal in size, else
    int32[G], one count per group, which the engine weighs by the group's layer count).
    A model that cannot stage raises ValueError when given host_pages.
  * `decode(cache, batch)`: one token per batch row, batch a `DecodeBatch` (tokens
    int32[N], `batch.kv` the handle's `CacheBatch`: state rows (-1: padding, writes and
    selects nothing), positions, block-table rows, host pools; `batch.topk` int32[G, N, K]
    from an external source, or None: select with the model's own indexer). With
    speculative verification `batch.kv.rows_per_request` = r > 1: r adjacent rows of one
    seat at consecutive positions, each attending causally. logits float32[N, V]. aux
    must hold "hits" and "misses" (the `Lookup.hits` / `Lookup.misses` of the step's
    lookups, summed by the engine: int32 arrays of any shape when the index groups are equal
    in size, else a leading dim G, one entry per group: a miss moves one row per layer of
    its group), "hidden" [N, H] when the model
    drafts (the last hidden state `draft` reads), and "attention" [L, N, h, v] with
    collect_attention.
  * `draft(hidden, tokens, num_tokens)` (optional: `spec.has_draft`): greedy drafts
    int32[N, num_tokens] for positions t + 2 .. from decode's aux "hidden" [N, H] of
    position t and the tokens int32[N] at t + 1 (a multi-token-prediction module; read by
    `hisparse_jax.draft_sources.MTPDraft`).
  * `tensor_parallel_dim(path, shape)` (optional, `MeshEngine`): the dim of the parameter
    at `path` ("blocks.0.attn.wq_a.kernel") of `shape` that the mesh's model axis splits,
    or None (replicated). Without it every parameter is replicated.
  * `for_mesh(mesh, axis)` (optional, `MeshEngine`): the model to run on `mesh` with its
    parameters split over `axis` as `tensor_parallel_dim` says (a copy sharing the arrays,
    e.g. with a mixture of experts' expert computation split over `axis`; static
    configuration only). Without it the engine runs the model as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from hisparse_jax.cache import CacheBatch, HiSparseKVCache


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The static facts of a model that the engine reads (hashable).

    Attributes:
      name: shown in messages and summaries.
      vocab_size: V; token ids are in [0, V).
      num_layers: L, layers with a KV cache (one device cache per layer).
      group_layers: the layer count of each index group, in layer order (sum L): a group's
        layers share one top-k lookup and one hot state (GLM-5: a "full" indexer layer
        and the "shared" layers after it). Groups may differ in size; the host pool's
        packing then holds gcd(group_layers) layers per array.
      top_k: K, positions each query row selects per group.
      kv_lora_rank: the first values of a KV row (the latent, MLA's value width); a row is
        kv_lora_rank + rope_dim values (`row_width`). A model whose rows are not MLA latents
        sets rope_dim 0 and kv_lora_rank to its row width.
      rope_dim: the last values of a KV row (the rotary part).
      num_heads: query heads of the attention (the platform check's call shapes).
      sm_scale: the attention's score scale (the platform check's call).
      kv_dtype: the float type KV rows are computed in.
      has_draft: the model implements `draft` (multi-token-prediction drafts).
    """

    name: str
    vocab_size: int
    num_layers: int
    group_layers: tuple[int, ...]
    top_k: int
    kv_lora_rank: int
    rope_dim: int
    num_heads: int
    sm_scale: float
    kv_dtype: Any = "bfloat16"
    has_draft: bool = False

    def __post_init__(self) -> None:
        for field in ("vocab_size", "num_layers", "top_k", "kv_lora_rank", "num_heads"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelSpec.{field} must be a positive int, got {value!r}")
        if not isinstance(self.rope_dim, (int, np.integer)) or self.rope_dim < 0:
            raise ValueError(f"ModelSpec.rope_dim must be an int >= 0, got {self.rope_dim!r}")
        groups = tuple(self.group_layers)
        if not groups or any(not isinstance(n, (int, np.integer)) or n < 1 for n in groups):
            raise ValueError(f"ModelSpec.group_layers must be positive layer counts, got "
                             f"{self.group_layers!r}")
        if sum(groups) != self.num_layers:
            raise ValueError(f"ModelSpec.group_layers {groups} must add up to num_layers="
                             f"{self.num_layers}")
        object.__setattr__(self, "group_layers", groups)
        try:
            jnp.dtype(self.kv_dtype)
        except TypeError as e:
            raise ValueError(f"ModelSpec.kv_dtype is not a dtype: {self.kv_dtype!r}") from e

    @classmethod
    def equal_groups(cls, *, num_layers: int, index_group_size: int, **fields: Any
                     ) -> ModelSpec:
        """A spec whose layers form index groups of `index_group_size` layers each."""
        if index_group_size < 1 or num_layers % index_group_size:
            raise ValueError(f"num_layers={num_layers} must be a multiple of "
                             f"index_group_size={index_group_size}")
        return cls(num_layers=num_layers,
                   group_layers=(index_group_size,) * (num_layers // index_group_size), **fields)

    @property
    def row_width(self) -> int:
        """W, values of one KV row: kv_lora_rank + rope_dim."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def num_groups(self) -> int:
        return len(self.group_layers)

    @property
    def index_group_size(self) -> int:
        """Layers per index group; ValueError when the groups differ in size (there is no
        one size then: read `group_layers`)."""
        if len(set(self.group_layers)) != 1:
            raise ValueError(f"model {self.name!r} has index groups of {self.group_layers} "
                             "layers, not groups of equal size: read group_layers")
        return self.group_layers[0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeCache:
    """Device-side cache state of a served model (a pytree; donate it at the jit boundary).

    Attributes:
      kv: the KV-cache handle: per-layer latent KV caches [num_blocks, B, Ws] (rows stored in
        its `kv_format`) and per-group hot states, with the residency that serves lookups.
      index_keys: the model's per-seat arrays (`ServedModel.init_index_keys`), e.g. per
        index group the indexer key cache [S, max_model_len, index_dim] indexed by state row
        and position.
    """

    kv: HiSparseKVCache
    index_keys: tuple[jax.Array, ...]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeBatch:
    """One decode step's inputs for N batch rows (seats).

    Attributes:
      tokens: int32[N], the input token of each batch row (anything on padding rows).
      kv: the handle's per-step inputs (state rows, -1 padding; positions written this step;
        the rows' block tables; the pinned host pools).
      topk: optional int32[G, N, top_k] positions per index group from an external source
        (`hisparse_jax.topk_sources`); when given, the model's own selection is skipped.
    """

    tokens: jax.Array
    kv: CacheBatch
    topk: jax.Array | None = None


@runtime_checkable
class ServedModel(Protocol):
    """A model the engine serves (module docstring: shapes, returns, aux keys)."""

    spec: ModelSpec

    def init_index_keys(self, max_seats: int, max_model_len: int, *, external_topk: bool
                        ) -> tuple[jax.Array, ...]: ...

    def prefill(self, cache: DecodeCache, tokens: jax.Array, length: jax.Array,
                state_row: jax.Array, write_rows: jax.Array, *,
                attention_backend: str | None = None, collect_attention: bool = False
                ) -> tuple[jax.Array, DecodeCache, dict]: ...

    def prefill_chunk(self, cache: DecodeCache, tokens: jax.Array, start: jax.Array,
                      length: jax.Array, state_row: jax.Array, pages: jax.Array, *,
                      host_pages: jax.Array | None = None,
                      host_pools: Sequence[jax.Array] = (),
                      attention_backend: str | None = None, collect_attention: bool = False
                      ) -> tuple[jax.Array, DecodeCache, dict]: ...

    def decode(self, cache: DecodeCache, batch: DecodeBatch, *,
               attention_backend: str | None = None, collect_attention: bool = False
               ) -> tuple[jax.Array, DecodeCache, dict]: ...


def check_served_model(who: str, model: Any) -> ModelSpec:
    """`model`'s spec when it is a Flax NNX module implementing `ServedModel`; ValueError
    naming `who` and what is missing otherwise."""
    if not isinstance(model, nnx.Module):
        raise ValueError(f"{who} model must be a Flax NNX module implementing "
                         f"hisparse_jax.models.ServedModel, got {type(model).__name__}")
    spec = getattr(model, "spec", None)
    if not isinstance(spec, ModelSpec):
        raise ValueError(f"{who} model {type(model).__name__} must have a `spec` "
                         f"(hisparse_jax.models.ModelSpec), got {type(spec).__name__}")
    missing = [m for m in ("init_index_keys", "prefill", "prefill_chunk", "decode")
               if not callable(getattr(model, m, None))]
    if spec.has_draft and not callable(getattr(model, "draft", None)):
        missing.append("draft (its spec has has_draft=True)")
    if missing:
        raise ValueError(f"{who} model {type(model).__name__} does not implement "
                         f"hisparse_jax.models.ServedModel: no {', '.join(missing)}")
    return spec


MODEL_AXIS = "model"
"""The mesh axis the tensor-parallel and expert-parallel splits use (`MeshEngine`'s)."""


def path_name(path: Sequence[Any]) -> str:
    """The dotted name of a parameter's pytree path ("blocks.1.attn.wq_b.kernel.value")."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                    for k in path)


def partition_spec(rule: Callable[[str, tuple[int, ...]], int | None] | None, name: str,
                   shape: tuple[int, ...], axis: str, size: int) -> P:
    """The spec of parameter `name` of `shape`: its `rule(name, shape)` dim split over
    `axis` (of `size` devices), everything else replicated.

    Raises:
      ValueError: `size` does not divide the dim it splits (naming the parameter).
    """
    dim = None if rule is None else rule(name, tuple(shape))
    if dim is None:
        return P()
    if shape[dim] % size:
        raise ValueError(f"the mesh's model axis ({size}) must divide dim {dim} of "
                         f"parameter {name} {tuple(shape)} (its tensor-parallel split)")
    spec: list[str | None] = [None] * len(shape)
    spec[dim] = axis
    return P(*spec)


def partition_specs(model: Any, size: int, axis: str = MODEL_AXIS) -> list[P]:
    """`partition_spec` of each parameter leaf of `model` (`jax.tree.flatten` order of its
    `nnx.State`; concrete or abstract leaves) by its `tensor_parallel_dim`; every leaf is
    replicated when the model has none."""
    _, params = nnx.split(model)
    rule = getattr(model, "tensor_parallel_dim", None)
    return [partition_spec(rule, path_name(path), tuple(leaf.shape), axis, size)
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]]
