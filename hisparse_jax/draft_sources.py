"""Where speculative draft tokens come from (`EngineConfig.speculative.draft`).

With `EngineConfig.speculative.num_tokens` = k > 0, every decode step of a request feeds its
last token and up to k draft tokens (k + 1 query rows of one request, resolved together:
`hisparse_jax.cache.HiSparse`), samples a token at every row and keeps the longest run of
drafts that were right, plus the token sampled after it (`hisparse_jax.engine.runner`).

Acceptance. A draft is accepted when it equals the token its row samples, drawn with the key
that decoding without speculation would use for that token (`engine.sampler.token_keys`), so
the output equals decoding without speculation, greedy or not. The exception is a source with
an `acceptance_rate` (`AcceptanceRateDraft`): a benchmark device that accepts each draft with
that probability whatever it is, and so emits tokens the model did not choose.

Sources:

  * `MTPDraft`: the model's multi-token-prediction module (`hisparse_jax.models.MTPHead`, built
    with `ModelConfig.mtp_layers=1`) drafts k tokens at the end of each step from the hidden
    state of the last accepted row. A randomly initialised module almost never agrees with its
    model: use `AcceptanceRateDraft` to benchmark a trained one's acceptance.
  * `AcceptanceRateDraft(acceptance_rate)`: benchmarks only (the output is not the model's).
  * `ScriptedDraft`: drafts from known outputs, right or wrong as a given pattern says (tests:
    forced accept / reject patterns with exact outputs); `DeviceScriptedDraft` makes the same
    drafts inside the decode step (tests of the on-device path: asynchronous scheduling).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from host_tier.sizes import is_int


class DraftSource:
    """Base of the draft sources (module docstring).

    Attributes:
      on_device: drafts come out of the decode step (`device_drafts`, inside jit); otherwise
        the engine asks `propose` on the host before each step.
      acceptance_rate: None (a draft is accepted when it equals the sampled token: exact), or
        the probability with which each draft is accepted regardless (benchmarks).
    """

    on_device: ClassVar[bool] = True
    acceptance_rate: float | None = None

    def bind(self, *, vocab_size: int) -> DraftSource:
        """The source for a model of `vocab_size` tokens (default: itself)."""
        del vocab_size
        return self

    def check_model(self, spec: Any) -> None:
        """ValueError naming `EngineConfig.speculative.draft` when the model (its
        `hisparse_jax.models.ModelSpec`) cannot serve it."""

    def device_drafts(self, model: Any, hidden: jax.Array, tokens: jax.Array,
                      num_tokens: int) -> jax.Array:
        """Drafts int32[N, num_tokens] for the next step, inside the step: hidden [N, hidden] is
        the last hidden state of each request's last accepted row, tokens int32[N] the token
        it sampled (the next step's first input)."""
        raise NotImplementedError

    def device_drafts_at(self, model: Any, hidden: jax.Array, tokens: jax.Array,
                         num_tokens: int, *, seeds: jax.Array, index: jax.Array) -> jax.Array:
        """`device_drafts` with each request's place: seeds int32[N] its sampling seed (the
        low 32 bits), index int32[N] the generated-token index of its first draft (that of
        `tokens` plus one). The decode step calls this one; the default ignores the place."""
        del seeds, index
        return self.device_drafts(model, hidden, tokens, num_tokens)

    def propose(self, request: Any, num_tokens: int) -> list[int]:
        """Host-side drafts for `request`'s next step: its generated tokens `live` ..
        `live + num_tokens - 1` (`hisparse_jax.engine.request.Request`): a list (or tuple,
        or 1-d integer array) of at most `num_tokens` int token ids in [0, vocab). The
        engine checks it (`host_drafts`): a source that breaks the rule or raises fails
        that request only."""
        raise NotImplementedError


def host_drafts(source: DraftSource, request: Any, num_tokens: int, vocab_size: int
                ) -> list[int]:
    """`source.propose(request, num_tokens)` as a list of Python ints, checked: at most
    `num_tokens` int token ids (never bools) in [0, vocab_size). Raises ValueError naming
    the source and the rule (`propose`'s own exception, with its type, when it raises)."""
    where = f"EngineConfig.speculative.draft {type(source).__name__}.propose"
    try:
        out = source.propose(request, num_tokens)
    except Exception as e:  # noqa: BLE001 - any failure of the source fails its request
        raise ValueError(f"{where} raised {type(e).__name__}: {e}") from e
    rule = f"the rule: a list of at most {num_tokens} int token ids in [0, {vocab_size})"
    if not isinstance(out, (list, tuple, np.ndarray)) or np.ndim(out) != 1:
        raise ValueError(f"{where} returned {out!r:.80}; {rule}")
    if len(out) > num_tokens:
        raise ValueError(f"{where} returned {len(out)} drafts; {rule}")
    for t in out:
        if not is_int(t) or not 0 <= t < vocab_size:
            raise ValueError(f"{where} returned token id {t!r:.40}; {rule}")
    return [int(t) for t in out]


@dataclasses.dataclass(frozen=True)
class MTPDraft(DraftSource):
    """Drafts of the model's MTP module (`ServedModel.draft`, `hisparse_jax.models`), greedy."""

    def check_model(self, spec: Any) -> None:
        if not spec.has_draft:
            raise ValueError(
                f"EngineConfig.speculative.draft=MTPDraft() needs a model with an MTP module; "
                f"{spec.name!r} has none (its spec has has_draft=False: build the synthetic "
                "model with mtp_layers=1, or pick another draft source)")

    def device_drafts(self, model, hidden, tokens, num_tokens):
        return model.draft(hidden, tokens, num_tokens)


@dataclasses.dataclass(frozen=True)
class AcceptanceRateDraft(DraftSource):
    """Benchmarks: each draft is accepted with probability `acceptance_rate` (independently;
    the first rejection ends the run), decided by a key of the request's sampling seed and
    the token's index, so a replay decides alike. The drafts are placeholders (the last
    sampled token, repeated) and accepted drafts are emitted as they are: the output is not
    the model's. Per step a request then emits 1 + a tokens, E[a] = sum_i rate^i (i = 1..k).
    """

    acceptance_rate: float = 0.8

    def __post_init__(self) -> None:
        rate = self.acceptance_rate
        if (not isinstance(rate, (int, float)) or isinstance(rate, bool)
                or not math.isfinite(rate) or not 0.0 <= rate <= 1.0):
            raise ValueError(f"AcceptanceRateDraft.acceptance_rate must be a number in [0, 1], "
                             f"got {rate!r}")

    def device_drafts(self, model, hidden, tokens, num_tokens):
        del model, hidden
        return jnp.broadcast_to(tokens[:, None], (tokens.shape[0], num_tokens))


class ScriptedDraft(DraftSource):
    """Host-side drafts from known outputs (tests): the draft for generated token j of the
    request with add_request index i is `reference[i][j]` when `accept(i, j)` is true, else a
    different token ((reference[i][j] + 1) % vocab); past the reference, token 0.

    Args:
      reference: generated tokens per request index (e.g. a run without speculation).
      accept: (request index, generated token index) -> whether its draft is right.
    """

    on_device = False

    def __init__(self, reference: Mapping[int, Sequence[int]],
                 accept: Callable[[int, int], bool], *, vocab_size: int | None = None) -> None:
        self.reference = {int(i): list(t) for i, t in reference.items()}
        self.accept = accept
        self.vocab_size = vocab_size

    def bind(self, *, vocab_size: int) -> ScriptedDraft:
        self.vocab_size = vocab_size
        return self

    def known_tokens(self, request: Any) -> Sequence[int]:
        """The known output of `request` (override to look it up another way)."""
        return self.reference.get(request.index, [])

    def propose(self, request, num_tokens):
        ref = self.known_tokens(request)
        out = []
        for j in range(request.live, request.live + num_tokens):
            if j >= len(ref):
                out.append(0)
            elif self.accept(request.index, j):
                out.append(ref[j])
            else:
                out.append((ref[j] + 1) % self.vocab_size)
        return out


class DeviceScriptedDraft(DraftSource):
    """`ScriptedDraft`'s drafts, made inside the decode step (tests of the on-device draft
    path, which asynchronous scheduling feeds to the next step without the host): the draft
    for generated token j of the request of sampling seed s is `reference[s][j]` when
    `accept(s, j)` is true, else (reference[s][j] + 1) % vocab; past the reference, or for a
    seed it does not name, token 0. (The sampling seed is the add_request index unless
    `add_request(seed=...)` says otherwise.) Exact like any source: a draft is kept only when
    it equals the sampled token.

    Args:
      reference: generated tokens per sampling seed (e.g. a run without speculation).
      accept: (sampling seed, generated token index) -> whether its draft is right.
    """

    def __init__(self, reference: Mapping[int, Sequence[int]],
                 accept: Callable[[int, int], bool], *, vocab_size: int | None = None) -> None:
        self.reference = {int(s): list(t) for s, t in reference.items()}
        self.accept = accept
        self.table: np.ndarray | None = None  # int32[seeds, tokens] once bound
        if vocab_size is not None:
            self.bind(vocab_size=vocab_size)

    def bind(self, *, vocab_size: int) -> DeviceScriptedDraft:
        """Tabulates the drafts (int32[max seed + 1, longest reference]) for `vocab_size`."""
        seeds = max(self.reference, default=-1) + 1
        width = max((len(t) for t in self.reference.values()), default=0)
        table = np.zeros((max(seeds, 1), max(width, 1)), np.int32)
        for s, ref in self.reference.items():
            for j, token in enumerate(ref):
                table[s, j] = token if self.accept(s, j) else (token + 1) % vocab_size
        self.table = table
        return self

    def device_drafts(self, model, hidden, tokens, num_tokens):
        raise ValueError("DeviceScriptedDraft drafts by request: the decode step calls "
                         "device_drafts_at")

    def device_drafts_at(self, model, hidden, tokens, num_tokens, *, seeds, index):
        del model, hidden
        table = jnp.asarray(self.table)
        rows, cols = table.shape
        j = index[:, None] + jnp.arange(num_tokens, dtype=jnp.int32)[None, :]
        s = jnp.broadcast_to(seeds[:, None], j.shape)
        known = (s >= 0) & (s < rows) & (j >= 0) & (j < cols)
        return jnp.where(known, table[jnp.clip(s, 0, rows - 1), jnp.clip(j, 0, cols - 1)], 0)
