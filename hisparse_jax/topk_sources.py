"""External top-k sources for the `Engine`: a drift model and replayed traces.

By default the model's `LightningIndexer` picks each decode step's top-k positions. For
benchmarks (and for studying locality) the engine can take them from a `TopKSource`
instead (`EngineConfig.topk_source`); the indexer and its key cache are then skipped.

A source keeps its own device state (a pytree) next to the caches:

  * `bind(num_groups, top_k)` returns the source specialised to the model;
  * `init_state(max_seats, max_model_len, num_groups, top_k)` builds it;
  * `admit(state, seat, request_index, context_len)` is called on the host when a request
    takes a seat (`request_index`: the order of `Engine.add_request`, so two engines fed the
    same requests see the same top-k; `context_len`: its prompt length);
  * `select(state, state_rows, positions, steps)` runs inside the jitted decode step and
    returns int32[num_groups, N, top_k] positions (-1: no entry) for batch rows whose seat is
    `state_rows[n]` (-1 padding), decoding the token at `positions[n]`, `steps[n]` decode
    steps after their prefill. The engine drops entries past `positions[n]` (causality).

Valid entries of one row must be distinct (the resolve precondition); both sources here
guarantee it.

Trace file format (`TraceTopK.load` / `save_trace`): a NumPy `.npz` archive with

  * `topk`: int32[R, T, K] or int32[R, T, G, K]: for trace row r and decode step t, the K
    selected token positions (of every index group, or per group g), -1 for no entry.
    Request `i` (in `add_request` order) replays row `i % R`; decode step `s` replays step
    `s % T`. K must equal the model's `top_k`.
  * optional `description`: a str (what recorded it).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class TopKSource:
    """Interface of an external top-k source (see the module docstring)."""

    def bind(self, *, num_groups: int, top_k: int) -> TopKSource:
        """The source specialised to a model's index groups and top_k (the engine calls it)."""
        return self

    def init_state(self, *, max_seats: int, max_model_len: int, num_groups: int,
                   top_k: int) -> Any:
        raise NotImplementedError

    def admit(self, state: Any, seat: int, request_index: int, context_len: int) -> Any:
        raise NotImplementedError

    def select(self, state: Any, state_rows: jax.Array, positions: jax.Array,
               steps: jax.Array) -> jax.Array:
        raise NotImplementedError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DriftState:
    """perm int32[S, L]: per seat, a random permutation of its context positions [0, ctx)
    followed by the positions past it; ctx int32[S]: its context length."""

    perm: jax.Array
    ctx: jax.Array


@functools.partial(jax.jit, donate_argnums=(0,))
def _drift_admit(state: DriftState, seat: jax.Array, key: jax.Array,
                 ctx: jax.Array) -> DriftState:
    length = state.perm.shape[1]
    i = jnp.arange(length)
    u = jnp.where(i < ctx, jax.random.uniform(key, (length,)), 2.0 + i)  # ctx first, shuffled
    perm = jnp.argsort(u).astype(jnp.int32)
    return DriftState(state.perm.at[seat].set(perm), state.ctx.at[seat].set(ctx))


@dataclasses.dataclass(frozen=True)
class DriftTopK(TopKSource):
    """A sliding window over a random permutation of each request's prompt positions.

    Every decode step the window advances by `round(turnover * top_k)` entries, so exactly
    that many positions leave the top-k set and as many new ones enter: a set turnover of
    `turnover` per step, with the positions spread uniformly over the prompt (no page
    locality: the hard case for a page cache, the natural one for HiSparse's row-granular hot
    region). Index group g reads the window shifted by g * ctx / G (independent sets per
    group). Generated positions are never selected. Prompts shorter than top_k select all
    their positions (and -1 for the rest).

    Attributes:
      turnover: fraction of the top-k set replaced per step, in [0, 1].
      seed: base seed of the permutations.
    """

    turnover: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 <= self.turnover <= 1.0:
            raise ValueError(f"DriftTopK.turnover must be in [0, 1], got {self.turnover}")

    def init_state(self, *, max_seats: int, max_model_len: int, num_groups: int,
                   top_k: int) -> DriftState:
        return DriftState(jnp.zeros((max_seats, max_model_len), jnp.int32),
                          jnp.zeros((max_seats,), jnp.int32))

    def admit(self, state: DriftState, seat: int, request_index: int,
              context_len: int) -> DriftState:
        key = jax.random.fold_in(jax.random.PRNGKey(self.seed), request_index)
        return _drift_admit(state, jnp.int32(seat), key, jnp.int32(context_len))

    def select(self, state: DriftState, state_rows: jax.Array, positions: jax.Array,
               steps: jax.Array) -> jax.Array:
        del positions
        num_groups, top_k = self._shape
        srow = jnp.maximum(state_rows, 0)
        ctx = jnp.maximum(state.ctx[srow], 1)[:, None]                       # [N, 1]
        shift = int(round(self.turnover * top_k))
        cols = jnp.arange(top_k)[None, :]
        out = []
        for g in range(num_groups):
            start = steps[:, None] * shift + g * (ctx // num_groups)
            idx = (start + cols) % ctx
            picked = jnp.take_along_axis(state.perm[srow], idx, axis=1)
            out.append(jnp.where((cols < ctx) & (state_rows[:, None] >= 0), picked, -1))
        return jnp.stack(out).astype(jnp.int32)

    # (num_groups, top_k) of the model, set by `bind`.
    _shape: tuple[int, int] = dataclasses.field(default=(1, 0), repr=False)

    def bind(self, *, num_groups: int, top_k: int) -> DriftTopK:
        return dataclasses.replace(self, _shape=(num_groups, top_k))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TraceState:
    """trace int32[R, T, G, K] on the device; row int32[S]: the trace row of each seat."""

    trace: jax.Array
    row: jax.Array


class TraceTopK(TopKSource):
    """Replays recorded top-k indices (see the module docstring for the file format)."""

    def __init__(self, topk: np.ndarray, *, description: str = "") -> None:
        topk = np.asarray(topk)
        if topk.ndim == 3:
            topk = topk[:, :, None, :]
        if topk.ndim != 4 or 0 in topk.shape:
            raise ValueError("TraceTopK: topk must be int[R, T, K] or int[R, T, G, K] with no "
                             f"empty axis, got shape {topk.shape}")
        if not np.issubdtype(topk.dtype, np.integer):
            raise ValueError(f"TraceTopK: topk must hold integers, got {topk.dtype}")
        if topk.min() < -1:
            raise ValueError("TraceTopK: topk entries must be positions >= 0 or -1 (no entry)")
        for r, t, g in zip(*np.nonzero(_has_repeats(topk)), strict=True):
            raise ValueError(f"TraceTopK: trace row {r}, step {t}, group {g} repeats a position "
                             "(valid entries of one step must be distinct)")
        self.topk = topk.astype(np.int32)
        self.description = description

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> TraceTopK:
        with np.load(path) as f:
            if "topk" not in f:
                raise ValueError(f"TraceTopK.load: {path} has no 'topk' array")
            desc = str(f["description"]) if "description" in f else ""
            return cls(f["topk"], description=desc)

    @property
    def num_groups(self) -> int:
        return self.topk.shape[2]

    @property
    def top_k(self) -> int:
        return self.topk.shape[3]

    def init_state(self, *, max_seats: int, max_model_len: int, num_groups: int,
                   top_k: int) -> TraceState:
        if top_k != self.top_k:
            raise ValueError(f"TraceTopK: the trace has K={self.top_k} columns, the model's "
                             f"top_k is {top_k}")
        if self.num_groups not in (1, num_groups):
            raise ValueError(f"TraceTopK: the trace has {self.num_groups} index groups, the "
                             f"model {num_groups} (a trace of one group serves all)")
        trace = np.broadcast_to(self.topk, self.topk.shape[:2] + (num_groups, top_k))
        return TraceState(jnp.asarray(trace), jnp.zeros((max_seats,), jnp.int32))

    def admit(self, state: TraceState, seat: int, request_index: int,
              context_len: int) -> TraceState:
        row = request_index % state.trace.shape[0]
        return dataclasses.replace(state, row=state.row.at[seat].set(row))

    def select(self, state: TraceState, state_rows: jax.Array, positions: jax.Array,
               steps: jax.Array) -> jax.Array:
        srow = jnp.maximum(state_rows, 0)
        picked = state.trace[state.row[srow], steps % state.trace.shape[1]]   # [N, G, K]
        picked = jnp.where((state_rows >= 0)[:, None, None], picked, -1)
        return jnp.moveaxis(picked, 1, 0)


def _has_repeats(topk: np.ndarray) -> np.ndarray:
    s = np.sort(topk, axis=-1)
    return ((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any(-1)


def save_trace(path: str | os.PathLike[str], topk: np.ndarray, *,
               description: str = "") -> None:
    """Writes a trace file (validated as `TraceTopK` would load it)."""
    src = TraceTopK(topk, description=description)
    np.savez_compressed(path, topk=src.topk, description=np.array(description))


def record(source: TopKSource, *, contexts: list[int], steps: int, num_groups: int,
           top_k: int) -> np.ndarray:
    """The top-k of `len(contexts)` requests over `steps` decode steps as int32[R, T, G, K]
    (e.g. to save a drift model's output as a trace, or to inspect a source)."""
    source = source.bind(num_groups=num_groups, top_k=top_k)
    R = len(contexts)
    state = source.init_state(max_seats=R, max_model_len=max(contexts) + steps,
                              num_groups=num_groups, top_k=top_k)
    for i, ctx in enumerate(contexts):
        state = source.admit(state, i, i, ctx)
    rows = jnp.arange(R, dtype=jnp.int32)
    pos = jnp.asarray(contexts, jnp.int32)
    out = [np.asarray(source.select(state, rows, pos + t, jnp.full((R,), t, jnp.int32)))
           for t in range(steps)]
    return np.stack(out).transpose(2, 0, 1, 3)  # [T, G, R, K] -> [R, T, G, K]
