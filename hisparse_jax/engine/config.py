"""`EngineConfig`: the serving knobs of the `Engine`, and the one `HiSparseConfig` they give."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import numpy as np

from hisparse_jax.cache import AllResident, HiSparse, NaiveOffload, Residency
from hisparse_jax.config import MAX_HOT_SIZE, HiSparseConfig
from hisparse_jax.draft_sources import DraftSource, MTPDraft
from hisparse_jax.ops import _registry
from hisparse_jax.topk_sources import TopKSource
from host_tier.sizes import cdiv, is_int, round_up
from pallas_kernels import kv_format as kvf

ATTENTION_OPS = ("sparse_mla_decode",)
"""The ops `EngineConfig.attention_backend` selects for."""
DATA_PLANE_OPS = ("resolve_residency", "invalidate_written_rows", "gather_compact_group",
                  "gather_compact", "mirror_rows", "stage_prefill_rows")
"""The ops `EngineConfig.ops_backend` selects for: the handle's lookup (invalidate, resolve,
gather), the transfer worker's copies (mirror; restores go through gather_compact) and the
prefill staging copy."""
PREFIX_HIT_PAGES = ("restore", "stage")
"""The values of `EngineConfig.prefix_hit_pages`."""


def _check_int(name: str, value: Any, *, minimum: int, optional: bool = False) -> None:
    if not is_int(value) or value < minimum:
        rule = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"EngineConfig.{name} must be {rule}{' or None' if optional else ''}, "
                         f"got {value!r}")


def _check_backend(name: str, backend: Any, ops: tuple[str, ...]) -> str | None:
    """`backend` normalised by the op registry ("pallas" -> "triton", DeprecationWarning);
    ValueError naming `EngineConfig.<name>` unless it is None or a backend of every op."""
    if backend is None:
        return None
    if not isinstance(backend, str):
        raise ValueError(f"EngineConfig.{name} must be a str or None, got {backend!r}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            normalised = _registry.normalize(backend)
    except ValueError:
        raise ValueError(f"EngineConfig.{name} must be one of {_registry.BACKENDS} or None, "
                         f"got {backend!r}") from None
    if normalised != backend:
        warnings.warn(f"EngineConfig.{name}={backend!r} is deprecated; use {normalised!r}",
                      DeprecationWarning, stacklevel=5)
    for op in ops:
        if normalised not in _registry.registered_backends(op):
            raise ValueError(f"EngineConfig.{name}={backend!r} has no implementation of {op} "
                             f"(its backends: {_registry.registered_backends(op)})")
    return normalised


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Serving knobs of the `Engine`.

    Attributes:
      max_seats: decode batch rows = hot-state rows = requests admitted at once.
      max_model_len: longest request (prompt + generated), in tokens.
      block_size: B, rows per page (host, resident and hot pages).
      hot_size: H, hot-region rows per request (default 2 * top_k, rounded up to B).
      num_gpu_blocks: device blocks per layer cache, null block included (default: enough to
        keep every seat all-resident, i.e. no pressure).
      num_host_blocks: host pool blocks, null block included (default: max_seats full-length
        requests plus one spare request).
      all_resident: no host tier: every row stays on the device (the baseline).
      naive_offload: the naive-offload baseline: pages leave the device as soon as their host
        copy completes and every selected row is copied from host every step (hot region of
        top_k rows, emptied before each step; no fast path).
      topk_source: take the decode top-k from this `TopKSource` instead of the indexer.
      synthetic_prefill: write deterministic random KV rows for the prompt instead of running
        the model over it (without `topk_source`, unit-normal index keys too, for the
        model's indexer to select from); the first generated token is the prompt's last
        token.
      prefill_bucket: prompts are padded to a multiple of this (bounds prefill compiles).
      attention_backend / ops_backend: `sparse_mla_decode` / data-plane op backends (None:
        the GPU kernels on a GPU, the references elsewhere).
      collect_attention: keep every layer's attention output per generated token (tests).
      max_traces: wrap the jitted functions in `chex.assert_max_traces(n=max_traces)` (chex
        counts per definition site, across engines: call `chex.clear_trace_counter()` before
        building another engine with it).
      seed: sampling seed, an int in [0, 2**32): the key of request r's i-th sampled token
        is a function of (seed, r's sampling seed (by default its add_request order index),
        i) only (`hisparse_jax.engine.sampler.token_keys`).
      kv_format: how KV rows are stored in the device caches and the host pool (and so what
        a hot-region miss copies): "bf16" (the model's kv_dtype, 1,152 bytes per 576-value
        row) or "fp8_ds_mla" (uint8[656]: fp8 latent with a float32 scale per 128 values,
        bf16 rope; quantized where written, dequantized inside attention; needs a model with
        kv_lora_rank 512 and rope_dim 64). `docs/kv_format.md` has the layout and its error.
      compilation_cache: turn on jax's persistent compilation cache
        (`hisparse_jax.engine.compile_cache.enable`; the environment variable
        HISPARSE_JAX_COMPILATION_CACHE=0 turns it off, or names the directory).
      num_speculative_tokens: k, draft tokens verified per request and decode step (0: no
        speculation; k < block_size). Each step feeds a request's last token and up to k
        drafts, keeps the drafts that equal the tokens sampled before them and one more
        token (`hisparse_jax.draft_sources`); the default hot region grows to
        2 (1 + k) top_k rows.
      draft_source: where drafts come from (a `hisparse_jax.draft_sources.DraftSource`);
        None with k > 0: `MTPDraft()`, the model's MTP module.
      union_resolution: resolve a request's k + 1 query rows as one pass over their union
        (the default); False is the per-row ablation (`hisparse_jax.cache.HiSparse.per_row`,
        HiSparse mode with k > 0 only).
      prefill_chunk_size: None: a prompt is prefilled in one shot at admission. An int C >= 1:
        in chunks of at most C tokens, one chunk per request and step, sharing steps with the
        other requests' decode (the model's `prefill_chunk`); a request samples its first
        token after its last chunk. Its pages stay resident until then
        (`docs/semantics.md`, chunked prefill). Needs the indexer (no `topk_source`): a chunk
        selects over the earlier chunks' index keys.
      max_prefill_tokens_per_step: prompt tokens prefilled per step, at most, over every
        request (None: no limit; needs prefill_chunk_size): chunks of requests already
        prefilling come first, then admissions, each chunk cut to what the budget leaves.
      async_scheduling: the host plans and dispatches decode step t + 1 while step t runs on
        the device (`Engine.step`): step t's sampled tokens stay on the device and feed step
        t + 1; stop conditions are learned a step late (a request's extra row of the next
        step is dropped, never emitted); on anything unusual the engine drains to a
        synchronous step. Same tokens as the synchronous engine. Not with speculation
        (num_speculative_tokens 0) nor in `MeshEngine`.
      enable_prefix_caching: reuse the published pages of earlier requests (`host_tier`'s
        prefix cache: full pages named by a chained hash of their tokens, published once
        their host copies completed): a prompt that starts with published pages prefills
        only its remaining tokens (the model's `prefill_chunk` from the first uncached
        position, also without prefill_chunk_size), its hit pages restored into resident
        blocks (or read by staging: prefix_hit_pages) and their index keys copied into its
        seat (the engine keeps the keys of every published page on the host:
        `hisparse_jax/engine/prefix_keys.py`). With all_resident it is seat reuse instead:
        a state row freed by a finished request keeps its rows, and a later prompt that
        extends them (the next turn of a conversation) is admitted into that row and
        prefills only the rest; a kept row serves one later request and the free rows are
        all the memory that keeps them (`StaticResidency`). Not with naive_offload; needs
        the indexer (no topk_source), no speculation (num_speculative_tokens=0) and
        async_scheduling=False.
      prefix_hit_pages: how a prefix hit's pages without a device copy are read by its
        prefill (with enable_prefix_caching): "restore" (default) gives each a resident block
        and a whole-page restore from host before the prefill; "stage" leaves them host-only
        (read through the hot region once the request decodes) and each prefill chunk stages
        just the rows its query rows select from them (the model's `prefill_chunk` staging,
        `docs/semantics.md`, prefill staging).
      pack_host_layers: the host pool keeps the layers of an index group side by side, one
        array per group with rows index_group_size x wider (default True): the group's one
        swap plan then reads each selected host row once for all its layers, and a random
        pinned-host row costs a fixed overhead beside its bytes (`docs/host_pool.md`). False:
        one array per layer. Nothing changes for groups of one layer.
      position_map: each hot state keeps a position map (`HiSparseConfig.position_map`,
        default True): resolve looks every selected row up once instead of searching the
        hot region (`docs/semantics.md`), for 2 bytes per position, per seat and index
        group (max_seats * max_model_len * 2 bytes each). False: the search rule.
      copy_programs: None (default), or an int P >= 1: at most P GPU programs move a
        decode step's copies from host, each looping over its share, instead of a program
        per chunk of every row's plan (`HiSparseKVCache.copy_programs`). Same tokens.
      copy_with_attention: True (default) or False: with a topk_source each index group
        after the first is looked up ahead, and its copies from host run in the launch of
        the previous group's first attention, by copy_programs programs (32 when None)
        beside the attention's (`HiSparseKVCache.attend`, `sparse_mla_decode_with_copies`):
        the copies overlap that attention inside one kernel (`docs/host_pool.md`). Same
        tokens. The model's own indexer needs group g's output to select group g + 1's rows,
        so without a topk_source nothing changes. False: every group's copies run at its
        own lookup, in model order.

    Every field is checked at construction (`validate`): ValueError naming the field and the
    rule.
    """

    max_seats: int = 4
    max_model_len: int = 256
    block_size: int = 16
    hot_size: int | None = None
    num_gpu_blocks: int | None = None
    num_host_blocks: int | None = None
    all_resident: bool = False
    naive_offload: bool = False
    topk_source: TopKSource | None = None
    synthetic_prefill: bool = False
    prefill_bucket: int = 16
    attention_backend: str | None = None
    ops_backend: str | None = None
    collect_attention: bool = False
    max_traces: int | None = None
    seed: int = 0
    compilation_cache: bool = True
    kv_format: str = "bf16"
    num_speculative_tokens: int = 0
    draft_source: DraftSource | None = None
    union_resolution: bool = True
    prefill_chunk_size: int | None = None
    max_prefill_tokens_per_step: int | None = None
    async_scheduling: bool = False
    enable_prefix_caching: bool = False
    prefix_hit_pages: str = "restore"
    pack_host_layers: bool = True
    position_map: bool = True
    copy_programs: int | None = None
    copy_with_attention: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Checks every field's type and range and the rules between fields; raises
        ValueError naming `EngineConfig.<field>` and the rule (the constructor calls it).

        Normalises the deprecated backend alias "pallas" to "triton" (DeprecationWarning).
        What depends on the model or the platform is checked by `check_model` and
        `check_platform`, which the `Engine` calls."""
        for name in ("max_seats", "max_model_len", "block_size", "prefill_bucket"):
            _check_int(name, getattr(self, name), minimum=1)
        for name, minimum in (("hot_size", 1), ("max_traces", 1), ("num_gpu_blocks", 2),
                              ("num_host_blocks", 2), ("copy_programs", 1)):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=minimum, optional=True)
                object.__setattr__(self, name, int(getattr(self, name)))
        if self.hot_size is not None and self.hot_size > MAX_HOT_SIZE:
            raise ValueError(f"EngineConfig.hot_size must be <= {MAX_HOT_SIZE} (LRU slot ids "
                             f"are int16), got {self.hot_size}")
        if not is_int(self.seed) or not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"EngineConfig.seed must be an int in [0, 2**32), got {self.seed!r}")
        for name in ("all_resident", "naive_offload", "synthetic_prefill", "collect_attention",
                     "compilation_cache", "union_resolution", "async_scheduling",
                     "enable_prefix_caching", "pack_host_layers", "position_map",
                     "copy_with_attention"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"EngineConfig.{name} must be a bool, got {value!r}")
            object.__setattr__(self, name, bool(value))
        if not isinstance(self.kv_format, str) or self.kv_format not in kvf.KV_FORMATS:
            raise ValueError(f"EngineConfig.kv_format must be one of {kvf.KV_FORMATS}, got "
                             f"{self.kv_format!r}")
        if self.all_resident and self.naive_offload:
            raise ValueError("EngineConfig: all_resident and naive_offload exclude each other")
        if self.topk_source is not None and not isinstance(self.topk_source, TopKSource):
            raise ValueError("EngineConfig.topk_source must be a hisparse_jax.topk_sources."
                             f"TopKSource or None, got {type(self.topk_source).__name__}")
        k = self.num_speculative_tokens
        if not is_int(k) or not 0 <= k < self.block_size:
            raise ValueError(f"EngineConfig.num_speculative_tokens must be an int in [0, "
                             f"block_size={self.block_size}) (a step's draft rows open at most "
                             f"one page), got {k!r}")
        if self.async_scheduling and k:
            raise ValueError("EngineConfig.async_scheduling needs num_speculative_tokens=0 (a "
                             "step's accepted drafts are known only when it is collected), got "
                             f"num_speculative_tokens={k}")
        if self.draft_source is not None:
            if not isinstance(self.draft_source, DraftSource):
                raise ValueError("EngineConfig.draft_source must be a hisparse_jax."
                                 "draft_sources.DraftSource or None, got "
                                 f"{type(self.draft_source).__name__}")
            if k == 0:
                raise ValueError("EngineConfig.draft_source needs num_speculative_tokens >= 1 "
                                 "(no drafts are verified without it)")
        if not self.union_resolution and (k == 0 or self.all_resident or self.naive_offload):
            raise ValueError("EngineConfig.union_resolution=False (the per-row ablation) needs "
                             "num_speculative_tokens >= 1 and the HiSparse mode (neither "
                             "all_resident nor naive_offload)")
        for name in ("prefill_chunk_size", "max_prefill_tokens_per_step"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1, optional=True)
        if self.max_prefill_tokens_per_step is not None and self.prefill_chunk_size is None:
            raise ValueError("EngineConfig.max_prefill_tokens_per_step needs prefill_chunk_size "
                             "(a one-shot prefill cannot be cut to a step's budget)")
        if self.prefill_chunk_size is not None and self.topk_source is not None:
            raise ValueError("EngineConfig.prefill_chunk_size needs the indexer (topk_source "
                             "None): a chunk selects over the earlier chunks' index keys, which "
                             "are not kept with an external top-k source")
        if self.enable_prefix_caching:
            for broken, rule in (
                    (self.naive_offload,
                     "naive_offload=False: naive offload reads every row from host and keeps "
                     "nothing on the device to reuse"),
                    (self.topk_source is not None,
                     "the indexer (topk_source None): a hit copies the prefix's index keys"),
                    (k != 0, "num_speculative_tokens=0: a page's index keys are kept when it "
                     "seals, which a speculative step's rows do not tell"),
                    (self.async_scheduling,
                     "async_scheduling=False: a page hashes its token ids when it seals, and "
                     "an asynchronous step's newest token is still on the device then")):
                if broken:
                    raise ValueError(f"EngineConfig.enable_prefix_caching needs {rule}")
        if self.prefix_hit_pages not in PREFIX_HIT_PAGES:
            raise ValueError(f"EngineConfig.prefix_hit_pages must be one of {PREFIX_HIT_PAGES}, "
                             f"got {self.prefix_hit_pages!r}")
        if self.prefix_hit_pages == "stage" and self.all_resident:
            raise ValueError("EngineConfig.prefix_hit_pages='stage' needs the HiSparse mode "
                             "(all_resident False): all-resident rows are never host-only")
        if self.prefix_hit_pages == "stage" and not self.enable_prefix_caching:
            raise ValueError("EngineConfig.prefix_hit_pages='stage' needs "
                             "enable_prefix_caching=True (only prefix hits have host-only pages "
                             "before a prefill)")
        for name, ops in (("attention_backend", ATTENTION_OPS), ("ops_backend", DATA_PLANE_OPS)):
            object.__setattr__(self, name, _check_backend(name, getattr(self, name), ops))

    def check_model(self, spec: Any) -> None:
        """The rules that involve the model (its `hisparse_jax.models.ModelSpec`): an explicit
        `hot_size` holds one step's top-k (hot_size >= top_k); `kv_format` "fp8_ds_mla"
        stores rows of 512 latent + 64 rope values (kv_lora_rank 512, rope_dim 64).
        ValueError naming the field."""
        if self.kv_format == kvf.FP8_DS_MLA and (spec.kv_lora_rank, spec.rope_dim
                                                 ) != (kvf.LATENT_DIM, kvf.ROPE_DIM):
            raise ValueError(
                f"EngineConfig.kv_format={self.kv_format!r} stores rows of {kvf.LATENT_DIM} "
                f"latent + {kvf.ROPE_DIM} rope values; the model {spec.name!r} has "
                f"kv_lora_rank {spec.kv_lora_rank} + rope_dim {spec.rope_dim} "
                f"(use e.g. the 'tiny576' or 'dsv32-2l' config)")
        rows = 1 + self.num_speculative_tokens
        if self.hot_size is not None and self.hot_size < rows * spec.top_k:
            raise ValueError(
                f"EngineConfig.hot_size must be >= (1 + num_speculative_tokens) * the model's "
                f"top_k ({rows} x {spec.top_k}: each miss of a step needs its own hot "
                f"slot), got {self.hot_size}")
        if self.draft is not None:
            self.draft.check_model(spec)

    def check_platform(self, spec: Any, cfg: HiSparseConfig) -> None:
        """The backends can run this engine's calls on this platform: asks the op registry
        (`hisparse_jax.ops._registry.unsupported`) with the shapes of the decode and prefill
        attention calls and of the data-plane ops. ValueError naming the field and the
        registry's reason. Backend None always passes (the registry picks what runs)."""
        mc = spec
        if self.attention_backend is not None:
            dt, width, k = cfg.kv_dtype, mc.row_width, mc.top_k
            rows = cfg.num_gpu_blocks * cfg.block_size
            kw = dict(sm_scale=mc.sm_scale, v_width=mc.kv_lora_rank, kv_format=cfg.kv_format)
            for n, kv_rows in ((cfg.max_num_reqs, rows), (cfg.max_model_len, cfg.max_model_len)):
                reason = _registry.unsupported(
                    "sparse_mla_decode", self.attention_backend,
                    jax.ShapeDtypeStruct((n, mc.num_heads, width), dt),
                    jax.ShapeDtypeStruct((kv_rows, cfg.storage_width), cfg.storage_dtype),
                    jax.ShapeDtypeStruct((n, k), np.int32), **kw)
                if reason is not None:
                    raise ValueError(f"EngineConfig.attention_backend={self.attention_backend!r} "
                                     f"cannot run on this platform: {reason}")
        if self.ops_backend is not None and not self.all_resident:
            for op in DATA_PLANE_OPS:
                reason = _registry.unsupported(op, self.ops_backend)
                if reason is not None:
                    raise ValueError(f"EngineConfig.ops_backend={self.ops_backend!r} cannot run "
                                     f"{op} on this platform: {reason}")

    def stored_row(self, spec: Any) -> tuple[int, np.dtype]:
        """(width, dtype) of one stored KV row of a model of `spec` in `kv_format`: the last
        dim and element type of the device caches and the host pool."""
        width, dtype = spec.row_width, spec.kv_dtype
        return (kvf.storage_width(self.kv_format, width),
                np.dtype(kvf.storage_dtype(self.kv_format, dtype)))

    @property
    def stages_prefix_hits(self) -> bool:
        """Prefix caching with `prefix_hit_pages` "stage": hit pages stay host-only and
        prefill chunks stage the rows they select from them."""
        return self.enable_prefix_caching and self.prefix_hit_pages == "stage"

    @property
    def residency(self) -> Residency:
        """The residency type of the mode: `AllResident`, `NaiveOffload` or `HiSparse`."""
        if self.all_resident:
            return AllResident()
        return NaiveOffload() if self.naive_offload else HiSparse(
            per_row=not self.union_resolution)

    @property
    def draft(self) -> DraftSource | None:
        """The draft source in effect: `draft_source`, `MTPDraft()` when speculating without
        one, None without speculation."""
        if not self.num_speculative_tokens:
            return None
        return self.draft_source if self.draft_source is not None else MTPDraft()

    def host_layers_per_array(self, spec: Any) -> int:
        """The host pool's layers per array (`pack_host_layers`): the model's index group
        size, or 1."""
        return spec.index_group_size if self.pack_host_layers else 1

    def hisparse_config(self, spec, *, num_host_blocks: int | None = None
                        ) -> HiSparseConfig:
        """The one `HiSparseConfig` of an engine serving a model of `spec`
        (`hisparse_jax.models.ModelSpec`).

        Device blocks: all-resident, one full-length request per seat (plus the null block);
        otherwise `num_gpu_blocks`, by default every seat full length plus its hot region.
        Host blocks (none when all-resident): `num_host_blocks` (an existing pool's size),
        else this config's, else `max_seats + 1` full-length requests.
        """
        B, S = self.block_size, self.max_seats
        mc = spec
        max_pages = cdiv(self.max_model_len, B)
        k = self.num_speculative_tokens
        hot_size = self.hot_size or (round_up((1 + k) * mc.top_k, B) if self.naive_offload
                                     else HiSparseConfig.default_hot_size(mc.top_k, B, k))
        if self.all_resident:
            gpu_blocks, host_blocks = 1 + S * max_pages, None
        else:
            gpu_blocks = self.num_gpu_blocks or 1 + S * (max_pages + cdiv(hot_size, B))
            host_blocks = num_host_blocks or self.num_host_blocks or 1 + (S + 1) * max_pages
        return HiSparseConfig(top_k=mc.top_k, hot_size=hot_size, block_size=B,
                              max_num_reqs=S, row_width=mc.row_width, kv_dtype=mc.kv_dtype,
                              kv_format=self.kv_format, num_speculative_tokens=k,
                              max_model_len=self.max_model_len, num_gpu_blocks=gpu_blocks,
                              num_host_blocks=host_blocks,
                              position_map=self.position_map and not (self.all_resident
                                                                    or self.naive_offload))
