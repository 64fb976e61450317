"""Stateful test: a simulated scheduler drives the host tier; real bytes are checked every step.

Rules admit requests (prompts drawn from a few shared prefix families, so prefix hits, partial
hits and adoptions happen), run steps (chunked prefill and decode, which seal pages and spill
them), deliver worker reports late, partially and out of order, and finish, cancel, preempt or
abort requests in the middle of spills; small pools keep the device and host under pressure, and
half the runs inject copy faults (failed spills are spilled again, a request whose restore failed
is aborted). After
every rule: the coordinator invariants, plus checks that do not trust the coordinator: every row
a request can read (resident, hot or host) holds what was written for that token, no host block
is published or read from host before the worker's copy into it completed, the last 2 pages stay
pinned, host-read pages imply a hot region. At teardown everything is released and both pools
must be entirely free.

CI runs a small budget. For a long run:
  HISPARSE_STATEFUL_EXAMPLES=200 HISPARSE_STATEFUL_STEPS=200 pytest -m slow \
      tests/test_host_tier_stateful.py
"""

import os
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from hisparse_jax.ops import mirror_rows, restore_rows
from host_tier.scheduler import Admitted
from host_tier.testing import SimulatedServer, run_seeded_soak

CONFIGS = [
    dict(block_size=4, num_gpu_blocks=24, num_host_blocks=40, hot_size=8, top_k=4,
         max_num_reqs=6, max_model_len=48),
    dict(block_size=4, num_gpu_blocks=14, num_host_blocks=22, hot_size=8, top_k=4,
         max_num_reqs=4, max_model_len=32),
    dict(block_size=2, num_gpu_blocks=20, num_host_blocks=48, hot_size=6, top_k=3,
         max_num_reqs=5, max_model_len=24, num_layers=1),
    dict(block_size=4, num_gpu_blocks=24, num_host_blocks=40, hot_size=8, top_k=4,
         max_num_reqs=6, max_model_len=48, num_layers=4, layers_per_array=2),
]


class HostTierMachine(RuleBasedStateMachine):
    sim: SimulatedServer | None = None

    @initialize(seed=st.integers(0, 2**32 - 1), config=st.sampled_from(CONFIGS),
                faults=st.sampled_from([0.0, 0.15]))
    def setup(self, seed, config, faults):
        self.sim = SimulatedServer(seed=seed, mirror_fn=mirror_rows, restore_fn=restore_rows,
                                   spill_fault_rate=faults, restore_fault_rate=faults, **config)
        rng = random.Random(seed)
        self.max_len = config["max_model_len"]
        self.families = [[rng.randrange(5) for _ in range(self.max_len)] for _ in range(3)]
        self.next_id = 0

    def _admit(self, prompt, chunk):
        rid = f"r{self.next_id}"
        self.next_id += 1
        try:
            return self.sim.admit(rid, prompt, num_new_tokens=chunk)
        except ValueError as e:  # the drawn chunk exceeds the uncached part of the prompt
            assert "num_new_tokens must be in" in str(e)
            return self.sim.admit(rid, prompt)

    @rule(family=st.integers(0, 2), length=st.integers(1, 64),
          suffix=st.lists(st.integers(0, 4), max_size=3),
          chunk=st.one_of(st.none(), st.integers(1, 12)))
    def admit(self, family, length, suffix, chunk):
        prompt = (self.families[family][:length] + suffix)[: self.max_len - 1]
        self._admit(prompt, chunk)

    @precondition(lambda self: self.sim is not None and self.sim.preempted)
    @rule(chunk=st.one_of(st.none(), st.integers(1, 12)))
    def resume_preempted(self, chunk):
        prompt = self.sim.preempted[-1][: self.max_len - 1]
        if isinstance(self._admit(prompt, chunk), Admitted):
            self.sim.preempted.pop()

    @rule(num_steps=st.integers(1, 4), max_chunk=st.one_of(st.none(), st.integers(1, 8)))
    def step(self, num_steps, max_chunk):
        for _ in range(num_steps):
            self.sim.step(max_chunk=max_chunk)
            self.sim.verify()

    @rule(fraction=st.sampled_from([0.0, 0.3, 0.7, 1.0]))
    def deliver_reports(self, fraction):
        self.sim.deliver(fraction)

    @rule()
    def drain(self):
        self.sim.drain()

    @precondition(lambda self: self.sim is not None and self.sim.coord.request_ids)
    @rule(data=st.data(), how=st.sampled_from(["finish", "cancel", "preempt", "abort"]))
    def release(self, data, how):
        rid = data.draw(st.sampled_from(sorted(self.sim.coord.request_ids)))
        self.sim.release(rid, how)

    @invariant()
    def every_readable_row_holds_what_was_written(self):
        if self.sim is not None:
            self.sim.verify()

    def teardown(self):
        if self.sim is not None:
            try:
                self.sim.release_all_and_check_leaks()
            finally:
                self.sim.close()


def _run(examples: int, steps: int) -> None:
    run_state_machine_as_test(HostTierMachine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
        suppress_health_check=list(HealthCheck)))


def test_host_tier_state_machine():
    _run(examples=40, steps=50)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("HISPARSE_STATEFUL_EXAMPLES"),
                    reason="long run: set HISPARSE_STATEFUL_EXAMPLES (and HISPARSE_STATEFUL_STEPS)")
def test_host_tier_state_machine_long():
    _run(examples=int(os.environ["HISPARSE_STATEFUL_EXAMPLES"]),
         steps=int(os.environ.get("HISPARSE_STATEFUL_STEPS", "200")))


@pytest.mark.parametrize("layers_per_array", [1, 2])
def test_seeded_soak_reaches_every_residency_path(layers_per_array):
    """A fixed random schedule long enough that pages are lost and read from host, hot regions
    hit and miss, partial hits copy on write, device copies are adopted and capacity waits: the
    checks above are only meaningful if these paths run. Also with a packed pool (the two
    layers side by side in one array)."""
    rng = random.Random(7)
    sim = SimulatedServer(seed=7, mirror_fn=mirror_rows, restore_fn=restore_rows,
                          layers_per_array=layers_per_array)
    try:
        run_seeded_soak(sim, rng, 300)
        stats = sim.coord.stats
        for path in ("lost_pages", "unpinned_pages", "copy_on_write", "adopted_pages",
                     "hot_grants", "published_pages", "preemptions", "schedule_waits"):
            assert stats[path] > 0, f"the soak never exercised {path}"
        assert sim.counters["hot_hits"] > 0 and sim.counters["hot_misses"] > 0
        sim.release_all_and_check_leaks()
    finally:
        sim.close()


def test_seeded_soak_with_resident_prefix_hits():
    """The soak with `resident_prefix_hits` (the engine's prefix caching): hit pages without a
    device copy are restored into resident blocks, and every readable row stays right."""
    rng = random.Random(5)
    sim = SimulatedServer(seed=5, mirror_fn=mirror_rows, restore_fn=restore_rows,
                          resident_prefix_hits=True)
    try:
        run_seeded_soak(sim, rng, 200)
        stats = sim.coord.stats
        for path in ("prefix_restores", "copy_on_write", "adopted_pages", "published_pages"):
            assert stats[path] > 0, f"the soak never exercised {path}"
        sim.release_all_and_check_leaks()
    finally:
        sim.close()
