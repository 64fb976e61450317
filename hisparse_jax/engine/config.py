"""`EngineConfig`: the serving choices of the `Engine`, as a few values, and the one
`HiSparseConfig` they give with the model.

    EngineConfig(sizes=Sizes(max_seats=8, max_model_len=4096, block_size=64),
                 residency=HiSparse(),                      # or AllResident(), NaiveOffload()
                 prefill=PrefillPolicy(chunk_size=512, prefix_caching=True),
                 speculative=None,                          # or Speculative(num_tokens=2)
                 tuning=Tuning(copy_programs=32), seed=0)

Sizes: a user states only the engine's own choices (`Sizes`: seats, longest request, page
size, and optionally hot region and pool sizes); the model states its own facts (top-k, row
width, KV dtype) and the row format is `kv_format`. `hisparse_config(spec)` puts both into the
one `HiSparseConfig` that every part of the engine reads, filling the defaults (hot size, pool
sizes, position map) from the residency and the speculation. Stating a whole `HiSparseConfig`
would make the user restate the model's facts and the derived pool sizes, which the engine
must then check against the model; `Sizes` cannot disagree with the model.
`EngineConfig.sized(max_seats, max_model_len, block_size, **fields)` is the shortcut for the
three sizes most configs set.

The groups (`config_groups.py`) check their own fields at construction; `EngineConfig` checks
the field types and the rules between groups (`validate`), and the `Engine` adds the rules
that need the model (`check_model`) and the platform (`check_platform`). Every error is a
ValueError naming the full path of the field (`EngineConfig.prefill.chunk_size`) and the rule;
a rule between fields names both. Nothing is changed after construction.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from hisparse_jax.cache import AllResident, HiSparse, NaiveOffload, Residency
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.draft_sources import DraftSource
from hisparse_jax.engine.config_groups import (
    ATTENTION_OPS,
    DATA_PLANE_OPS,
    PREFIX_HIT_PAGES,
    Debug,
    PrefillPolicy,
    Sizes,
    Speculative,
    Tuning,
    check_bool,
)
from hisparse_jax.index_groups import packed_layers
from hisparse_jax.ops import _registry
from hisparse_jax.topk_sources import TopKSource
from host_tier.sizes import cdiv, is_int, round_up
from pallas_kernels import kv_format as kvf

__all__ = ["ATTENTION_OPS", "DATA_PLANE_OPS", "PREFIX_HIT_PAGES", "AllResident", "Debug",
           "EngineConfig", "HiSparse", "NaiveOffload", "PrefillPolicy", "Sizes", "Speculative",
           "Tuning"]

_RESIDENCIES = (HiSparse, AllResident, NaiveOffload)
_GROUPS = (("sizes", Sizes), ("prefill", PrefillPolicy), ("tuning", Tuning), ("debug", Debug))


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The serving choices of an `Engine` (frozen; checked at construction).

    Attributes:
      sizes: `Sizes` (default `Sizes()`): seats, longest request, page size, and optionally
        the hot region and pool sizes; the model gives the rest (`hisparse_config`).
      residency: where rows live (default `HiSparse()`), a `hisparse_jax.cache` residency:
        `HiSparse()` (resident pages plus per-request hot regions over the pinned host pool;
        `HiSparse(per_row=True)`: the per-row ablation, with speculation only),
        `AllResident()` (no host tier: every row stays on the device, the baseline) or
        `NaiveOffload()` (the naive-offload baseline: pages leave the device as soon as their
        host copy completes and every selected row is copied from host every step; hot region
        of (1 + k) top_k rows, emptied before each step; no fast path).
      kv_format: "bf16" (default: the model's kv_dtype, 1,152 bytes per 576-value row) or
        "fp8_ds_mla" (uint8[656]: fp8 latent with a float32 scale per 128 values, bf16 rope;
        quantized where written, dequantized inside attention; needs a model with
        kv_lora_rank 512 and rope_dim 64): how KV rows are stored in the device caches and
        the host pool (and so what a hot-region miss copies); `docs/kv_format.md`.
      topk_source: None (default: the model's indexer) or a `hisparse_jax.topk_sources.
        TopKSource` the decode top-k is taken from instead.
      prefill: `PrefillPolicy` (default `PrefillPolicy()`): bucket, chunked prefill, prefix
        caching, synthetic prompts.
      speculative: None (default: no speculation) or `Speculative(num_tokens=k, draft=...)`.
      tuning: `Tuning` (default `Tuning()`): kernel backends, how copies from host run, the
        host pool's layout and the position map; same tokens whatever it holds.
      async_scheduling: bool (default False): the host plans and dispatches decode step t + 1
        while step t runs on the device (`Engine.step`): step t's sampled tokens stay on the
        device and feed step t + 1; stop conditions are learned a step late (a request's extra
        row of the next step is dropped, never emitted); on anything unusual the engine
        drains to a synchronous step. Same tokens as the synchronous engine. With
        speculation a step's accepted drafts stay on the device too (the next step continues
        from them; with a host draft source each step collects first).
      seed: int in [0, 2**32) (default 0): the sampling seed. The key of request r's i-th
        sampled token is a function of (seed, r's sampling seed (by default its add_request
        order index), i) only (`hisparse_jax.engine.sampler.token_keys`).
      compilation_cache: bool (default True): turn on jax's persistent compilation cache
        (`hisparse_jax.engine.compile_cache.enable`; the environment variable
        HISPARSE_JAX_COMPILATION_CACHE=0 turns it off, or names the directory).
      debug: `Debug` (default `Debug()`): attention capture and trace-count checks (tests).
    """

    sizes: Sizes = Sizes()
    residency: Residency = HiSparse()
    kv_format: str = "bf16"
    topk_source: TopKSource | None = None
    prefill: PrefillPolicy = PrefillPolicy()
    speculative: Speculative | None = None
    tuning: Tuning = Tuning()
    async_scheduling: bool = False
    seed: int = 0
    compilation_cache: bool = True
    debug: Debug = Debug()

    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def sized(cls, max_seats: int = 4, max_model_len: int = 256, block_size: int = 16,
              **fields: Any) -> EngineConfig:
        """`EngineConfig(sizes=Sizes(max_seats, max_model_len, block_size), **fields)`: the
        shortcut for the three sizes most configs set (`fields`: the other top-level
        fields)."""
        return cls(sizes=Sizes(max_seats=max_seats, max_model_len=max_model_len,
                               block_size=block_size), **fields)

    def validate(self) -> None:
        """Checks the type of every field and the rules between groups; raises ValueError
        naming the full path of the field (both fields' for a rule between two) and the rule
        (the constructor calls it; each group checked its own fields when it was built).

        What depends on the model or the platform is checked by `check_model` and
        `check_platform`, which the `Engine` calls."""
        self._check_types()
        k = self.num_speculative_tokens
        B = self.sizes.block_size
        if k >= B:
            raise ValueError(f"EngineConfig.speculative.num_tokens must be an int in [1, "
                             f"EngineConfig.sizes.block_size={B}) (a step's draft rows open at "
                             f"most one page), got {k!r}")
        if isinstance(self.residency, HiSparse) and self.residency.per_row and not k:
            raise ValueError("EngineConfig.residency=HiSparse(per_row=True) (the per-row "
                             "ablation) needs EngineConfig.speculative (per_row=True resolves a "
                             "step's 1 + k query rows one by one)")
        if self.prefill.chunk_size is not None and self.topk_source is not None:
            raise ValueError("EngineConfig.prefill.chunk_size needs the indexer (EngineConfig."
                             "topk_source None): a chunk selects over the earlier chunks' index "
                             "keys, which are not kept with an external top-k source")
        self._check_prefix_caching()

    def _check_types(self) -> None:
        """ValueError naming the field unless every field has its type."""
        for name, group in _GROUPS:
            if not isinstance(getattr(self, name), group):
                raise ValueError(f"EngineConfig.{name} must be a hisparse_jax.engine."
                                 f"{group.__name__}, got {getattr(self, name)!r}")
        if not isinstance(self.residency, _RESIDENCIES):
            raise ValueError("EngineConfig.residency must be HiSparse(), AllResident() or "
                             f"NaiveOffload() (hisparse_jax.cache), got {self.residency!r}")
        if isinstance(self.residency, HiSparse) and not isinstance(self.residency.per_row, bool):
            raise ValueError("EngineConfig.residency.per_row must be a bool, got "
                             f"{self.residency.per_row!r}")
        if self.speculative is not None and not isinstance(self.speculative, Speculative):
            raise ValueError("EngineConfig.speculative must be a hisparse_jax.engine.Speculative "
                             f"or None, got {self.speculative!r}")
        if not isinstance(self.kv_format, str) or self.kv_format not in kvf.KV_FORMATS:
            raise ValueError(f"EngineConfig.kv_format must be one of {kvf.KV_FORMATS}, got "
                             f"{self.kv_format!r}")
        if self.topk_source is not None and not isinstance(self.topk_source, TopKSource):
            raise ValueError("EngineConfig.topk_source must be a hisparse_jax.topk_sources."
                             f"TopKSource or None, got {type(self.topk_source).__name__}")
        for name in ("async_scheduling", "compilation_cache"):
            check_bool(name, getattr(self, name))
        if not is_int(self.seed) or not 0 <= self.seed < 2 ** 32:
            raise ValueError(f"EngineConfig.seed must be an int in [0, 2**32), got {self.seed!r}")

    def _check_prefix_caching(self) -> None:
        """The rules of `PrefillPolicy.prefix_caching` and `prefix_hit_pages` that involve
        the other groups."""
        if self.prefill.prefix_caching:
            for broken, rule in (
                    (isinstance(self.residency, NaiveOffload),
                     "EngineConfig.residency other than NaiveOffload(): naive offload reads "
                     "every row from host and keeps nothing on the device to reuse"),
                    (self.topk_source is not None,
                     "the indexer (EngineConfig.topk_source None): a hit copies the prefix's "
                     "index keys")):
                if broken:
                    raise ValueError(f"EngineConfig.prefill.prefix_caching needs {rule}")
        if self.prefill.prefix_hit_pages == "stage" and isinstance(self.residency, AllResident):
            raise ValueError("EngineConfig.prefill.prefix_hit_pages='stage' needs the HiSparse "
                             "mode (EngineConfig.residency other than AllResident()): "
                             "all-resident rows are never host-only")

    def check_model(self, spec: Any) -> None:
        """The rules that involve the model, read from `spec` (its `hisparse_jax.models.
        ModelSpec`: top_k, kv_lora_rank, rope_dim, name): an explicit `sizes.hot_size` holds
        one step's selections ((1 + k) * top_k rows); `kv_format` "fp8_ds_mla" stores rows of
        512 latent + 64 rope values (kv_lora_rank 512, rope_dim 64); the draft source can
        serve the model. ValueError naming the field."""
        if self.kv_format == kvf.FP8_DS_MLA and (spec.kv_lora_rank, spec.rope_dim) != (
                kvf.LATENT_DIM, kvf.ROPE_DIM):
            raise ValueError(
                f"EngineConfig.kv_format={self.kv_format!r} stores rows of {kvf.LATENT_DIM} "
                f"latent + {kvf.ROPE_DIM} rope values; the model {spec.name!r} has "
                f"kv_lora_rank {spec.kv_lora_rank} + rope_dim {spec.rope_dim} "
                f"(use e.g. the 'tiny576' or 'dsv32-2l' config)")
        rows = 1 + self.num_speculative_tokens
        hot_size = self.sizes.hot_size
        if hot_size is not None and hot_size < rows * spec.top_k:
            raise ValueError(
                f"EngineConfig.sizes.hot_size must be >= (1 + EngineConfig.speculative."
                f"num_tokens) * the model's top_k ({rows} x {spec.top_k}: each miss of a step "
                f"needs its own hot slot), got {hot_size}")
        if self.draft is not None:
            self.draft.check_model(spec)

    def check_platform(self, spec: Any, cfg: HiSparseConfig) -> None:
        """The backends can run this engine's calls on this platform: asks the op registry
        (`hisparse_jax.ops._registry.unsupported`) with the shapes of the decode and prefill
        attention calls (`spec`: num_heads, row_width, top_k, sm_scale, kv_lora_rank) and of
        the data-plane ops. ValueError naming the field and the registry's reason. A backend
        of None always passes (the registry picks what runs)."""
        attention, ops = self.tuning.attention_backend, self.tuning.ops_backend
        if attention is not None:
            dt, width, k = cfg.kv_dtype, spec.row_width, spec.top_k
            rows = cfg.num_gpu_blocks * cfg.block_size
            kw = dict(sm_scale=spec.sm_scale, v_width=spec.kv_lora_rank,
                      kv_format=cfg.kv_format)
            for n, kv_rows in ((cfg.max_num_reqs, rows), (cfg.max_model_len, cfg.max_model_len)):
                reason = _registry.unsupported(
                    "sparse_mla_decode", attention,
                    jax.ShapeDtypeStruct((n, spec.num_heads, width), dt),
                    jax.ShapeDtypeStruct((kv_rows, cfg.storage_width), cfg.storage_dtype),
                    jax.ShapeDtypeStruct((n, k), np.int32), **kw)
                if reason is not None:
                    raise ValueError(f"EngineConfig.tuning.attention={self.tuning.attention!r} "
                                     f"cannot run on this platform: {reason}")
        if ops is not None and not isinstance(self.residency, AllResident):
            for op in DATA_PLANE_OPS:
                reason = _registry.unsupported(op, ops)
                if reason is not None:
                    raise ValueError(f"EngineConfig.tuning.ops={self.tuning.ops!r} cannot run "
                                     f"{op} on this platform: {reason}")

    @property
    def num_speculative_tokens(self) -> int:
        """k, draft tokens per request and step: `speculative.num_tokens`, 0 without
        speculation."""
        return 0 if self.speculative is None else int(self.speculative.num_tokens)

    @property
    def draft(self) -> DraftSource | None:
        """The draft source in effect: `speculative.draft_source` (`MTPDraft()` when the
        group names none), None without speculation."""
        return None if self.speculative is None else self.speculative.draft_source

    @property
    def stages_prefix_hits(self) -> bool:
        """Prefix caching with `prefill.prefix_hit_pages` "stage": hit pages stay host-only
        and prefill chunks stage the rows they select from them."""
        return self.prefill.stages_prefix_hits

    def stored_row(self, spec: Any) -> tuple[int, np.dtype]:
        """(width, dtype) of one stored KV row of a model with `spec.row_width` values of
        `spec.kv_dtype`, in `kv_format`: the last dim and element type of the device caches
        and the host pool."""
        return (kvf.storage_width(self.kv_format, spec.row_width),
                np.dtype(kvf.storage_dtype(self.kv_format, spec.kv_dtype)))

    def host_layers_per_array(self, spec: Any) -> int:
        """The host pool's layers per array (`tuning.pack_host_layers`; 1 without): the most
        layers an array can hold while holding one index group's layers only, the greatest
        common divisor of the model's `spec.group_layers` (`packed_layers`): the group size
        when the groups are equal; for groups of unequal size, e.g. (1, 2, 2), their common
        divisor (1 there: one array per layer)."""
        return packed_layers(spec.group_layers) if self.tuning.pack_host_layers else 1

    def hisparse_config(self, spec: Any, *, num_host_blocks: int | None = None
                        ) -> HiSparseConfig:
        """The one `HiSparseConfig` of an engine serving a model of `spec` (its
        `hisparse_jax.models.ModelSpec`: top_k, row_width, kv_dtype): `sizes` plus the
        model's facts, the defaults filled in.

        Hot size: `sizes.hot_size`, else 2 (1 + k) top_k rounded up to pages (naive offload:
        (1 + k) top_k rounded up). Device blocks: all-resident, one full-length request per
        seat (plus the null block); otherwise `sizes.num_gpu_blocks`, by default every seat
        full length plus its hot region. Host blocks (none when all-resident):
        `num_host_blocks` (an existing pool's size), else `sizes.num_host_blocks`, else
        `max_seats + 1` full-length requests. Position map: `tuning.position_map`, in the
        HiSparse residency only.
        """
        sz = self.sizes
        B, S, L = int(sz.block_size), int(sz.max_seats), int(sz.max_model_len)
        max_pages = cdiv(L, B)
        k = self.num_speculative_tokens
        naive = isinstance(self.residency, NaiveOffload)
        hot_size = (int(sz.hot_size) if sz.hot_size is not None
                    else round_up((1 + k) * spec.top_k, B) if naive
                    else HiSparseConfig.default_hot_size(spec.top_k, B, k))
        if isinstance(self.residency, AllResident):
            gpu_blocks, host_blocks = 1 + S * max_pages, None
        else:
            gpu_blocks = (int(sz.num_gpu_blocks) if sz.num_gpu_blocks is not None
                          else 1 + S * (max_pages + cdiv(hot_size, B)))
            host_blocks = int(num_host_blocks or sz.num_host_blocks or 1 + (S + 1) * max_pages)
        return HiSparseConfig(top_k=spec.top_k, hot_size=hot_size, block_size=B,
                              max_num_reqs=S, row_width=spec.row_width, kv_dtype=spec.kv_dtype,
                              kv_format=self.kv_format, num_speculative_tokens=k,
                              max_model_len=L, num_gpu_blocks=gpu_blocks,
                              num_host_blocks=host_blocks,
                              position_map=(self.tuning.position_map
                                            and isinstance(self.residency, HiSparse)))
