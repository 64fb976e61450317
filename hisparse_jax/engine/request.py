"""`Request`: one generation request and its progress (the engine's record)."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import numpy as np

FINISH_REASONS = ("stop", "length", "max_model_len", "error", "cancelled")
"""`Request.finish_reason` once a request finished: a stop token (kept in the output),
`max_new_tokens` generated, `max_model_len` tokens in all (requests added with
max_new_tokens=None), a failure of this request (`Request.error` says what), or
`Engine.cancel`."""


@dataclasses.dataclass
class Request:
    """A generation request and its progress.

    `seat` is its state row while it runs (batch row `seat` of the decode step serves it),
    -1 before admission. `live`: how many of `generated` the current admission has produced
    (a fresh admission prefills the prompt, so 0 at admission); while live < len(generated)
    the request replays its known tokens after a preemption (`replaying`). `index` is its
    add_request order (it seeds the top-k source and the synthetic prefill rows); `seed`
    picks its sampling keys (the key of its i-th sampled token is a function of
    (EngineConfig.seed, seed, i); by default seed = index). `max_new_tokens` None: generate
    until max_model_len tokens. `finish_reason` is one of `FINISH_REASONS` once it finished;
    `error` the message when it is "error". `attention` holds per-layer attention outputs
    per generated token when `EngineConfig.debug.collect_attention` is set. With speculation,
    `step_drafts` are the draft tokens its scheduled step verifies (generated tokens
    live .. live + len - 1 if right) and `drafts` the ones its last step proposed.
    `num_prefilled` counts the prompt tokens the current admission has computed and `chunk`
    those its prefill computes in the open step (the whole prompt without
    `EngineConfig.prefill.chunk_size`); while num_prefilled < len(prompt) it is `prefilling`
    and samples nothing. With `EngineConfig.prefill.prefix_caching` an admission that hits
    published pages starts with num_prefilled = num_cached (those tokens are reused).
    """

    request_id: Hashable
    prompt: tuple[int, ...]  # a tuple of ints: untracked by the GC (long prompts stay cheap)
    max_new_tokens: int | None
    index: int = 0  # order of add_request (seeds the top-k source and synthetic rows)
    temperature: float = 0.0
    stop_token_ids: frozenset[int] = frozenset()
    generated: list[int] = dataclasses.field(default_factory=list)
    seat: int = -1
    finish_reason: str | None = None
    attention: list[np.ndarray] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    seed: int | None = None  # sampling seed; None: `index`
    error: str | None = None
    live: int = 0
    counted: int = 0  # generated tokens the residency manager has counted (this admission)
    drafts: list[int] = dataclasses.field(default_factory=list)  # from its last step
    step_drafts: list[int] = dataclasses.field(default_factory=list)  # fed in this step
    num_drafted: int = 0  # draft tokens verified for it, and how many were accepted
    num_accepted: int = 0
    num_prefilled: int = 0  # prompt tokens computed in this admission
    chunk: int = 0  # prompt tokens its prefill computes in the open step
    num_cached: int = 0  # prompt tokens this admission reused from published pages
    key_pages: int = 0  # pages whose index keys the engine kept or needs not keep (prefix)
    page_hashes: list[bytes] = dataclasses.field(default_factory=list)  # of its full pages

    @property
    def prefilling(self) -> bool:
        """Its prompt is not computed yet in this admission (waiting, or between chunks)."""
        return self.num_prefilled < len(self.prompt)

    @property
    def replaying(self) -> bool:
        """The next token its step produces is one it generated before a preemption."""
        return self.live < len(self.generated)

    @property
    def last_live_token(self) -> int:
        """The token its next decode step feeds: the last one produced in this admission."""
        return self.generated[self.live - 1]

    @property
    def sampling_seed(self) -> int:
        """The seed of its sampling keys: `seed`, or `index` when none was given."""
        return self.index if self.seed is None else self.seed

    @property
    def tokens(self) -> list[int]:
        return [*self.prompt, *self.generated]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.generated)
