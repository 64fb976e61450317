"""`EngineConfig`: the serving knobs of the `Engine`, and the one `HiSparseConfig` they give."""

from __future__ import annotations

import dataclasses

from hisparse_jax.cache import AllResident, HiSparse, NaiveOffload, Residency
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.topk_sources import TopKSource
from host_tier.sizes import cdiv, round_up


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
        the model over it (requires `topk_source`: the indexer would have no keys); the first
        generated token is the prompt's last token.
      prefill_bucket: prompts are padded to a multiple of this (bounds prefill compiles).
      attention_backend / ops_backend: `sparse_mla_decode` / data-plane op backends (None:
        the GPU kernels on a GPU, the references elsewhere).
      collect_attention: keep every layer's attention output per generated token (tests).
      max_traces: wrap the jitted functions in `chex.assert_max_traces(n=max_traces)` (chex
        counts per definition site, across engines: call `chex.clear_trace_counter()` before
        building another engine with it).
      seed: sampling seed.
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

    def validate(self) -> None:
        """Raises ValueError for knobs that exclude each other (the `Engine` calls it)."""
        if self.all_resident and self.naive_offload:
            raise ValueError("EngineConfig: all_resident and naive_offload exclude each other")
        if self.synthetic_prefill and self.topk_source is None:
            raise ValueError("EngineConfig.synthetic_prefill requires topk_source (the indexer "
                             "has no keys for a prompt that was not run through the model)")
        if self.topk_source is not None and not isinstance(self.topk_source, TopKSource):
            raise ValueError("EngineConfig.topk_source must be a hisparse_jax.topk_sources."
                             f"TopKSource, got {type(self.topk_source).__name__}")

    @property
    def residency(self) -> Residency:
        """The residency type of the mode: `AllResident`, `NaiveOffload` or `HiSparse`."""
        if self.all_resident:
            return AllResident()
        return NaiveOffload() if self.naive_offload else HiSparse()

    def hisparse_config(self, model_config, *, num_host_blocks: int | None = None
                        ) -> HiSparseConfig:
        """The one `HiSparseConfig` of an engine serving `model_config`
        (`hisparse_jax.nn.ModelConfig`).

        Device blocks: all-resident, one full-length request per seat (plus the null block);
        otherwise `num_gpu_blocks`, by default every seat full length plus its hot region.
        Host blocks (none when all-resident): `num_host_blocks` (an existing pool's size),
        else this config's, else `max_seats + 1` full-length requests.
        """
        B, S = self.block_size, self.max_seats
        mc = model_config
        max_pages = cdiv(self.max_model_len, B)
        hot_size = self.hot_size or round_up((1 if self.naive_offload else 2) * mc.top_k, B)
        if self.all_resident:
            gpu_blocks, host_blocks = 1 + S * max_pages, None
        else:
            gpu_blocks = self.num_gpu_blocks or 1 + S * (max_pages + cdiv(hot_size, B))
            host_blocks = num_host_blocks or self.num_host_blocks or 1 + (S + 1) * max_pages
        return HiSparseConfig(top_k=mc.top_k, hot_size=hot_size, block_size=B,
                              max_num_reqs=S, row_width=mc.row_width, kv_dtype=mc.kv_dtype,
                              max_model_len=self.max_model_len, num_gpu_blocks=gpu_blocks,
                              num_host_blocks=host_blocks)
