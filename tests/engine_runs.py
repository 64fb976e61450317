"""Shared by the engine tests: one engine run over a list of prompts."""

from __future__ import annotations

import chex

from hisparse_jax.engine import Engine, EngineConfig


def run_prompts(model, prompts, *, max_new_tokens, **config):
    """A fresh engine of `EngineConfig(**config)` serving every prompt to `max_new_tokens`;
    returns (engine, the finished requests in prompt order). The caller closes the engine."""
    chex.clear_trace_counter()  # chex counts per definition site, across engines
    engine = Engine(model, EngineConfig(**config))
    ids = [engine.add_request(p, max_new_tokens=max_new_tokens) for p in prompts]
    out = engine.run()
    return engine, [out[i] for i in ids]
