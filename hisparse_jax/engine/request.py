"""`Request`: one generation request and its progress (the engine's record)."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import numpy as np


@dataclasses.dataclass
class Request:
    """A generation request and its progress.

    `seat` is its state row while it runs (batch row `seat` of the decode step serves it),
    -1 before admission. `attention` holds per-layer attention outputs per generated token
    when `EngineConfig.collect_attention` is set.
    """

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
