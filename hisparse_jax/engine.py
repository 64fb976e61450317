"""`Engine`: continuous-batching decode of a `hisparse_jax.nn.Transformer` with the host tier.

One engine step is one scheduler pass and one model step:

  1. worker reports (spills enqueued / completed) go to the `Coordinator`;
  2. running requests are scheduled (their last sampled token is written this step), then
     waiting requests are admitted while seats (state rows) are free and a hot region's
     worth of device blocks stays free after the admission; when nothing can run
     and no copy is in flight, the most recently admitted waiting request is preempted
     (recompute: it is re-admitted later with its generated tokens as part of the prompt);
  3. the plan is executed in order: table rows -> hot resets / invalidations -> restores ->
     forward (one jitted decode step for the seats, one jitted prefill per admitted request)
     -> spills; then the sampled tokens are checked against each request's stop conditions.

The decode step is ONE `jax.jit` over fixed shapes (N = max_seats batch rows, padding rows
have state row -1) with the `DecodeCache` donated. There are two variants, each compiled
once: the HiSparse step (resolve + gather + attend) and the fast step used when every
scheduled request's context pages are still resident (upstream `all_context_pages_resident`),
which maps top-k positions straight through the resident table and never touches the host
tier. `all_resident=True` runs the same engine with every KV row on the device and no host
tier at all: the baseline and the exactness reference. `naive_offload=True` is the other
baseline: every row lives on the host and every selected row is copied to the device every
step (no hot-region reuse).

For benchmarks at long contexts the top-k can come from a `hisparse_jax.topk_sources`
source (a drift model or a replayed trace) instead of the indexer, and `synthetic_prefill`
writes deterministic random KV rows (a function of request, layer and position) straight into
the caches instead of running the model over the prompt; decode always runs the model.

Every array the jitted functions take is committed to the device up front, so each variant
compiles once (an uncommitted argument that later arrives committed would compile again).

Seat = state row: batch row n of the decode step serves the request whose coordinator state
row is n, so the per-state-row tables and hot state are read without any renumbering.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import time
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax import ops
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.nn import DecodeBatch, DecodeCache, Transformer, write_cache_rows
from hisparse_jax.state import init_hot_state
from hisparse_jax.topk_sources import TopKSource

# Donation is a no-op on some CPU builds; the warning says nothing actionable here.
warnings.filterwarnings("ignore", message="Some donated buffers were not usable")


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


@dataclasses.dataclass
class Request:
    """A generation request and its progress (the engine's record)."""

    request_id: Hashable
    prompt: tuple[int, ...]  # a tuple of ints: untracked by the GC (long prompts stay cheap)
    max_new_tokens: int
    index: int = 0  # order of add_request (seeds the top-k source and synthetic rows)
    temperature: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    generated: list[int] = dataclasses.field(default_factory=list)
    seat: int = -1
    finish_reason: str | None = None
    attention: list[np.ndarray] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.generated]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)


@dataclasses.dataclass
class Metrics:
    """Counters of an engine run (see `summary` for the derived figures)."""

    steps: int = 0
    decode_steps: int = 0
    fast_steps: int = 0
    prefills: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    hot_hits: int = 0
    hot_misses: int = 0
    rows_moved: int = 0
    bytes_moved: int = 0
    decode_seconds: float = 0.0  # first call of each jitted variant excluded (compile)
    prefill_seconds: float = 0.0
    compile_seconds: float = 0.0  # first calls (trace + compile + run)
    wall_seconds: float = 0.0
    rows_moved_per_step: list[int] = dataclasses.field(default_factory=list)
    preemptions: int = 0
    waits: int = 0


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _sample(logits: jax.Array, temperature: jax.Array, key: jax.Array) -> jax.Array:
    """Greedy where temperature <= 0, else a draw from softmax(logits / temperature)."""
    greedy = jnp.argmax(logits, -1).astype(jnp.int32)
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    drawn = jax.random.categorical(key, logits / t, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


class Engine:
    """Continuous-batching decode with the HiSparse host tier (or all-resident).

    Usage::

        engine = Engine(nn.init_model("tiny"), EngineConfig(...))
        engine.add_request([1, 2, 3], max_new_tokens=16)
        outputs = engine.run()            # {request_id: Request}
        print(engine.summary())
    """

    def __init__(self, model: Transformer, config: EngineConfig = EngineConfig(), *,
                 host_pool: Any = None) -> None:
        """Args:
          model: the model (its parameters are split off and committed to the device).
          config: serving knobs.
          host_pool: an existing `host_tier.HostPool` to use (and not close): e.g. one pool
            shared by engines that run one after another, instead of pinning a new pool per
            engine. Its block count replaces `config.num_host_blocks`.
        """
        self.model_config = mc = model.cfg
        self.config = ec = config
        if ec.all_resident and ec.naive_offload:
            raise ValueError("EngineConfig: all_resident and naive_offload exclude each other")
        if ec.synthetic_prefill and ec.topk_source is None:
            raise ValueError("EngineConfig.synthetic_prefill requires topk_source (the indexer "
                             "has no keys for a prompt that was not run through the model)")
        if ec.topk_source is not None and not isinstance(ec.topk_source, TopKSource):
            raise ValueError("EngineConfig.topk_source must be a hisparse_jax.topk_sources."
                             f"TopKSource, got {type(ec.topk_source).__name__}")
        self.device = device = jax.devices()[0]
        self.graphdef, params = nnx.split(model)
        # Plain leaves at the jit boundary: flattening an nnx.State on every call costs more
        # host time than the rest of the call's dispatch.
        leaves, self._params_treedef = jax.tree.flatten(params)
        self.params = self._put(leaves)
        B = ec.block_size
        self.B = B
        self.max_pages = -(-ec.max_model_len // B)
        hot_size = ec.hot_size or _round_up((1 if ec.naive_offload else 2) * mc.top_k, B)
        self.hs_config = HiSparseConfig(top_k=mc.top_k, hot_size=hot_size, block_size=B,
                                        max_num_reqs=ec.max_seats, row_width=mc.row_width,
                                        kv_dtype=mc.kv_dtype)
        self.row_bytes = self.hs_config.row_bytes
        S = ec.max_seats
        if ec.all_resident:
            num_gpu_blocks = 1 + S * self.max_pages
        else:
            num_gpu_blocks = ec.num_gpu_blocks or 1 + S * (self.max_pages
                                                           + self.hs_config.hot_blocks)
        self.num_gpu_blocks = num_gpu_blocks
        kv_dt = jnp.dtype(mc.kv_dtype)
        # With an external top-k source the indexer never runs: no key cache to speak of.
        key_shape = ((1, 1, mc.index_dim) if ec.topk_source is not None
                     else (S, ec.max_model_len, mc.index_dim))
        self.cache = self._put(DecodeCache(
            kv=tuple(jnp.zeros((num_gpu_blocks, B, mc.row_width), kv_dt)
                     for _ in range(mc.num_layers)),
            index_keys=tuple(jnp.zeros(key_shape, kv_dt) for _ in range(mc.num_groups)),
            hot=tuple(init_hot_state(self.hs_config) for _ in range(mc.num_groups))))
        self.topk_source = self.topk_state = None
        if ec.topk_source is not None:
            self.topk_source = ec.topk_source.bind(num_groups=mc.num_groups, top_k=mc.top_k)
            self.topk_state = self._put(self.topk_source.init_state(
                max_seats=S, max_model_len=ec.max_model_len, num_groups=mc.num_groups,
                top_k=mc.top_k))

        self.coord = self.host_pool = self.transfer = self.tables = None
        self._owns_pool = False
        if ec.all_resident:
            res = np.zeros((S, self.max_pages), np.int32)
            res[:] = 1 + np.arange(S * self.max_pages, dtype=np.int32).reshape(S, -1)
            self._static_tables = self._put((np.zeros_like(res), res,
                                             np.zeros((S, self.hs_config.hot_blocks), np.int32)))
            self._free_seats = list(range(S))
            self.host_rows = 0
        else:
            from host_tier import Coordinator, DeviceBlockTables, HostPool, TransferEngine

            num_host_blocks = ec.num_host_blocks or 1 + (S + 1) * self.max_pages
            if host_pool is not None:
                want = (mc.num_layers, B, mc.row_width, np.dtype(kv_dt))
                have = (host_pool.num_layers, host_pool.block_size, host_pool.row_width,
                        host_pool.dtype)
                if have != want or host_pool.closed:
                    raise ValueError(f"Engine host_pool must be an open HostPool of (layers, "
                                     f"block_size, row_width, dtype) = {want}, got {have}")
                num_host_blocks = host_pool.num_blocks
            self.coord = Coordinator(
                block_size=B, num_gpu_blocks=num_gpu_blocks, num_host_blocks=num_host_blocks,
                hot_blocks=self.hs_config.hot_blocks, max_num_reqs=S,
                max_model_len=ec.max_model_len, enable_prefix_caching=False,
                offload_all=ec.naive_offload)
            self._owns_pool = host_pool is None
            self.host_pool = host_pool or HostPool(num_layers=mc.num_layers, block_size=B,
                                                   row_width=mc.row_width, dtype=kv_dt,
                                                   num_blocks=num_host_blocks, device=device)
            self.transfer = TransferEngine(self.host_pool, mirror_fn=ops.mirror_rows,
                                           restore_fn=ops.restore_rows)
            self.tables = DeviceBlockTables(S, self.max_pages, self.hs_config.hot_blocks,
                                            device=device)
            self.host_rows = num_host_blocks * B

        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[Hashable, Request] = {}  # admission order
        self.finished: dict[Hashable, Request] = {}
        self.metrics = Metrics()
        self.trace_counts: collections.Counter[str] = collections.Counter()
        self._ids = itertools.count()
        self._key = self._put(jax.random.PRNGKey(ec.seed))
        self._step_counter = 0
        self._compiled: set[Hashable] = set()
        self._decode_tokens = 0  # tokens of steady-state (timed) decode steps
        self._decode_fast = self._jit_decode(use_host_tier=False)
        self._decode_hot = None if ec.all_resident else self._jit_decode(use_host_tier=True)
        self._prefill = (self._jit_synthetic_prefill() if ec.synthetic_prefill
                         else self._jit_prefill())

    def _put(self, tree: Any) -> Any:
        """Commits a pytree of arrays to the engine's device."""
        return jax.device_put(tree, self.device)

    # ------------------------------------------------------------------ jitted steps

    def _wrap(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        counts = self.trace_counts

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            counts[name] += 1  # runs once per trace
            return fn(*args, **kwargs)

        traced.__name__ = traced.__qualname__ = name  # chex tells the variants apart by name

        if self.config.max_traces is not None:
            import chex

            traced = chex.assert_max_traces(traced, n=self.config.max_traces)
        return traced

    def _jit_decode(self, *, use_host_tier: bool) -> Callable[..., Any]:
        graphdef, ec = self.graphdef, self.config
        kwargs = dict(block_size=self.B, use_host_tier=use_host_tier, host_rows=self.host_rows,
                      attention_backend=ec.attention_backend, ops_backend=ec.ops_backend,
                      collect_attention=ec.collect_attention,
                      naive_offload=ec.naive_offload and use_host_tier)
        source = self.topk_source

        treedef = self._params_treedef

        def step(params, cache, batch, host_pools, temperature, key, counter, topk_state, steps):
            params = jax.tree.unflatten(treedef, params)
            key = jax.random.fold_in(key, counter)
            if source is not None:
                batch = dataclasses.replace(batch, topk=source.select(
                    topk_state, batch.state_rows, batch.positions, steps))
            model = nnx.merge(graphdef, params)
            logits, cache, aux = model.decode(cache, batch, host_pools, **kwargs)
            return _sample(logits, temperature, key), cache, aux

        name = "decode_hot" if use_host_tier else "decode_fast"
        return jax.jit(self._wrap(step, name), donate_argnames=("cache",))

    def _jit_prefill(self) -> Callable[..., Any]:
        graphdef, ec, treedef = self.graphdef, self.config, self._params_treedef

        def prefill(params, cache, tokens, length, state_row, write_rows, temperature, key,
                    counter):
            params = jax.tree.unflatten(treedef, params)
            key = jax.random.fold_in(key, counter)
            model = nnx.merge(graphdef, params)
            logits, cache, aux = model.prefill(
                cache, tokens, length, state_row, write_rows,
                attention_backend=ec.attention_backend, collect_attention=ec.collect_attention)
            return _sample(logits[None], temperature[None], key)[0], cache, aux

        return jax.jit(self._wrap(prefill, "prefill"), donate_argnames=("cache",))

    def _jit_synthetic_prefill(self) -> Callable[..., Any]:
        num_layers, width = self.model_config.num_layers, self.model_config.row_width
        base = jax.random.PRNGKey(self.config.seed)

        def prefill(params, cache, tokens, length, state_row, rows_at, temperature, key,
                    counter, request_index):
            del params, state_row, temperature, key, counter
            T = tokens.shape[0]
            req_key = jax.random.fold_in(base, request_index)
            pos = jnp.arange(T, dtype=jnp.int32)
            kv = list(cache.kv)
            for layer in range(num_layers):
                layer_key = jax.random.fold_in(req_key, layer)
                keys = jax.vmap(lambda p, k=layer_key: jax.random.fold_in(k, p))(pos)
                rows = jax.vmap(lambda k: jax.random.normal(k, (width,)))(keys)
                kv[layer] = write_cache_rows(kv[layer], rows_at, rows)
            return tokens[length - 1], dataclasses.replace(cache, kv=tuple(kv)), {}

        return jax.jit(self._wrap(prefill, "prefill"), donate_argnames=("cache",))

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: Sequence[int], *, max_new_tokens: int,
                    temperature: float = 0.0, stop_token_ids: Sequence[int] = (),
                    request_id: Hashable | None = None) -> Hashable:
        """Queues a request; returns its id. Stops at `max_new_tokens`, at a stop token (kept
        in the output) or at `max_model_len` tokens."""
        prompt = tuple(int(t) for t in prompt)
        if not prompt:
            raise ValueError("add_request: prompt must not be empty")
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt):
            raise ValueError(f"add_request: token ids must be in [0, "
                             f"{self.model_config.vocab_size})")
        if len(prompt) >= self.config.max_model_len:
            raise ValueError(f"add_request: prompt of {len(prompt)} tokens leaves no room under "
                             f"max_model_len={self.config.max_model_len}")
        if max_new_tokens < 1:
            raise ValueError("add_request: max_new_tokens must be >= 1")
        index = next(self._ids)
        rid = index if request_id is None else request_id
        self.waiting.append(Request(rid, prompt, int(max_new_tokens), index, float(temperature),
                                    frozenset(int(t) for t in stop_token_ids)))
        return rid

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self, *, on_step: Callable[[Engine], None] | None = None,
            max_steps: int | None = None) -> dict[Hashable, Request]:
        """Steps until every request finished; returns the finished requests by id."""
        t0 = time.perf_counter()
        n = 0
        while self.has_work and (max_steps is None or n < max_steps):
            self.step()
            n += 1
            if on_step is not None:
                on_step(self)
        if self.transfer is not None:
            self._deliver(wait=True)
        self.metrics.wall_seconds += time.perf_counter() - t0
        return dict(self.finished)

    # ------------------------------------------------------------------ one step

    def step(self) -> list[Request]:
        """One scheduler pass and model step; returns the requests that finished in it."""
        if self.config.all_resident:
            return self._step_all_resident()
        coord = self.coord
        self._deliver()
        decode, waited = [], []
        for req in list(self.running.values()):
            result = coord.schedule(req.request_id, new_token_ids=[req.generated[-1]])
            (waited if result is not None else decode).append(req)
        self.metrics.waits += len(waited)
        admitted = []
        while self.waiting and len(self.running) + len(admitted) < self.config.max_seats:
            req = self.waiting[0]
            # Admission keeps a hot region's worth of blocks free while others run, so a
            # running request that crosses the watermark can get its hot region (and start
            # unpinning) instead of stalling until someone is preempted.
            need = -(-req.num_tokens // self.B)
            if ((self.running or admitted)
                    and coord.device_pool.num_free - need < self.hs_config.hot_blocks):
                self.metrics.waits += 1
                # Running requests move to hot regions and unpin pages until it fits.
                coord.request_room(need + self.hs_config.hot_blocks)
                break
            result = coord.admit(req.request_id, req.tokens)
            if not hasattr(result, "state_row"):  # Wait
                self.metrics.waits += 1
                break
            coord.request_room(0)
            self.waiting.popleft()
            req.seat = result.state_row
            admitted.append(req)
        if not decode and not admitted:
            if coord.has_pending_transfers() or self.transfer.num_in_flight:
                self._deliver(wait=True)  # completions free blocks
            elif waited and len(self.running) == 1:
                # Re-admitting it would replay the same stall forever.
                raise RuntimeError(
                    "Engine: a lone request cannot hold its pages plus a hot region in the "
                    f"device pool ({self.num_gpu_blocks} blocks, hot region "
                    f"{self.hs_config.hot_blocks}); raise num_gpu_blocks")
            elif waited:
                self._preempt(waited[-1])
            elif self.waiting:
                raise RuntimeError("Engine: a waiting request cannot be admitted into an idle "
                                   "engine; raise num_gpu_blocks / num_host_blocks")
            return []
        plan = coord.build_plan()
        self.metrics.steps += 1
        self.tables.apply(plan.tables)
        if plan.hot_resets or plan.hot_invalidations:
            from hisparse_jax._moved_from_host_tier import apply_hot_updates

            self.cache = dataclasses.replace(self.cache, hot=tuple(
                apply_hot_updates(plan, h, block_size=self.B) for h in self.cache.hot))
        kv = self.transfer.before_forward(plan, self.cache.kv)
        self.cache = dataclasses.replace(self.cache, kv=tuple(kv))
        finished = []
        pending = None
        if decode:
            fast = not self.config.naive_offload and all(
                self.coord.all_pages_resident(req.request_id) for req in decode)
            pending = self._dispatch_decode(decode, fast=fast)
        for req in admitted:
            view = coord.view(req.request_id)
            finished += self._run_prefill(req, np.asarray(view.resident_blocks, np.int64))
        # The spills and the worker reports run on the host while the device decodes; the
        # sampled tokens are waited for last.
        self.transfer.after_forward(plan, self.cache.kv)
        self._deliver()
        if pending is not None:
            finished = self._finish_decode(pending) + finished
        return finished

    def _step_all_resident(self) -> list[Request]:
        decode = list(self.running.values())
        admitted = []
        while self.waiting and self._free_seats:
            req = self.waiting.popleft()
            req.seat = self._free_seats.pop(0)
            admitted.append(req)
        if not decode and not admitted:
            return []
        self.metrics.steps += 1
        finished = (self._finish_decode(self._dispatch_decode(decode, fast=True)) if decode
                    else [])
        res = np.asarray(self._static_tables[1])
        for req in admitted:
            finished += self._run_prefill(req, res[req.seat].astype(np.int64))
        return finished

    def _next_key(self) -> tuple[jax.Array, np.int32]:
        """The sampling key and the counter the jitted step folds into it."""
        self._step_counter += 1
        return self._key, np.int32(self._step_counter)

    def _dispatch_decode(self, reqs: list[Request], *, fast: bool) -> tuple:
        """Launches the jitted decode step for `reqs` (asynchronously); `_finish_decode`
        waits for its tokens."""
        S = self.config.max_seats
        tokens = np.zeros(S, np.int32)
        positions = np.zeros(S, np.int32)
        state_rows = np.full(S, -1, np.int32)
        temperature = np.zeros(S, np.float32)
        steps = np.zeros(S, np.int32)
        for req in reqs:
            tokens[req.seat] = req.generated[-1]
            positions[req.seat] = req.num_tokens - 1
            state_rows[req.seat] = req.seat
            temperature[req.seat] = req.temperature
            steps[req.seat] = len(req.generated) - 1  # decode steps since the prefill
        if self.config.all_resident:
            src, res, hot = self._static_tables
            host_pools = ()
        else:
            src, res, hot = self.tables.src, self.tables.res, self.tables.hot
            host_pools = self.host_pool.arrays
        t0 = time.perf_counter()
        tokens, positions, state_rows, temperature, steps = self._put(
            (tokens, positions, state_rows, temperature, steps))
        batch = DecodeBatch(tokens, positions, state_rows, src, res, hot)
        fn = self._decode_fast if fast else self._decode_hot
        next_tokens, self.cache, aux = fn(self.params, self.cache, batch,
                                          host_pools if not fast else (), temperature,
                                          *self._next_key(), self.topk_state, steps)
        return reqs, fast, t0, next_tokens, aux

    def _finish_decode(self, pending: tuple) -> list[Request]:
        """Waits for a dispatched decode step; records its tokens and metrics."""
        reqs, fast, t0, next_tokens, aux = pending
        next_tokens, hits, misses = jax.device_get((next_tokens, aux["hits"], aux["misses"]))
        m = self.metrics
        if self._account("decode_fast" if fast else "decode_hot", time.perf_counter() - t0,
                         "decode_seconds"):
            self._decode_tokens += len(reqs)
        m.decode_steps += 1
        m.fast_steps += int(fast)
        m.hot_hits += int(hits.sum())
        m.hot_misses += int(misses.sum())
        rows = int(misses.sum()) * self.model_config.index_group_size
        m.rows_moved += rows
        m.bytes_moved += rows * self.row_bytes
        m.rows_moved_per_step.append(rows)
        attention = np.asarray(aux["attention"]) if "attention" in aux else None
        finished = []
        for req in reqs:
            if attention is not None:
                req.attention.append(attention[:, req.seat])
            if self._append(req, int(next_tokens[req.seat])):
                finished.append(req)
        return finished

    def _run_prefill(self, req: Request, res_blocks: np.ndarray) -> list[Request]:
        ec = self.config
        tokens = req.tokens
        n = len(tokens)
        T = min(_round_up(n, ec.prefill_bucket), ec.max_model_len)
        padded = np.zeros(T, np.int32)
        padded[:n] = tokens
        pos = np.arange(n)
        write_rows = np.full(T, -1, np.int32)
        write_rows[:n] = res_blocks[pos // self.B] * self.B + pos % self.B
        if self.topk_source is not None:
            self.topk_state = self.topk_source.admit(self.topk_state, req.seat, req.index, n)
        t0 = time.perf_counter()
        args = [self.params, self.cache, *self._put((padded, np.int32(n), np.int32(req.seat),
                                                     write_rows, np.float32(req.temperature))),
                *self._next_key()]
        if self.config.synthetic_prefill:
            args.append(np.int32(req.index))
        token, self.cache, aux = self._prefill(*args)
        token = int(token)
        self._account(("prefill", T), time.perf_counter() - t0, "prefill_seconds")
        self.metrics.prefills += 1
        self.metrics.prompt_tokens += n
        self.running[req.request_id] = req
        if "attention" in aux:
            req.attention.append(np.asarray(aux["attention"]))
        return [req] if self._append(req, token) else []

    def _account(self, variant: Hashable, seconds: float, field: str) -> bool:
        """Adds a call's time to `field`, or to compile_seconds for a variant's first call;
        True when the time was counted as steady-state."""
        if variant in self._compiled:
            setattr(self.metrics, field, getattr(self.metrics, field) + seconds)
            return True
        self._compiled.add(variant)
        self.metrics.compile_seconds += seconds
        return False

    def _append(self, req: Request, token: int) -> bool:
        """Records a sampled token; finishes the request when a stop condition holds."""
        req.generated.append(token)
        self.metrics.generated_tokens += 1
        if token in req.stop_token_ids:
            req.finish_reason = "stop"
        elif len(req.generated) >= req.max_new_tokens:
            req.finish_reason = "length"
        elif req.num_tokens >= self.config.max_model_len:
            req.finish_reason = "max_model_len"
        else:
            return False
        del self.running[req.request_id]
        self.finished[req.request_id] = req
        if self.coord is not None:
            self.coord.finish(req.request_id)
        else:
            self._free_seats.append(req.seat)
            self._free_seats.sort()
        return True

    def _preempt(self, req: Request) -> None:
        """Recompute preemption: the request re-enters the queue with its generated tokens;
        its last sampled token is recomputed by the next prefill (the rows are not reused)."""
        self.coord.preempt(req.request_id)
        del self.running[req.request_id]
        # Re-admission prefills prompt + generated[:-1] and samples generated[-1] again, so the
        # last token is dropped here (greedy: the same token comes back).
        req.generated.pop()
        if req.attention:
            req.attention.pop()
        self.metrics.generated_tokens -= 1
        req.num_preemptions += 1
        self.metrics.preemptions += 1
        self.waiting.appendleft(req)

    def _deliver(self, *, wait: bool = False) -> None:
        report = self.transfer.poll(wait=wait)
        if report:
            self.coord.on_transfers(report)

    # ------------------------------------------------------------------ metrics

    def device_bytes(self) -> int:
        """Bytes of parameters, KV caches, index-key caches and hot state on the device."""
        leaves = jax.tree.leaves(self.params) + jax.tree.leaves(self.cache)
        return int(sum(x.nbytes for x in leaves))

    @staticmethod
    def allocator_bytes_in_use() -> int | None:
        """The device allocator's bytes in use (GPU), None where the backend does not say."""
        try:
            stats = jax.devices()[0].memory_stats()
        except Exception:  # noqa: BLE001 - backends without memory stats
            return None
        return None if not stats else stats.get("bytes_in_use")

    def host_bytes(self) -> int:
        return 0 if self.host_pool is None else int(self.host_pool.nbytes)

    def summary(self) -> dict[str, Any]:
        """Derived figures of the run so far."""
        m = self.metrics
        lookups = m.hot_hits + m.hot_misses
        stats = dict(self.coord.stats) if self.coord is not None else {}
        steps = max(m.decode_steps, 1)
        timed_steps = m.decode_steps - len([v for v in self._compiled if isinstance(v, str)])
        return {
            "mode": self.mode,
            "requests_finished": len(self.finished),
            "prompt_tokens": m.prompt_tokens,
            "generated_tokens": m.generated_tokens,
            "decode_steps": m.decode_steps,
            "fast_path_steps": m.fast_steps,
            "decode_tokens_per_s": self._decode_tokens / m.decode_seconds
            if m.decode_seconds else 0.0,
            "decode_step_ms": 1e3 * m.decode_seconds / timed_steps if timed_steps else 0.0,
            "compile_seconds": m.compile_seconds,
            "tokens_per_s": m.generated_tokens / m.wall_seconds if m.wall_seconds else 0.0,
            "hot_lookups": lookups,
            "hot_hit_rate": m.hot_hits / lookups if lookups else float("nan"),
            "rows_moved_h2d": m.rows_moved,
            "bytes_moved_h2d": m.bytes_moved,
            "rows_moved_per_step": m.rows_moved / steps,
            "bytes_moved_per_step": m.bytes_moved / steps,
            "spilled_pages": stats.get("spills", 0),
            "unpinned_pages": stats.get("unpinned_pages", 0),
            "lost_pages": stats.get("lost_pages", 0),
            "hot_grants": stats.get("hot_grants", 0),
            "preemptions": m.preemptions,
            "waits": m.waits,
            "device_bytes": self.device_bytes(),
            "device_allocator_bytes": self.allocator_bytes_in_use(),
            "host_bytes": self.host_bytes(),
            "gpu_blocks": self.num_gpu_blocks,
        }

    @property
    def mode(self) -> str:
        ec = self.config
        return ("all-resident" if ec.all_resident else "naive-offload" if ec.naive_offload
                else "hisparse")

    def close(self) -> None:
        if self.host_pool is not None:
            if self.transfer is not None:
                self._deliver(wait=True)  # no copy into the pool outlives the engine
            if self._owns_pool:
                self.host_pool.close()
