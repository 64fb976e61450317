"""The bounded soak of `tests/test_soak.py` (and the mesh half in `tests/_compose_worker.py`):
one engine of a feature set serves a stream of requests arriving over its steps, with
random lengths, stop tokens, sampling, multi-turn continuations of finished requests,
cancels of waiting and running requests, and each fault injected once: a prefill (or
prefill chunk) that raises, a decode call that raises before it runs and one after it ran
(its donated device arrays then lost), a scheduler plan that raises and, with asynchronous
scheduling, a collection that raises.

Checked at the end: every request finished; one that finished by stop / length equals the
synchronous, one-shot, all-resident engine's output for it (`tests/compose.py`); a cancelled
one holds a prefix of it; only the request whose prefill raised finished with "error"; the
idle engine holds no block, seat or pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from tests import compose


@dataclasses.dataclass
class Faults:
    """Each named fault fires once, at the call number drawn for it."""

    at: dict[str, int]
    calls: dict[str, int] = dataclasses.field(default_factory=dict)
    fired: dict[str, Any] = dataclasses.field(default_factory=dict)

    def wrap(self, name: str, fn: Any, *, after: bool = False) -> Any:
        def wrapped(*args, **kwargs):
            n = self.calls[name] = self.calls.get(name, 0) + 1
            if name in self.fired or n != self.at.get(name):
                return fn(*args, **kwargs)
            self.fired[name] = args[0] if args else None
            if after:
                import jax

                jax.block_until_ready(fn(*args, **kwargs))
            raise RuntimeError(f"injected {name} failure")

        return wrapped


def arm(engine: Any, rng: np.random.Generator) -> Faults:
    """Wraps the engine's (each data shard's) prefill, decode, plan and collection with
    faults that fire once each, at random call numbers."""
    faults = Faults(at={"prefill": int(rng.integers(2, 8)), "decode": int(rng.integers(3, 12)),
                        "decode-after": int(rng.integers(14, 30)),
                        "plan": int(rng.integers(5, 25)), "collect": int(rng.integers(4, 20))})
    shards = getattr(engine, "shards", None)
    parts = [(s.scheduler, s.runner) for s in shards] if shards else [(engine.scheduler,
                                                                        engine.runner)]
    for sched, runner in parts:
        runner.prefill = faults.wrap("prefill", runner.prefill)
        runner.prefill_chunk = faults.wrap("prefill", runner.prefill_chunk)
        manager = sched.manager
        if hasattr(manager, "build_plan"):
            manager.build_plan = faults.wrap("plan", manager.build_plan)
        if not shards:
            runner.collect_decode = faults.wrap("collect", runner.collect_decode)
    if shards:  # the mesh decode step's dispatch (its jitted variants are made lazily)
        fn = faults.wrap("decode", engine.decoder.dispatch)
        engine.decoder.dispatch = faults.wrap("decode-after", fn, after=True)
        return faults
    jitted = engine.runner.jitted
    for name in [n for n in jitted if n.startswith("decode")]:
        fn = faults.wrap("decode", jitted[name])
        jitted[name] = faults.wrap("decode-after", fn, after=True)
    return faults


# The mesh combinations (run under 4 virtual devices by `tests/_compose_worker.py`).
MESH_SOAK = [
    compose.Features(mesh="2x1", prefix_caching=True, chunk_size=8),
    compose.Features(mesh="2x2", async_scheduling=True, prefix_caching=True, chunk_size=5),
    compose.Features(mesh="2x1", async_scheduling=True, residency="all"),
    compose.Features(mesh="2x1", async_scheduling=True, prefix_caching=True, chunk_size=8,
                     spec_k=2, draft="mtp"),
]


def soak(f: compose.Features, *, requests: int, seed: int) -> list[str]:
    """Serves `requests` requests on the engine of `f` as the module docstring says; returns
    the problems found (empty: all exact)."""
    rng = np.random.default_rng(seed)
    ref = compose.reference(f.kv_format, compose.reference_rows(f), compose.reference_chunk(f))
    engine = compose.build_engine(f)
    faults = arm(engine, rng)
    added: dict[Any, Any] = {}
    problems: list[str] = []
    try:
        for _ in range(20 * requests):
            if len(added) < requests and rng.random() < 0.6:
                _add(engine, rng, added)
            if rng.random() < 0.05:
                _cancel(engine, rng)
            try:
                engine.step()
            except RuntimeError as e:
                if "injected" not in str(e):
                    raise
            if len(added) >= requests and not engine.has_work:
                break
        engine.drain()
        problems += _check(engine, ref, added, faults)
        if engine.has_work:
            problems.append(f"work left after {20 * requests} steps")
    finally:
        engine.close()
    return [f"{f.label()}: {p}" for p in problems]


def _add(engine: Any, rng: np.random.Generator, added: dict) -> None:
    finished = [r for r in added.values() if r.finish_reason in ("stop", "length")]
    if finished and rng.random() < 0.4:  # the next turn of a finished request
        last = finished[int(rng.integers(len(finished)))]
        prompt = list(last.prompt) + list(last.generated)
        prompt += rng.integers(2, compose.VOCAB, int(rng.integers(1, 6))).tolist()
    else:
        prompt = rng.integers(2, compose.VOCAB, int(rng.integers(1, 40))).tolist()
    room = compose.MAX_LEN - len(prompt)
    if room < 1:
        return
    stop = rng.integers(2, compose.VOCAB, 30).tolist() if rng.random() < 0.3 else ()
    rid = engine.add_request(prompt, max_new_tokens=int(min(room, rng.integers(1, 13))),
                             temperature=0.8 if rng.random() < 0.3 else 0.0,
                             stop_token_ids=stop, seed=int(rng.integers(2 ** 16)))
    added[rid] = engine.waiting[-1]


def _cancel(engine: Any, rng: np.random.Generator) -> None:
    ids = list(engine.running) + [r.request_id for r in engine.waiting]
    if ids:
        engine.cancel(ids[int(rng.integers(len(ids)))])


def _check(engine: Any, ref: Any, added: dict, faults: Faults) -> list[str]:
    problems = []
    hit = faults.fired.get("prefill")
    for rid, req in added.items():
        reason = req.finish_reason
        if reason is None:
            problems.append(f"request {rid} never finished")
        elif reason in ("stop", "length"):
            want = ref(req)
            if (reason, list(req.generated)) != want:
                problems.append(f"request {rid}: got {(reason, list(req.generated))}, "
                                f"want {want}")
        elif reason == "cancelled":
            want = ref(req)[1]
            if list(req.generated) != want[:len(req.generated)]:
                problems.append(f"cancelled request {rid}: {list(req.generated)} is not a "
                                f"prefix of {want}")
        elif reason == "error":
            if req is not hit or "injected prefill" not in (req.error or ""):
                problems.append(f"request {rid} failed: {req.error}")
        else:
            problems.append(f"request {rid} finished with {reason!r}")
    return problems
