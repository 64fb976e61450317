"""Start-up: `Engine.warmup` compiles every shape a run reaches (no served step compiles), and
the persistent compilation cache (`hisparse_jax.engine.compile_cache`)."""

from __future__ import annotations

import collections
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hisparse_jax import models
from hisparse_jax.engine import (
    AllResident,
    Engine,
    EngineConfig,
    NaiveOffload,
    PrefillPolicy,
    Sizes,
    compile_cache,
)
from hisparse_jax.engine.metrics import CompileWatch
from hisparse_jax.engine.runner import variant_name
from hisparse_jax.state import invalidation_width
from host_tier.sizes import pow2_bucket


@functools.cache
def tiny_model():
    return models.init_model("tiny", seed=0)


def _record_buckets(engine):
    """Wraps the runner so that the run records each shape bucket it uses, by the kinds of
    `Runner.warmed`."""
    used = collections.defaultdict(set)
    runner, B = engine.runner, engine.hs_config.block_size

    def wrap(obj, name, record):
        fn = getattr(obj, name)

        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            record(*args)
            return fn(*args, **kwargs)

        setattr(obj, name, wrapped)

    wrap(runner, "dispatch_decode", lambda reqs, res: used["decode"].add(variant_name(res)))
    wrap(runner, "prefill", lambda req, blocks: used["prefill"].add(
        runner.prefill_length(len(req.prompt))))
    def table_rows(update):
        used["table_rows"].update(pow2_bucket(len(part), 8)
                                  for part in (update.src, update.res, update.hot) if len(part))

    wrap(runner.tables, "apply", table_rows)
    # A deferred update reaches the device folded into a decode step, or (read before one)
    # by its own call at its bucket: warmup compiles that call too.
    wrap(runner.tables, "defer", table_rows)

    def state(plan):
        if plan.hot_invalidations:
            used["invalidation_widths"].add(invalidation_width(
                max(len(inv.host_blocks) for inv in plan.hot_invalidations)))

    wrap(runner, "apply_plan_state", state)
    wrap(runner, "after_forward", lambda plan: plan.spills and used["spill_rows"].add(
        pow2_bucket(len(plan.spills) * B, 64)))
    return used


def test_warmup_compiles_every_bucket_a_run_reaches():
    # Sizes with several buckets of every kind: 9 seats (table updates of 8 and 16 rows),
    # prompts up to 265 tokens of 4-row pages (spills of 64..512 rows, invalidations of 64
    # and 128 host blocks), two prefill lengths (136, 272), a pool under pressure (both
    # decode variants).
    ec = EngineConfig(sizes=Sizes(max_seats=9, max_model_len=272, block_size=4, num_gpu_blocks=140),
                      prefill=PrefillPolicy(bucket=136))
    engine = Engine(tiny_model(), ec)
    CompileWatch.start()
    before = CompileWatch.count
    seconds = engine.warmup()
    assert seconds > 0 and engine.metrics.warmup_seconds == seconds
    assert CompileWatch.count > before  # the watch sees compiles
    warmed = {kind: set(sizes) for kind, sizes in engine.runner.warmed.items()}
    assert warmed == {"decode": {"decode_fast", "decode_hot"}, "prefill": {136, 272},
                      "table_rows": {8, 16}, "invalidation_widths": {64, 128},
                      "spill_rows": {64, 128, 256, 512}}
    used = _record_buckets(engine)
    rng = np.random.default_rng(0)
    for i in range(9):  # seats free one at a time: the long prompts are admitted alone
        engine.add_request(rng.integers(0, 512, 5).tolist(), max_new_tokens=4 + 3 * i,
                           temperature=0.7 * (i % 2))
    for n in (100, 200, 265):
        engine.add_request(rng.integers(0, 512, n).tolist(), max_new_tokens=6)
    compiles = CompileWatch.count
    out = engine.run()
    assert CompileWatch.count == compiles, "a served step compiled"
    assert dict(used) == warmed, "the run did not cross every bucket"
    assert all(r.finish_reason == "length" for r in out.values())
    s = engine.summary()
    assert s["compile_seconds"] == 0.0 and s["decode_step_ms"] > 0
    assert s["warmup_seconds"] == seconds and "exclude compilation" in s["step_times"]
    engine.close()


def test_warmup_of_the_other_modes_changes_nothing_a_request_sees():
    # All-resident (no host tier) and synthetic prefill with a top-k source: the tokens are
    # those of an engine that was not warmed up, and no served step compiles.
    from hisparse_jax.topk_sources import DriftTopK

    prompts = [np.random.default_rng(i).integers(0, 512, 10 + 9 * i).tolist() for i in range(4)]
    sizes = Sizes(max_seats=2, max_model_len=48, block_size=4)
    for kw in (dict(residency=AllResident()),
               dict(topk_source=DriftTopK(turnover=0.25), residency=NaiveOffload(),
                    prefill=PrefillPolicy(bucket=16, synthetic=True),
                    sizes=Sizes(max_seats=2, max_model_len=48, block_size=4,
                                num_gpu_blocks=30))):
        outs = []
        for warm in (False, True):
            engine = Engine(tiny_model(), EngineConfig(
                **{"sizes": sizes, "prefill": PrefillPolicy(bucket=16), **kw}))
            if warm:
                engine.warmup()
            CompileWatch.start()
            compiles = CompileWatch.count
            ids = [engine.add_request(p, max_new_tokens=8, temperature=0.5) for p in prompts]
            out = engine.run()
            if warm:
                assert CompileWatch.count == compiles, kw
            outs.append([out[i].generated for i in ids])
            engine.close()
        assert outs[0] == outs[1], kw


def test_warmup_refuses_a_running_engine():
    engine = Engine(tiny_model(), EngineConfig(sizes=Sizes(max_seats=2, max_model_len=32,
                                                           block_size=4), residency=AllResident()))
    engine.add_request([1, 2, 3], max_new_tokens=4)
    engine.step()
    with pytest.raises(RuntimeError, match="1 requests are running"):
        engine.warmup()


# ------------------------------------------------------------------ compilation cache


@pytest.fixture
def restore_cache_config():
    before = jax.config.jax_compilation_cache_dir
    min_time = jax.config.jax_persistent_cache_min_compile_time_secs
    yield
    compile_cache.disable()
    if before is not None:
        compile_cache.enable(before)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_time)


def test_compile_cache_directory_rules(tmp_path, monkeypatch, restore_cache_config):
    monkeypatch.delenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", raising=False)
    for off in ("0", "off", "FALSE", " false "):
        monkeypatch.setenv(compile_cache.ENV_VAR, off)
        assert compile_cache.enable() is None
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path / "from-env"))
    assert compile_cache.enable() == str(tmp_path / "from-env")
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "from-env")
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.0
    # An explicit directory wins over the variable; the default is under XDG_CACHE_HOME.
    assert compile_cache.enable(tmp_path / "explicit") == str(tmp_path / "explicit")
    monkeypatch.delenv(compile_cache.ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.default_directory() == str(tmp_path / "xdg" / "hisparse_jax" / "jax")
    compile_cache.disable()
    assert compile_cache.enable() == str(tmp_path / "xdg" / "hisparse_jax" / "jax")
    # A compile writes an entry, and a later process would read it back.
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(7.0)).block_until_ready()
    assert os.listdir(tmp_path / "xdg" / "hisparse_jax" / "jax")


def test_engine_enables_the_cache_unless_told_not_to(tmp_path, monkeypatch,
                                                     restore_cache_config):
    kw = dict(sizes=Sizes(max_seats=1, max_model_len=16, block_size=4), residency=AllResident())
    monkeypatch.setenv(compile_cache.ENV_VAR, str(tmp_path))
    assert Engine(tiny_model(), EngineConfig(**kw)).compilation_cache_dir == str(tmp_path)
    compile_cache.disable()
    engine = Engine(tiny_model(), EngineConfig(compilation_cache=False, **kw))
    assert engine.compilation_cache_dir is None and jax.config.jax_compilation_cache_dir is None
    monkeypatch.setenv(compile_cache.ENV_VAR, "off")
    assert Engine(tiny_model(), EngineConfig(**kw)).compilation_cache_dir is None
    assert jax.config.jax_compilation_cache_dir is None


_FIRST_ENGINE = """
import json
from hisparse_jax import models
from hisparse_jax.engine import Engine, EngineConfig, PrefillPolicy, Sizes, Tuning
from hisparse_jax.topk_sources import DriftTopK

engine = Engine(models.init_model("tiny", seed=0), EngineConfig(
    sizes=Sizes(max_seats=4, max_model_len=96, block_size=4, num_gpu_blocks=44),
    prefill=PrefillPolicy(bucket=96, synthetic=True), tuning=Tuning(ops="triton"),
    topk_source=DriftTopK(seed=1)))
for n in (40, 45, 50, 55):
    engine.add_request(list(range(1, n)), max_new_tokens=28)
done = engine.run()
print(json.dumps({"traces": dict(engine.trace_counts),
                  "reasons": sorted(r.finish_reason for r in done.values())}))
engine.close()
"""


def test_the_first_engine_of_a_process_traces_each_step_once():
    # The first Pallas kernel of a process loads a module that adds an option to jax's
    # tracing context (jax >= 0.11): a step traced before it traced again after it, once
    # per process. The bottom-layer compat module loads it up front.
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _FIRST_ENGINE], cwd=root, capture_output=True,
                          text=True, timeout=600, check=False,
                          env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["reasons"] == ["length"] * 4
    assert out["traces"]["prefill"] == 1 and out["traces"]["decode_hot"] == 1, out
