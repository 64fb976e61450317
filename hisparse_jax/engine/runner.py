"""`Runner`: the device side of one engine: dispatch and collection of its jitted steps.

It composes the parts by concern:

  * `StepBuilder` (`step_builder.py`): the jitted steps, built once from static facts (`jitted`:
    "decode_fast" / "decode_hot", "prefill" or "prefill_chunk", "prefill_chunk_staged");
  * `DeviceState` (`device_state.py`): the arrays the steps carry over, the plan's state
    (`apply_plan_state` -> `restore` -> forward -> `after_forward`), and their rebuild
    after a loss (`device_state_lost`, `reset_device_state`);
  * warm-up (`warmup.py`).

The runner itself turns requests into the steps' host inputs (`fill_decode_inputs`: one
numpy assignment per array for the whole batch), dispatches them, and reads back what the
host needs (`collect_decode`: one device-to-host copy per decode step).

Seat = state row: batch row n of the decode step serves the request whose state row is n, so
the per-state-row tables and hot state are read without any renumbering.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np
from flax import nnx

from hisparse_jax.cache import Residency
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.engine import warmup as _warmup
from hisparse_jax.engine.config import EngineConfig
from hisparse_jax.engine.device_state import DeviceState, with_residency
from hisparse_jax.engine.metrics import CompileWatch
from hisparse_jax.engine.request import Request
from hisparse_jax.engine.step_builder import TABLE_FOLD_ROWS, StepBuilder, idle_inputs, variant_name
from hisparse_jax.index_groups import layer_rows
from hisparse_jax.models.protocol import DecodeCache, ServedModel
from host_tier.plan import StepPlan, TableUpdate
from host_tier.sizes import round_up

# Donation is a no-op on some CPU builds; the warning says nothing actionable here.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

__all__ = ["DecodeResult", "PendingDecode", "Runner", "fill_decode_inputs", "variant_name"]


def _int32_bits(value: int) -> int:
    """An int's low 32 bits as an int32 (sampling seeds are folded in as uint32)."""
    return (int(value) + 2 ** 31) % 2 ** 32 - 2 ** 31


def _page_of(host: Callable[[], list[np.ndarray]], j: int) -> tuple[np.ndarray, ...]:
    """Page `j` of a batch of read index keys (`Runner.read_page_keys_later`)."""
    return tuple(g[j] for g in host())


def fill_decode_inputs(reqs: list[Request], inputs: tuple[np.ndarray, ...], *,
                       offset: int = 0, ahead: frozenset[Hashable] = frozenset(),
                       prev_index: np.ndarray | None = None,
                       draft_end: np.ndarray | None = None,
                       max_model_len: int | None = None) -> None:
    """Writes the decode inputs of `reqs` into their seats' rows of `inputs` (tokens,
    positions, state_rows, temperature, seeds, steps, as `Runner.idle_inputs` makes them):
    each request's last token, then its `step_drafts` at the next positions (tokens and
    positions are [S, 1 + k] with speculation, else [S]). `offset`: the batch row of seat 0
    (the mesh engine's data shard d starts at d * seats; the state row stays the seat).

    One numpy assignment per array for the whole batch: element by element, the filling
    cost several microseconds a request, on the host's critical path between model steps.
    A function of its own, so that `bench/host_step.py` times it without a device.

    Asynchronous scheduling (`EngineConfig.async_scheduling`): `ahead` names the requests
    whose previous decode step is still in flight (its token not recorded yet: they are one
    token further than `live` says). Their token is the previous step's device token unless
    it is known on the host (a replayed one): those rows get their seat in `prev_index`
    (int32[S], -1: the host token) and token 0 here. With speculation such a row continues
    its previous step on the device (`step_builder.continue_speculation`): its row and its
    `step_drafts` (placeholders, `Scheduler`) are filled as if that step accepted no draft,
    and `draft_end` (int32[S]) gets the position of its last generated token (prompt +
    max_new_tokens, or `max_model_len`, minus 1), where its draft rows end.
    """
    tokens, positions, state_rows, temperature, seeds, steps = inputs
    S = len(state_rows)
    token_rows, position_rows = tokens.reshape(S, -1), positions.reshape(S, -1)
    if ahead:
        # -1: the token is the in-flight step's, on the device only.
        rows = np.array([(req.seat, live, len(req.prompt),
                          req.generated[live - 1] if live <= len(req.generated) else -1,
                          req.sampling_seed)
                         for req in reqs
                         for live in (req.live + (req.request_id in ahead),)],
                        np.int64).reshape(-1, 5)
    else:
        rows = np.array([(req.seat, req.live, len(req.prompt), req.generated[req.live - 1],
                          req.sampling_seed) for req in reqs], np.int64).reshape(-1, 5)
    seats, lives = rows[:, 0], rows[:, 1]
    at = seats + offset
    token_rows[at, 0] = rows[:, 3]  # its last live token
    if ahead:
        on_device = rows[:, 3] < 0
        if on_device.any() and prev_index is None:
            raise ValueError("fill_decode_inputs: rows fed by the in-flight step's tokens "
                             "need prev_index")
        token_rows[at[on_device], 0] = 0
        prev_index[at[on_device]] = seats[on_device]
    position_rows[at, 0] = rows[:, 2] + lives - 1
    state_rows[at] = seats
    temperature[at] = [req.temperature for req in reqs]
    seeds[at] = rows[:, 4].astype(np.int32)  # the low 32 bits, as `_int32_bits`
    steps[at] = lives - 1  # decode steps since the prefill
    if token_rows.shape[1] > 1:  # speculation: the drafts at the next positions
        for req in reqs:
            if req.step_drafts:
                n = len(req.step_drafts)
                pos = len(req.prompt) + req.live + (req.request_id in ahead)
                token_rows[offset + req.seat, 1:1 + n] = req.step_drafts
                position_rows[offset + req.seat, 1:1 + n] = range(pos, pos + n)
        if ahead and draft_end is not None:
            draft_end[at] = [(max_model_len if req.max_new_tokens is None
                              else len(req.prompt) + req.max_new_tokens) - 1 for req in reqs]


@dataclasses.dataclass(frozen=True)
class PendingDecode:
    """A dispatched decode step whose tokens are not collected yet."""

    requests: list[Request]
    residency: Residency
    started: float  # perf_counter() at dispatch
    # int32[max_seats] by seat, or the verify step's (tokens, counts, drafts) with
    # speculation (async scheduling feeds them back)
    tokens: Any
    aux: dict[str, jax.Array]
    compiles: int  # CompileWatch.count before the dispatch
    # Speculation: the draft rows the host filled per seat (int[max_seats]; the device drops
    # a continued request's rows past its last token: `step.record_decode` counts them).
    draft_rows: np.ndarray | None = None


@dataclasses.dataclass(frozen=True)
class DecodeResult:
    """A collected decode step: tokens int[max_seats, r] by seat (r = 1 + speculative
    tokens; the first counts[seat] are the step's output), hot hits / misses summed over
    rows and groups, rows_moved the misses counted once per layer of their index group
    (None: as misses), attention [L, max_seats, r, h, kv_lora] when collected; drafts
    int[max_seats, k] the next step's on-device drafts (k = 0: none); `compiled`: this process
    compiled something between the dispatch and the collection; draft_rows int[max_seats] the
    draft rows the host filled (`PendingDecode.draft_rows`; None: each request's
    `step_drafts`)."""

    tokens: np.ndarray
    counts: np.ndarray
    hits: int
    misses: int
    attention: np.ndarray | None
    seconds: float
    compiled: bool = False
    drafts: np.ndarray | None = None
    rows_moved: int | None = None
    draft_rows: np.ndarray | None = None


class Runner:
    """Device side of one engine (module docstring).

    Args:
      model: the model (`hisparse_jax.models.ServedModel`); its parameters are split off and
        committed to `device`.
      ec: serving knobs (backends, top-k source, synthetic prefill, buckets, max_traces).
      cfg: sizes (the engine's one `HiSparseConfig`).
      residency: the mode's residency type (the cache keeps it between steps).
      tables: `host_tier.DeviceBlockTables` (src / res / hot per state row).
      transfers: the transfer worker (`before_forward` / `after_forward`).
      host_pool: the pinned `host_tier.HostPool` (None when the mode reads no host rows).
      device: where everything is committed (a device, or a sharding: e.g. one data shard's
        devices of a mesh, `hisparse_jax/engine/mesh.py`).
      params: the parameter leaves (in `jax.tree.flatten` order of the model's `nnx.State`)
        already placed (e.g. tensor-parallel views); None: the model's, committed to `device`.
    """

    # The rows the last `prefill_chunk` staged (from host, from device; summed over index
    # groups): (0, 0) unless it ran the staged variant; and its rows from host counted once
    # per layer of their index group (`layer_rows`).
    staged_rows: tuple[int, int] = (0, 0)
    staged_host_layer_rows: int = 0

    def __init__(self, model: ServedModel, ec: EngineConfig, cfg: HiSparseConfig,
                 residency: Residency, *, tables: Any, transfers: Any, host_pool: Any,
                 device: jax.Device | jax.sharding.Sharding, params: Any = None) -> None:
        self.config, self.cfg, self.residency = ec, cfg, residency
        self.spec = spec = model.spec
        self.transfers, self.device = transfers, device
        graphdef, state = nnx.split(model)
        # Plain leaves at the jit boundary: flattening an nnx.State on every call costs more
        # host time than the rest of the call's dispatch.
        leaves, treedef = jax.tree.flatten(state)
        self.topk_source = None
        if ec.topk_source is not None:
            self.topk_source = ec.topk_source.bind(num_groups=spec.num_groups, top_k=spec.top_k)
        self.num_speculative_tokens = ec.num_speculative_tokens
        # Async scheduling: the decode step takes the previous step's device tokens.
        self.feeds_back = ec.async_scheduling
        self.draft = None if ec.draft is None else ec.draft.bind(vocab_size=spec.vocab_size)
        # The model's per-seat arrays: their shapes and dtypes (started as zeros, and again
        # after a device loss).
        index_keys = jax.eval_shape(functools.partial(
            model.init_index_keys, cfg.max_num_reqs, cfg.max_model_len,
            external_topk=ec.topk_source is not None))
        self.state = DeviceState(
            spec, ec, cfg, residency, tables=tables, transfers=transfers, host_pool=host_pool,
            device=device, params=jax.device_put(leaves, device) if params is None else params,
            index_keys=index_keys, topk_source=self.topk_source)
        self.builder = StepBuilder(graphdef, treedef, spec, cfg, ec, self.topk_source,
                                   self.draft, device)
        self.trace_counts = self.builder.trace_counts
        self.warmed: dict[str, list[Any]] = {}  # the buckets `warmup` compiled, by kind
        # The jitted steps, built once per variant: {"decode_fast", "decode_hot", "prefill" or
        # "prefill_chunk", ...}.
        self.jitted: dict[str, Callable[..., Any]] = self.builder.build(residency)
        if ec.prefill.prefix_caching:
            self._key_pages = min(256, -(-cfg.max_model_len // cfg.block_size))
            self._read_page_keys, self._write_page_keys = self.builder.jit_page_keys()

    # ------------------------------------------------------------------ device state

    @property
    def cache(self) -> DecodeCache:
        """The device cache (`DeviceState.cache`: deferred hot updates applied)."""
        return self.state.cache

    @cache.setter
    def cache(self, cache: DecodeCache) -> None:
        self.state.cache = cache

    @property
    def params(self) -> Any:
        return self.state.params

    @property
    def tables(self) -> Any:
        return self.state.tables

    @property
    def host_pool(self) -> Any:
        return self.state.host_pool

    @property
    def topk_state(self) -> Any:
        return self.state.topk_state

    @topk_state.setter
    def topk_state(self, value: Any) -> None:
        self.state.topk_state = value

    def device_state_lost(self) -> bool:
        """`DeviceState.lost`: an array the steps carry over was deleted or poisoned."""
        return self.state.lost()

    def reset_device_state(self, tables: TableUpdate) -> None:
        """`DeviceState.reset`: fresh arrays, block tables set to `tables`."""
        self.state.reset(tables)

    def apply_plan_state(self, plan: StepPlan) -> None:
        """`DeviceState.apply_plan_state`: the plan's table rows and hot updates."""
        self.state.apply_plan_state(plan)

    def restore(self, plan: StepPlan) -> None:
        """`DeviceState.restore`: the plan's restores handed to the transfer worker."""
        self.state.restore(plan)

    def after_forward(self, plan: StepPlan) -> None:
        """`DeviceState.after_forward`: the plan's spills (enqueued, not waited for)."""
        self.state.after_forward(plan)

    def device_bytes(self) -> int:
        """Bytes of parameters, KV caches, per-seat arrays and hot state on the device."""
        return self.state.device_bytes()

    def warmup(self, *, max_spill_pages: int, decode: bool = True) -> list[Hashable]:
        """Compiles every shape bucket a run can reach (`warmup.warm`); returns the step
        variants it compiled and sets `warmed`."""
        return _warmup.warm(self, max_spill_pages=max_spill_pages, decode=decode)

    def decode_fn(self) -> Callable[..., Any]:
        """The decode step before `jax.jit` (`StepBuilder.decode_fn`)."""
        return self.builder.decode_fn()

    # ------------------------------------------------------------------ decode

    def idle_inputs(self) -> tuple[np.ndarray, ...]:
        """Decode inputs with every batch row padding (`step_builder.idle_inputs`)."""
        return idle_inputs(self.cfg.max_num_reqs, self.num_speculative_tokens)

    def dispatch_decode(self, reqs: list[Request], residency: Residency, *,
                        prev: PendingDecode | None = None,
                        ahead: frozenset[Hashable] = frozenset()) -> PendingDecode:
        """Launches the decode step variant of `residency` for `reqs` (asynchronously). With
        speculation each request's row holds its last token and its `step_drafts`, at
        consecutive positions (-1 past its drafts: no row).

        Async scheduling (`feeds_back`): `prev` is the decode step still in flight and
        `ahead` the requests of it scheduled again (`fill_decode_inputs`): their token is
        taken from `prev.tokens` on the device where the host does not know it."""
        if ahead and (prev is None or not self.feeds_back):
            raise ValueError("dispatch_decode: ahead needs prev (the step in flight) and "
                             "EngineConfig.async_scheduling")
        inputs, S = self.idle_inputs(), self.cfg.max_num_reqs
        prev_index = np.full(S, -1, np.int32) if self.feeds_back else None
        spec = self.num_speculative_tokens
        draft_end = np.zeros(S, np.int32) if self.feeds_back and spec else None
        fill_decode_inputs(reqs, inputs, ahead=ahead, prev_index=prev_index,
                           draft_end=draft_end, max_model_len=self.cfg.max_model_len)
        compiles = CompileWatch.count
        t0 = time.perf_counter()
        next_tokens, aux = self.run_decode(residency, *inputs, prev_index=prev_index,
                                           draft_end=draft_end,
                                           prev_tokens=None if prev is None else prev.tokens)
        draft_rows = (inputs[1][:, 1:] >= 0).sum(1) if spec else None
        return PendingDecode(reqs, residency, t0, next_tokens, aux, compiles, draft_rows)

    def run_decode(self, residency: Residency, *host_arrays: np.ndarray,
                   prev_index: np.ndarray | None = None, prev_tokens: Any = None,
                   draft_end: np.ndarray | None = None
                   ) -> tuple[Any, dict[str, jax.Array]]:
        """Dispatches the decode variant of `residency` on host-built arrays (tokens,
        positions, state_rows, temperature, seeds, steps: `idle_inputs`' shapes and dtypes),
        sent as one packed int32 array (`StepBuilder.jit_decode`). With `feeds_back` the
        packed array also carries `prev_index` (int32[S], default every row -1: the host
        token), with speculation then `draft_end` (int32[S], default zeros: read only for
        rows fed by the previous step), and the step takes `prev_tokens` (a previous step's
        device tokens, `PendingDecode.tokens`; default zeros)."""
        state = self.state
        extra: tuple[Any, ...] = ()
        if self.feeds_back:
            S = self.cfg.max_num_reqs
            if prev_index is None:
                prev_index = np.full(S, -1, np.int32)
            host_arrays = (*host_arrays, prev_index)
            if self.num_speculative_tokens:
                host_arrays += (np.zeros(S, np.int32) if draft_end is None else draft_end,)
            extra = (state.no_prev_tokens if prev_tokens is None else prev_tokens,)
        tables, table_rows = state.tables.take_deferred(TABLE_FOLD_ROWS)
        inputs = state.put(np.concatenate([a.reshape(-1).view(np.int32) for a in host_arrays]
                                          + [table_rows, state.hot_rows()]))
        host_pools = state.host_pool.arrays if residency.reads_host else ()
        cache = with_residency(state.raw_cache, residency)
        next_tokens, cache, aux, tables = self.jitted[variant_name(residency)](
            state.params, cache, inputs, tables, host_pools, state.sample_key, state.topk_state,
            *extra)
        state.hot_deferred = None  # in the new cache now
        state.tables.adopt(tables)
        # Kept under the residency it ran with: a run of fast decode steps rebuilds no pytree
        # between them (the prefills put the mode's residency back: one prefill variant).
        state.cache = cache
        return next_tokens, aux

    def collect_decode(self, pending: PendingDecode, *, since: float | None = None
                       ) -> DecodeResult:
        """Waits for a dispatched decode step's tokens and counters. Its `seconds` run from
        the dispatch, or from `since` when later (async scheduling: the previous step's
        collection, so that overlapping steps do not count the same time twice)."""
        # One device-to-host copy: the step packed its tokens and counter sums
        # (`StepBuilder.jit_decode`).
        flat = np.asarray(pending.aux["to_host"])
        parts, at = [], 0
        for leaf in jax.tree.leaves(pending.tokens):
            parts.append(flat[at:at + leaf.size].reshape(leaf.shape))
            at += leaf.size
        out = jax.tree.unflatten(jax.tree.structure(pending.tokens), parts)
        hits, misses, rows_moved = flat[at:at + 3]
        started = pending.started if since is None else max(pending.started, since)
        seconds = time.perf_counter() - started
        S = self.cfg.max_num_reqs
        attention = np.asarray(pending.aux["attention"]) if "attention" in pending.aux else None
        if self.num_speculative_tokens:
            tokens, counts, drafts = out
            if attention is not None:
                attention = attention.reshape(attention.shape[0], S, -1, *attention.shape[2:])
        else:
            tokens, counts, drafts = out[:, None], np.ones(S, np.int32), None
            if attention is not None:
                attention = attention[:, :, None]
        return DecodeResult(tokens, counts, int(hits), int(misses), attention,
                            seconds, compiled=CompileWatch.count != pending.compiles,
                            drafts=drafts, rows_moved=int(rows_moved),
                            draft_rows=pending.draft_rows)

    # ------------------------------------------------------------------ prefill

    def prefill_length(self, num_tokens: int) -> int:
        """The padded length T of a prompt of `num_tokens` tokens: a multiple of
        `EngineConfig.prefill.bucket`, at most max_model_len (one compiled prefill per T)."""
        return min(round_up(num_tokens, self.config.prefill.bucket), self.cfg.max_model_len)

    def prefill(self, req: Request, res_blocks: np.ndarray
                ) -> tuple[int, np.ndarray | None, float, Hashable, bool]:
        """Prefills an admitted request's prompt into its resident blocks `res_blocks`
        (int64[pages]); returns (sampled token, attention [L, h, kv_lora] or None, seconds,
        variant, whether something compiled meanwhile)."""
        B = self.cfg.block_size
        tokens = req.prompt
        n = len(tokens)
        T = self.prefill_length(n)
        padded = np.zeros(T, np.int32)
        padded[:n] = tokens
        pos = np.arange(n)
        write_rows = np.full(T, -1, np.int32)
        write_rows[:n] = res_blocks[pos // B] * B + pos % B
        compiles = CompileWatch.count
        if self.topk_source is not None:
            self.topk_state = self.topk_source.admit(self.topk_state, req.seat, req.index, n)
        t0 = time.perf_counter()
        token, aux = self.run_prefill(padded, n, req.seat, write_rows, req.temperature,
                                   req.sampling_seed, req.live, req.index)
        token = int(token)
        attention = np.asarray(aux["attention"]) if "attention" in aux else None
        return (token, attention, time.perf_counter() - t0, ("prefill", T),
                CompileWatch.count != compiles)

    def prefill_chunk(self, req: Request, res_blocks: np.ndarray, start: int, num_tokens: int,
                      host_blocks: np.ndarray | None = None
                      ) -> tuple[int, np.ndarray | None, float, Hashable, bool]:
        """Prefills prompt tokens [start, start + num_tokens) of an admitted request whose
        resident blocks `res_blocks` (int64[pages]) hold every page from the chunk's first
        page to its last position (the model's `prefill_chunk`); returns what `prefill`
        returns, the sampled token meaningful after the prompt's last chunk only. A page
        before the chunk's first page may be host-only (null in `res_blocks`) when
        `host_blocks` (int64[>= pages], the request's host blocks) is given: the chunk then
        runs as "prefill_chunk_staged" (its selected host-only rows staged from the host
        pool; `staged_rows` counts them) whenever such a page exists."""
        T = self.prefill_length(num_tokens)
        padded = np.zeros(T, np.int32)
        padded[:num_tokens] = req.prompt[start:start + num_tokens]
        pages = np.zeros(self.cfg.max_pages, np.int32)
        pages[:len(res_blocks)] = res_blocks
        host, self.staged_rows, self.staged_host_layer_rows = None, (0, 0), 0
        if host_blocks is not None and np.any(pages[:start // self.cfg.block_size] <= 0):
            host = np.zeros(self.cfg.max_pages, np.int32)
            host[:len(host_blocks)] = host_blocks
        compiles = CompileWatch.count
        t0 = time.perf_counter()
        token, aux = self.run_prefill_chunk(padded, start, num_tokens, req.seat, pages,
                                         req.temperature, req.sampling_seed, req.live,
                                         host_pages=host)
        token = int(token)
        attention = np.asarray(aux["attention"]) if "attention" in aux else None
        kind = "prefill_chunk"
        if host is not None:
            kind = "prefill_chunk_staged"
            from_host = np.asarray(aux["staged_rows_host"])
            self.staged_rows = (int(from_host.sum()),
                                int(np.asarray(aux["staged_rows_device"]).sum()))
            self.staged_host_layer_rows = int(layer_rows(
                from_host, self.spec.group_layers, what='prefill_chunk aux["staged_rows_host"]'))
        return (token, attention, time.perf_counter() - t0, (kind, T),
                CompileWatch.count != compiles)

    def run_prefill_chunk(self, padded: np.ndarray, start: int, length: int, seat: int,
                          pages: np.ndarray, temperature: float, seed: int, token_index: int,
                          *, host_pages: np.ndarray | None = None
                          ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Dispatches the chunk prefill of padded tokens int32[T] (the first `length` real)
        at positions from `start`, of state row `seat` (out of range: no index-key row) with
        block-table row `pages` int32[max_pages] (0: none, nothing written); samples token
        `token_index` of sampling seed `seed`. With `host_pages` int32[max_pages] (the host
        block-table row) the staged variant, which also takes the host pools."""
        state = self.state
        args = [state.params, state.mode_cache(),
                *state.put((padded, np.int32(start), np.int32(length), np.int32(seat), pages,
                            np.float32(temperature))),
                state.sample_key, *state.put((np.int32(_int32_bits(seed)),
                                              np.int32(token_index)))]
        name = "prefill_chunk"
        if host_pages is not None:
            name = "prefill_chunk_staged"
            args += [state.put(host_pages), state.host_pool.arrays]
        token, cache, aux = self.jitted[name](*args)
        state.cache = cache
        return token, aux

    def run_prefill(self, padded: np.ndarray, length: int, seat: int, write_rows: np.ndarray,
                    temperature: float, seed: int, token_index: int, request_index: int
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Dispatches the prefill of padded tokens int32[T] (the first `length` real) written
        to flat rows write_rows int32[T] (-1: none) and index-key row `seat` (out of range:
        none); samples token `token_index` of sampling seed `seed`."""
        state = self.state
        args = [state.params, state.mode_cache(),
                *state.put((padded, np.int32(length), np.int32(seat), write_rows,
                            np.float32(temperature))),
                state.sample_key, *state.put((np.int32(_int32_bits(seed)),
                                              np.int32(token_index)))]
        if self.config.prefill.synthetic:
            args.append(np.int32(request_index))
        token, cache, aux = self.jitted["prefill"](*args)
        state.cache = cache
        return token, aux

    # ------------------------------------------------------------------ per-seat arrays of pages

    def _page_batches(self, pages: list[int]) -> list[tuple[list[int], np.ndarray]]:
        """`pages` in batches of `_key_pages`, each with its int32 page array padded with -1."""
        P = self._key_pages
        out = []
        for i in range(0, len(pages), P):
            part = pages[i:i + P]
            padded = np.full(P, -1, np.int32)
            padded[:len(part)] = part
            out.append((part, padded))
        return out

    def read_page_keys(self, seat: int, pages: list[int]) -> list[tuple[np.ndarray, ...]]:
        """The index keys of full pages `pages` of the request in state row `seat`: per page,
        one [B, index_dim] host array per index group (prefix caching only). Waits for them."""
        return [keys() for keys in self.read_page_keys_later(seat, pages)]

    def read_page_keys_later(self, seat: int, pages: list[int]
                             ) -> list[Callable[[], tuple[np.ndarray, ...]]]:
        """`read_page_keys` without waiting: dispatches the reads (ordered on the device
        before any later write to the seat) and starts their copies to the host; per page, a
        function that returns its keys (waiting for the copy the first time). So a step that
        stages the keys of pages it sealed does not wait for the step dispatched after it."""
        batches = self._page_batches(pages)
        out: list[Callable[[], tuple[np.ndarray, ...]]] = []
        for part, padded in batches:
            groups = self._read_page_keys(self.cache.index_keys,
                                          *self.state.put((np.int32(seat), padded)))
            for g in groups:
                g.copy_to_host_async()
            host = functools.cache(lambda groups=groups: [np.asarray(g) for g in groups])
            out += [functools.partial(_page_of, host, j) for j in range(len(part))]
        return out

    def write_page_keys(self, seat: int, pages: list[tuple[int, tuple[np.ndarray, ...]]]
                        ) -> None:
        """Writes index keys (page, per-group [B, index_dim]) into state row `seat`'s rows of
        those pages (prefix caching: a hit's reused pages, before its prefill)."""
        if not pages:
            return
        index_keys = self.cache.index_keys
        by_page = dict(pages)
        num_groups = len(index_keys)
        for part, padded in self._page_batches([p for p, _ in pages]):
            keys = []
            for g in range(num_groups):
                block = np.zeros((len(padded), *by_page[part[0]][g].shape),
                                 by_page[part[0]][g].dtype)
                block[:len(part)] = [by_page[p][g] for p in part]
                keys.append(block)
            index_keys = self._write_page_keys(
                index_keys, *self.state.put((np.int32(seat), padded, tuple(keys))))
        self.cache = dataclasses.replace(self.cache, index_keys=tuple(index_keys))

    # ------------------------------------------------------------------ warmup

