"""The small frozen groups of an `EngineConfig`: `Sizes`, `PrefillPolicy`, `Speculative`,
`Tuning` and `Debug`.

Each group checks its own fields in `__post_init__` (through `validate`) and never changes
them: a value is kept exactly as given. Ints may be Python or numpy ints (read as ints where
they are used); bools must be Python bools. A ValueError names the field's full path from the
`EngineConfig` (e.g. `EngineConfig.prefill.chunk_size`) and the rule. The rules between groups
(and those that need the model or the platform) are `EngineConfig`'s.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from hisparse_jax.config import MAX_HOT_SIZE
from hisparse_jax.draft_sources import DraftSource, MTPDraft
from hisparse_jax.ops import _registry
from host_tier.sizes import is_int

ATTENTION_OPS = ("sparse_mla_decode",)
"""The ops `Tuning.attention` selects the backend of."""
DATA_PLANE_OPS = ("resolve_residency", "invalidate_written_rows", "gather_compact_group",
                  "gather_compact", "mirror_rows", "stage_prefill_rows")
"""The ops `Tuning.ops` selects the backend of: the handle's lookup (invalidate, resolve,
gather), the transfer worker's copies (mirror; restores go through gather_compact) and the
prefill staging copy."""
PREFIX_HIT_PAGES = ("restore", "stage")
"""The values of `PrefillPolicy.prefix_hit_pages`."""


def check_int(path: str, value: Any, *, minimum: int, optional: bool = False) -> None:
    """ValueError naming `EngineConfig.<path>` unless `value` is an int >= `minimum` (a
    Python or numpy int, never a bool), or None when `optional`."""
    if optional and value is None:
        return
    if not is_int(value) or value < minimum:
        rule = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"EngineConfig.{path} must be {rule}{' or None' if optional else ''}, "
                         f"got {value!r}")


def check_bool(path: str, value: Any) -> None:
    """ValueError naming `EngineConfig.<path>` unless `value` is True or False."""
    if not isinstance(value, bool):
        raise ValueError(f"EngineConfig.{path} must be a bool, got {value!r}")


def check_backend(path: str, backend: Any, ops: tuple[str, ...]) -> None:
    """ValueError naming `EngineConfig.<path>` unless `backend` is None or a backend of every
    op in `ops`. The deprecated alias "pallas" passes with a DeprecationWarning (it reads as
    "triton": `backend_name`)."""
    if backend is None:
        return
    if not isinstance(backend, str):
        raise ValueError(f"EngineConfig.{path} must be a str or None, got {backend!r}")
    try:
        normalised = backend_name(backend)
    except ValueError:
        raise ValueError(f"EngineConfig.{path} must be one of {_registry.BACKENDS} or None, "
                         f"got {backend!r}") from None
    if normalised != backend:
        warnings.warn(f"EngineConfig.{path}={backend!r} is deprecated; use {normalised!r}",
                      DeprecationWarning, stacklevel=5)
    for op in ops:
        if normalised not in _registry.registered_backends(op):
            raise ValueError(f"EngineConfig.{path}={backend!r} has no implementation of {op} "
                             f"(its backends: {_registry.registered_backends(op)})")


def backend_name(backend: str | None) -> str | None:
    """The op registry's name of `backend` (an alias such as "pallas" -> "triton"), without
    the alias's warning; None stays None."""
    if backend is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return _registry.normalize(backend)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The engine's choices of the static sizes; the model gives the rest (top-k, row width,
    dtype) and `EngineConfig.hisparse_config` makes the one `HiSparseConfig` of both.

    Attributes:
      max_seats: int >= 1 (default 4): decode batch rows = hot-state rows = requests admitted
        at once (`HiSparseConfig.max_num_reqs`).
      max_model_len: int >= 2 (default 256): the longest request (prompt + generated), in
        tokens (a request has at least one prompt token and one generated token).
      block_size: int >= 1 (default 16): B, rows per page (host, resident and hot pages).
      hot_size: None (default: 2 (1 + k) top_k rows for k speculative tokens, rounded up to B;
        naive offload: (1 + k) top_k rounded up to B) or an int in [1, 32768]: H, hot-region
        rows per request. The model's rule, H >= (1 + k) * top_k, is checked by
        `EngineConfig.check_model`.
      num_gpu_blocks: None (default: every seat full length plus its hot region, i.e. no
        pressure) or an int >= 2: device blocks per layer cache, the null block included.
      num_host_blocks: None (default: max_seats + 1 full-length requests) or an int >= 2:
        host pool blocks, the null block included.
    """

    max_seats: int = 4
    max_model_len: int = 256
    block_size: int = 16
    hot_size: int | None = None
    num_gpu_blocks: int | None = None
    num_host_blocks: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming `EngineConfig.sizes.<field>` and the rule it breaks."""
        for name in ("max_seats", "max_model_len", "block_size"):
            check_int(f"sizes.{name}", getattr(self, name), minimum=1)
        if self.max_model_len < 2:
            raise ValueError(f"EngineConfig.sizes.max_model_len must be >= 2 (a request needs "
                             f"at least one prompt token and one generated token), got "
                             f"{self.max_model_len}")
        check_int("sizes.hot_size", self.hot_size, minimum=1, optional=True)
        if self.hot_size is not None and self.hot_size > MAX_HOT_SIZE:
            raise ValueError(f"EngineConfig.sizes.hot_size must be <= {MAX_HOT_SIZE} (LRU slot "
                             f"ids are int16), got {self.hot_size}")
        for name in ("num_gpu_blocks", "num_host_blocks"):
            check_int(f"sizes.{name}", getattr(self, name), minimum=2, optional=True)


@dataclasses.dataclass(frozen=True)
class PrefillPolicy:
    """How prompts are prefilled.

    Attributes:
      bucket: int >= 1 (default 16): prompts are padded to a multiple of this (bounds the
        prefill compiles).
      chunk_size: None (default): a prompt is prefilled in one shot at admission. An int
        C >= 1: in chunks of at most C tokens, one chunk per request and step, sharing steps
        with the other requests' decode (the model's `prefill_chunk`); a request samples its
        first token after its last chunk, and its pages stay resident until then
        (`docs/semantics.md`, chunked prefill). Needs the indexer (`EngineConfig.topk_source`
        None): a chunk selects over the earlier chunks' index keys. The rows, index keys and
        logits equal the one-shot prefill's up to rounding, not bitwise (the chunk's matrix
        products sum in another order: float32 values differ in the last bits, bf16 rows
        may round one step apart), so greedy tokens may differ at a near-tie.
      max_tokens_per_step: None (default: no limit) or an int >= 1: prompt tokens prefilled
        per step, at most, over every request (needs chunk_size): chunks of requests already
        prefilling come first, then admissions, each chunk cut to what the budget leaves.
      synthetic: bool (default False): write deterministic random KV rows for the prompt
        instead of running the model over it (without a topk_source, unit-normal index keys
        too, for the model's indexer to select from); the first generated token is the
        prompt's last token.
      prefix_caching: bool (default False): reuse the published pages of earlier requests
        (`host_tier`'s prefix cache: full pages named by a chained hash of their tokens,
        published once their host copies completed): a prompt that starts with published
        pages prefills only its remaining tokens (the model's `prefill_chunk` from the first
        uncached position, also without chunk_size), its hit pages restored into resident
        blocks (or read by staging: prefix_hit_pages) and their index keys copied into its
        seat (`hisparse_jax/engine/prefix_keys.py`). With `AllResident()` it is seat reuse
        instead: a state row freed by a finished request keeps its rows, and a later prompt
        that extends them (the next turn of a conversation) is admitted into that row and
        prefills only the rest (`StaticResidency`). Not with `NaiveOffload()`; needs the
        indexer (`EngineConfig`'s rules).
      prefix_hit_pages: "restore" (default) or "stage": how a prefix hit's pages without a
        device copy are read by its prefill. "restore" gives each a resident block and a
        whole-page restore from host before the prefill; "stage" leaves them host-only (read
        through the hot region once the request decodes) and each prefill chunk stages just
        the rows its query rows select from them (`docs/semantics.md`, prefill staging).
        "stage" needs prefix_caching and the HiSparse residency.
    """

    bucket: int = 16
    chunk_size: int | None = None
    max_tokens_per_step: int | None = None
    synthetic: bool = False
    prefix_caching: bool = False
    prefix_hit_pages: str = "restore"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming `EngineConfig.prefill.<field>` and the rule it breaks."""
        check_int("prefill.bucket", self.bucket, minimum=1)
        check_int("prefill.chunk_size", self.chunk_size, minimum=1, optional=True)
        check_int("prefill.max_tokens_per_step", self.max_tokens_per_step, minimum=1,
                  optional=True)
        for name in ("synthetic", "prefix_caching"):
            check_bool(f"prefill.{name}", getattr(self, name))
        if self.max_tokens_per_step is not None and self.chunk_size is None:
            raise ValueError("EngineConfig.prefill.max_tokens_per_step needs EngineConfig."
                             "prefill.chunk_size (a one-shot prefill cannot be cut to a step's "
                             "budget)")
        if self.prefix_hit_pages not in PREFIX_HIT_PAGES:
            raise ValueError(f"EngineConfig.prefill.prefix_hit_pages must be one of "
                             f"{PREFIX_HIT_PAGES}, got {self.prefix_hit_pages!r}")
        if self.prefix_hit_pages == "stage" and not self.prefix_caching:
            raise ValueError("EngineConfig.prefill.prefix_hit_pages='stage' needs EngineConfig."
                             "prefill.prefix_caching=True (only prefix hits have host-only "
                             "pages before a prefill)")

    @property
    def stages_prefix_hits(self) -> bool:
        """Prefix caching with prefix_hit_pages "stage": hit pages stay host-only and prefill
        chunks stage the rows they select from them."""
        return self.prefix_caching and self.prefix_hit_pages == "stage"


@dataclasses.dataclass(frozen=True)
class Speculative:
    """Speculative decoding: k draft tokens verified per request and decode step.

    Each step feeds a request's last token and up to k drafts, keeps the drafts that equal
    the tokens sampled before them and one more token (`hisparse_jax.draft_sources`); the
    default hot region grows to 2 (1 + k) top_k rows.

    Attributes:
      num_tokens: k, an int >= 1 and < `Sizes.block_size` (a step's draft rows open at most
        one page; `EngineConfig`'s rule).
      draft: where drafts come from, a `hisparse_jax.draft_sources.DraftSource`, or None
        (default): `MTPDraft()`, the model's MTP module (`draft_source`).
    """

    num_tokens: int
    draft: DraftSource | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming `EngineConfig.speculative.<field>` and the rule it breaks."""
        check_int("speculative.num_tokens", self.num_tokens, minimum=1)
        if self.draft is not None and not isinstance(self.draft, DraftSource):
            raise ValueError("EngineConfig.speculative.draft must be a hisparse_jax."
                             "draft_sources.DraftSource or None, got "
                             f"{type(self.draft).__name__}")

    @property
    def draft_source(self) -> DraftSource:
        """The draft source in effect: `draft`, or `MTPDraft()` when None."""
        return self.draft if self.draft is not None else MTPDraft()


@dataclasses.dataclass(frozen=True)
class Tuning:
    """How the engine runs its kernels and copies; none of these changes the tokens.

    Attributes:
      attention: None (default: the GPU kernel on a GPU, the reference elsewhere) or a
        backend name of `sparse_mla_decode` (`hisparse_jax.ops`); read it as
        `attention_backend` (the deprecated alias "pallas" reads as "triton").
      ops: None (default, as for attention) or a backend name of every data-plane op
        (`DATA_PLANE_OPS`); read it as `ops_backend`.
      copy_programs: None (default) or an int P >= 1: at most P GPU programs move a decode
        step's copies from host, each looping over its share, instead of a program per chunk
        of every row's plan (`HiSparseKVCache.copy_programs`).
      copy_with_attention: bool (default True): with a topk_source each index group after
        the first is looked up ahead, and its copies from host run in the launch of the
        previous group's first attention, by copy_programs programs (32 when None) beside
        the attention's (`HiSparseKVCache.attend`, `sparse_mla_decode_with_copies`), so the
        copies overlap that attention inside one kernel (`docs/host_pool.md`). The model's
        own indexer needs group g's output to select group g + 1's rows, so without a
        topk_source nothing changes. False: every group's copies run at its own lookup, in
        model order.
      pack_host_layers: bool (default True): the host pool keeps the layers of an index group
        side by side, one array per group with rows index_group_size x wider: the group's one
        swap plan then reads each selected host row once for all its layers, and a random
        pinned-host row costs a fixed overhead beside its bytes (`docs/host_pool.md`). False:
        one array per layer. Nothing changes for groups of one layer. Index groups of
        unequal size (`ModelSpec.group_layers`, e.g. (1, 2, 2)): every array holds the same
        number G of layers, all of one group, so G is the greatest common divisor of the
        group sizes (1 for (1, 2, 2): one array per layer; 2 for (2, 4)).
      position_map: bool (default True): each hot state keeps a position map
        (`HiSparseConfig.position_map`; HiSparse residency only): resolve looks every
        selected row up once instead of searching the hot region (`docs/semantics.md`), for
        2 bytes per position, per seat and index group (max_seats * max_model_len * 2 bytes
        each). False: the search rule.
    """

    attention: str | None = None
    ops: str | None = None
    copy_programs: int | None = None
    copy_with_attention: bool = True
    pack_host_layers: bool = True
    position_map: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming `EngineConfig.tuning.<field>` and the rule it breaks; the alias
        "pallas" passes with a DeprecationWarning."""
        check_backend("tuning.attention", self.attention, ATTENTION_OPS)
        check_backend("tuning.ops", self.ops, DATA_PLANE_OPS)
        check_int("tuning.copy_programs", self.copy_programs, minimum=1, optional=True)
        for name in ("copy_with_attention", "pack_host_layers", "position_map"):
            check_bool(f"tuning.{name}", getattr(self, name))

    @property
    def attention_backend(self) -> str | None:
        """The backend `attention` names, as the op registry names it (None: its default)."""
        return backend_name(self.attention)

    @property
    def ops_backend(self) -> str | None:
        """The backend `ops` names, as the op registry names it (None: its default)."""
        return backend_name(self.ops)


@dataclasses.dataclass(frozen=True)
class Debug:
    """Checks for tests and benchmarks; a served engine leaves them off.

    Attributes:
      collect_attention: bool (default False): keep every layer's attention output per
        generated token (`Request.attention`).
      max_traces: None (default) or an int >= 1: wrap the jitted functions in
        `chex.assert_max_traces(n=max_traces)` (chex counts per definition site, across
        engines: call `chex.clear_trace_counter()` before building another engine with it).
    """

    collect_attention: bool = False
    max_traces: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """ValueError naming `EngineConfig.debug.<field>` and the rule it breaks."""
        check_bool("debug.collect_attention", self.collect_attention)
        check_int("debug.max_traces", self.max_traces, minimum=1, optional=True)
