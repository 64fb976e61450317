"""Shared checks of the engine tests: the all-resident reference tokens of a request, and an
idle engine that holds nothing."""

from __future__ import annotations

from hisparse_jax.engine import AllResident, Engine, EngineConfig
from host_tier import Coordinator


class AllResidentReference:
    """`reference(req)` -> (finish_reason, generated) of an all-resident engine serving the
    same request: prompt, max_new_tokens, temperature, stop tokens and sampling seed (sampling
    keys are per request, so sampled tokens compare too). One engine; each request once."""

    def __init__(self, model, **sizes):
        self.engine = Engine(model, EngineConfig(residency=AllResident(), **sizes))
        self._cache: dict = {}

    def __call__(self, req):
        key = (req.prompt, req.max_new_tokens, req.temperature, req.stop_token_ids,
               req.sampling_seed)
        if key not in self._cache:
            rid = self.engine.add_request(req.prompt, max_new_tokens=req.max_new_tokens,
                                          temperature=req.temperature,
                                          stop_token_ids=req.stop_token_ids,
                                          seed=req.sampling_seed)
            out = self.engine.run()[rid]
            self._cache[key] = (out.finish_reason, list(out.generated))
        return self._cache[key]

    def close(self):
        self.engine.close()


def assert_idle(engine):
    """No request left; with the host tier, once the worker drained: every seat, device block
    and host block free, nothing in flight, the coordinator's invariants hold."""
    assert not engine.running and not engine.waiting
    manager = engine.scheduler.manager
    if isinstance(manager, Coordinator):
        engine.scheduler.deliver(wait=True)
        manager.check_invariants()
        assert not manager.request_ids and not manager.has_pending_transfers()
        assert manager.device_pool.num_free == manager.device_pool.num_usable
        assert manager.host_pool.num_free == manager.host_pool.num_usable
