"""`HiSparseConfig`: the one source of the static sizes of HiSparse.

The engine derives one `HiSparseConfig` (from its `EngineConfig` and the model config) and
hands it to every part that needs a size: the hot state, the KV-cache handle, the host-tier
coordinator, the host pool and the device block tables.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np

from host_tier.sizes import cdiv, check_int, round_up
from pallas_kernels import kv_format as kvf

MAX_HOT_SIZE = 32768  # LRU slot ids are int16


@dataclasses.dataclass(frozen=True)
class HiSparseConfig:
    """Static sizes shared by the hot state, the ops and the host tier.

    Attributes:
      top_k: K, selected token positions per query row.
      hot_size: H, GPU rows of a request's hot region (an LRU cache over host rows);
        `(1 + num_speculative_tokens) * top_k <= hot_size <= 32768`
        (`default_hot_size` gives twice that, rounded up to pages).
      block_size: B, rows per page; shared by host, resident and hot pages.
      max_num_reqs: S, rows of the hot state (one per concurrently served request).
      row_width: W, values of one KV row (576 for DeepSeek-V3.2 MLA: 512 latent + 64 rope).
      kv_dtype: float type of KV rows as the model computes them (and of attention's q).
      kv_format: how rows are stored in the device caches and the host pool
        (`pallas_kernels/kv_format.py`, `docs/kv_format.md`): "bf16" (W values of kv_dtype)
        or "fp8_ds_mla" (uint8[656]: fp8 latent, 4 float32 scales, bf16 rope; W must be 576).
        `storage_width` / `storage_dtype` / `row_bytes` give the stored row.
      max_model_len: longest request (prompt + generated), in tokens; None = unknown.
      num_gpu_blocks: device blocks of each layer's KV cache, the null block 0 included
        (resident pages and hot regions share them); None = unknown.
      num_host_blocks: blocks of each layer's pinned host pool, the null block 0 included;
        None = unknown (e.g. no host tier).
      num_speculative_tokens: draft tokens per decode step (an int >= 0, default 0): each
        request has `query_rows_per_request = 1 + num_speculative_tokens` query rows per step,
        resolved as one union (`docs/semantics.md`), so the hot region must hold
        `query_rows_per_request * top_k` rows.
      position_map: keep a position map in each hot state (default True): int16[S,
        max_pages * B], the slot each position was last copied to, so that a resolve looks
        each selected row up once instead of searching the hot region
        (`resolve_residency`, `docs/semantics.md`; 2 bytes per position, per request and
        index group). Needs max_model_len; False (or max_model_len None): the search rule.
    The three optional sizes are not validated here (the parts that use them check them).
    """

    top_k: int
    hot_size: int
    block_size: int
    max_num_reqs: int
    row_width: int = 576
    kv_dtype: Any = "bfloat16"
    kv_format: str = "bf16"
    max_model_len: int | None = None
    num_gpu_blocks: int | None = None
    num_host_blocks: int | None = None
    num_speculative_tokens: int = 0
    position_map: bool = True

    def __post_init__(self) -> None:
        for name in ("top_k", "hot_size", "block_size", "max_num_reqs", "row_width"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"HiSparseConfig.{name} must be a positive int, got {value!r}")
        check_int("HiSparseConfig", "num_speculative_tokens", self.num_speculative_tokens,
                  minimum=0)
        if not isinstance(self.position_map, (bool, np.bool_)):
            raise ValueError(f"HiSparseConfig.position_map must be a bool, got "
                             f"{self.position_map!r}")
        if not self.top_k <= self.hot_size:
            raise ValueError(
                f"HiSparseConfig.hot_size must be >= top_k (each miss needs its own slot), "
                f"got hot_size={self.hot_size}, top_k={self.top_k}")
        if self.hot_size < self.query_rows_per_request * self.top_k:
            raise ValueError(
                f"HiSparseConfig.hot_size must be >= (1 + num_speculative_tokens) * top_k (a "
                f"request's query rows are resolved as one union of up to that many rows, each "
                f"miss in its own slot), got hot_size={self.hot_size}, num_speculative_tokens="
                f"{self.num_speculative_tokens}, top_k={self.top_k}")
        if self.hot_size > MAX_HOT_SIZE:
            raise ValueError(
                f"HiSparseConfig.hot_size must be <= {MAX_HOT_SIZE} (LRU slot ids are int16), "
                f"got {self.hot_size}")
        try:
            dtype = jnp.dtype(self.kv_dtype)
        except TypeError as e:
            raise ValueError(f"HiSparseConfig.kv_dtype is not a dtype: {self.kv_dtype!r}") from e
        object.__setattr__(self, "kv_dtype", dtype)
        try:
            kvf.storage_width(self.kv_format, self.row_width)
        except ValueError as e:
            raise ValueError(f"HiSparseConfig.kv_format: {e}") from None
        if self.row_bytes % 16:
            raise ValueError(
                f"HiSparseConfig.row_width * itemsize must be a multiple of 16 bytes, got "
                f"{self.row_width} * {dtype.itemsize} = {self.row_width * dtype.itemsize}")
        if self.hot_size % self.block_size:
            warnings.warn(
                f"HiSparseConfig.hot_size={self.hot_size} is not a multiple of block_size="
                f"{self.block_size}: the last hot page of every request is partly unused",
                stacklevel=3)

    @staticmethod
    def default_hot_size(top_k: int, block_size: int, num_speculative_tokens: int = 0) -> int:
        """The default hot size: twice the rows one step's union can select, 2 * (1 +
        num_speculative_tokens) * top_k, rounded up to a whole page of block_size rows.
        A step needs (1 + num_speculative_tokens) * top_k (the smallest valid hot size); the
        second half keeps rows of earlier steps cached across top-k drift (the engine's
        default without speculation has always been 2 * top_k)."""
        check_int("HiSparseConfig", "num_speculative_tokens", num_speculative_tokens,
                  minimum=0)
        return round_up(2 * (1 + num_speculative_tokens) * top_k, block_size)

    @property
    def query_rows_per_request(self) -> int:
        """Query rows per request and step: 1 + num_speculative_tokens (the
        `query_rows_per_request` of `resolve_residency`)."""
        return 1 + self.num_speculative_tokens

    @property
    def hot_blocks(self) -> int:
        """Pages in one request's hot region: ceil(hot_size / block_size)."""
        return cdiv(self.hot_size, self.block_size)

    @property
    def max_pages(self) -> int:
        """Pages of the longest request: ceil(max_model_len / block_size) (the width of the
        `src` and `res` block tables). Raises ValueError while max_model_len is unknown."""
        return cdiv(self.require("max_model_len"), self.block_size)

    @property
    def host_rows(self) -> int:
        """Rows of one layer's host pool, num_host_blocks * block_size; 0 without a host pool
        (num_host_blocks None)."""
        return 0 if self.num_host_blocks is None else self.num_host_blocks * self.block_size

    @property
    def storage_width(self) -> int:
        """Last dim of the device caches and host pools: row_width ("bf16") or 656
        ("fp8_ds_mla")."""
        return kvf.storage_width(self.kv_format, self.row_width)

    @property
    def storage_dtype(self) -> np.dtype:
        """Element type of the device caches and host pools: kv_dtype ("bf16") or uint8
        ("fp8_ds_mla")."""
        return np.dtype(kvf.storage_dtype(self.kv_format, self.kv_dtype))

    @property
    def row_bytes(self) -> int:
        """Bytes of one stored KV row: row_width * itemsize ("bf16"), 656 ("fp8_ds_mla")."""
        return kvf.row_bytes(self.kv_format, self.row_width, self.kv_dtype)

    def host_bytes_per_request(self, num_layers: int) -> int:
        """Host pool bytes of one full-length request: max_pages * B rows of row_bytes in
        each of `num_layers` layers."""
        return self.max_pages * self.block_size * self.row_bytes * num_layers

    def require(self, name: str) -> int:
        """The value of an optional size; ValueError while it is unknown (None)."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"HiSparseConfig.{name} is unknown (None); set it")
        return value
