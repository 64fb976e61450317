"""Runs `MeshEngine` on virtual CPU devices for `tests/test_mesh_engine.py` (a subprocess:
the device count must be set before jax starts, and the main suite runs with one device).

  python tests/_mesh_worker.py meshes OUT.json 4x1:hisparse 2x2:pressured:warmup 1x4:all_resident
      The single-device `Engine` (all-resident, the reference) and a `MeshEngine` per
      argument over 4 virtual devices, on the same requests; writes tokens and figures.
      ":warmup": `MeshEngine.warmup()` first, and the compiles of the run are counted;
      ":recover": then the requests again with failures injected (`faults`);
      ":grouped": the model with both layers in one index group (its host pool packed), against
      its own single-device reference (recorded as the entry's "reference_tokens").
  python tests/_mesh_worker.py process OUT.json MESH:MODE[:FEATURE...] PORT PROCESS_ID
      One of two processes (`jax.distributed`, 2 virtual devices each) running a
      `MeshEngine` over the 4 global devices; writes its own shards' requests. Features as
      `compose`'s ("async", "chunk").
  python tests/_mesh_worker.py compose OUT.json MESH:MODE:FEATURE... ...
      `tests/test_mesh_compose.py`: per argument a `MeshEngine` over 2 or 4 of 4 virtual
      devices serving multi-turn mixes (`compose_run`), every request checked against the
      synchronous, one-shot, all-resident single-device engine (`AllResidentReference`).
      Features: "async" (async scheduling), "chunk" (prefill chunks of 8), "prefix"
      (prefix caching), "mtp" (speculation with the model's MTP drafts, k=2), "scripted"
      (k=2 drafts scripted right or wrong from the reference), "devdraft" (the same drafts
      made inside the decode step: `DeviceScriptedDraft`), "warmup" (`warmup()`
      first; the compiles of the run counted), "faults" (then the requests again with
      failures injected, `compose_faults`).
"""

from __future__ import annotations

import functools
import json
import os
import sys

MODES = {"hisparse": {}, "pressured": {"num_gpu_blocks": 22}, "all_resident": {}}
SIZES = dict(max_seats=4, max_model_len=64, block_size=4)
NUM_REQUESTS, GEN = 6, 12


def engine_config(mode="all_resident", features=(), **sizes):
    """The EngineConfig of `mode` (a key of MODES: its sizes, and all-resident or HiSparse)
    with `features` ("async": async scheduling, "chunk": prefill chunks of 8, "prefix":
    prefix caching), `sizes` changed; imports the engine, so call it once the device flags
    are set."""
    from hisparse_jax.engine import AllResident, Debug, EngineConfig, HiSparse, PrefillPolicy, Sizes
    chunk = "chunk" in features
    return EngineConfig(sizes=Sizes(**{**SIZES, **MODES[mode], **sizes}),
                        prefill=PrefillPolicy(bucket=8 if chunk else 64,
                                              chunk_size=8 if chunk else None,
                                              prefix_caching="prefix" in features),
                        debug=Debug(collect_attention=True), compilation_cache=False,
                        residency=AllResident() if mode == "all_resident" else HiSparse(),
                        async_scheduling="async" in features)


def requests():
    """(prompt, temperature) of each request: greedy and sampled ones."""
    import numpy as np

    return [(np.random.default_rng(i).integers(0, 512, 24 + 5 * i).tolist(),
             0.0 if i % 2 == 0 else 0.8) for i in range(NUM_REQUESTS)]


def run(engine):
    """Adds the requests in order, runs; returns {request index: (tokens, attention)}."""
    import numpy as np

    ids = [engine.add_request(p, max_new_tokens=GEN, temperature=t) for p, t in requests()]
    out = engine.run()
    return {i: (out[rid].generated, np.stack(out[rid].attention).astype(np.float32))
            for i, rid in enumerate(ids) if rid in out}


def cpu_devices_flags(devices: int) -> str:
    """XLA_FLAGS for a process with `devices` virtual CPU devices, plus the suite's compile
    flags (`HISPARSE_TEST_XLA_FLAGS`, tests/conftest.py)."""
    return " ".join(filter(None, (f"--xla_force_host_platform_device_count={devices}",
                                  os.environ.get("HISPARSE_TEST_XLA_FLAGS"))))


def figures(engine):
    s = engine.summary()
    return {k: s[k] for k in ("hot_lookups", "spilled_pages", "fast_path_steps",
                              "decode_steps", "finish_reasons")}


def meshes(out_path, specs):
    os.environ["XLA_FLAGS"] = cpu_devices_flags(4)
    from hisparse_jax import models
    from hisparse_jax.engine import Engine
    from hisparse_jax.engine.mesh import MeshEngine
    from hisparse_jax.engine.metrics import CompileWatch

    built = {False: models.init_model("tiny", seed=0)}
    refs = {False: run(Engine(built[False], engine_config()))}
    record = {"reference": {i: t for i, (t, _) in refs[False].items()}, "meshes": {}}
    for spec in specs:
        shape, mode, *flags = spec.split(":")
        grouped = "grouped" in flags
        if grouped not in built:
            built[grouped] = models.init_model(models.get_config("tiny", index_group_size=2),
                                               seed=0)
            refs[grouped] = run(Engine(built[grouped], engine_config()))
        model, ref = built[grouped], refs[grouped]
        engine = MeshEngine(model, engine_config(mode),
                            mesh_shape=tuple(int(n) for n in shape.split("x")))
        warm = {}
        if "warmup" in flags:
            CompileWatch.start()
            compiles = CompileWatch.count
            warm["warmup_seconds"] = engine.warmup()
            warm["warmup_compiles"] = CompileWatch.count - compiles
            warm["metrics_warmup_seconds"] = engine.metrics.warmup_seconds
            compiles = CompileWatch.count
        got = run(engine)
        if "warmup" in flags:
            warm["served_compiles"] = CompileWatch.count - compiles
            warm["compile_seconds"] = engine.summary()["compile_seconds"]
        key = f"{shape}:{mode}" + (":grouped" if grouped else "")
        record["meshes"][key] = {
            "tokens": {i: t for i, (t, _) in got.items()},
            # Per (request, step, layer): the largest difference to the single device.
            "attention_slice_max_diffs": [
                float(d) for i, (_, a) in got.items()
                for d in abs(a - ref[i][1]).reshape(a.shape[0] * a.shape[1], -1).max(1)],
            "shards": [len(sh.scheduler.finished) for sh in engine.shards],
            "traces": dict(engine.trace_counts), **figures(engine), **warm}
        if grouped:
            record["meshes"][key]["reference_tokens"] = {i: t for i, (t, _) in ref.items()}
            record["meshes"][key]["pool_arrays"] = [len(sh.runner.host_pool.arrays)
                                                    for sh in engine.shards]
        if "recover" in flags:
            record["meshes"][key]["recovery"] = faults(engine)
        engine.close()
    record["errors"] = refusals(model)
    with open(out_path, "w") as f:
        json.dump(record, f)


def _failing(fns, at):
    """Wraps the jitted mesh decode variants `fns` ({name: fn}, sharing one call count):
    call number `at[k]` raises, before calling (k = "before") or after (k = "after": the
    donated caches are then gone)."""
    calls = [0]

    def wrap(fn):
        def wrapped(*args, **kwargs):
            calls[0] += 1
            if calls[0] == at["before"]:
                raise RuntimeError("injected failure before the call")
            out = fn(*args, **kwargs)
            if calls[0] == at["after"]:
                import jax
                jax.block_until_ready(out)
                raise RuntimeError("injected failure after the call")
            return out
        return wrapped

    return {name: wrap(fn) for name, fn in fns.items()}


def faults(engine):
    """The requests again (their sampling seeds as in `run`) on `engine`, warmed and idle,
    with one request whose admission raises, one whose prefill raises, and the mesh decode
    call raising once before and once after the call; steps until done, catching what a step
    raises. Returns the tokens, finish reasons and errors by request, and the figures."""
    from host_tier import Coordinator

    out = {"raised": []}
    for sh in engine.shards:
        manager, runner = sh.scheduler.manager, sh.runner
        admit, prefill = manager.admit, runner.prefill

        def failing_admit(rid, tokens, admit=admit, **kw):
            if rid == "bad-admit":
                raise RuntimeError("admission exploded")
            return admit(rid, tokens, **kw)

        def failing_prefill(req, blocks, prefill=prefill):
            if req.request_id == "bad-prefill":
                raise RuntimeError("prefill exploded")
            return prefill(req, blocks)

        manager.admit, runner.prefill = failing_admit, failing_prefill
    engine.decoder.jitted.update(_failing(engine.decoder.jitted, {"before": 3, "after": 9}))
    for i, (p, t) in enumerate(requests()):
        engine.add_request(p, max_new_tokens=GEN, temperature=t, request_id=f"r{i}", seed=i)
        if i == 1:
            engine.add_request(p, max_new_tokens=GEN, request_id="bad-admit")
            engine.add_request(p, max_new_tokens=GEN, request_id="bad-prefill")
    resets, preemptions = engine.metrics.device_resets, engine.metrics.preemptions
    for n in range(500):
        if not engine.has_work:
            break
        if n == 1:
            try:
                engine.warmup()
            except RuntimeError as e:
                out["warmup_refused"] = str(e)
        try:
            engine.step()
        except RuntimeError as e:
            out["raised"].append(str(e))
        for sh in engine.shards:
            assert not sh.scheduler.pass_decode and not sh.scheduler.pass_admitted
            if isinstance(sh.scheduler.manager, Coordinator):
                sh.scheduler.manager.check_invariants()
    engine.scheduler.deliver(wait=True)
    done = engine.finished
    names = [f"r{i}" for i in range(NUM_REQUESTS)] + ["bad-admit", "bad-prefill"]
    out.update(tokens={k: done[k].generated for k in names},
               reasons={k: done[k].finish_reason for k in names},
               errors={k: done[k].error for k in names},
               device_resets=engine.metrics.device_resets - resets,
               preemptions=engine.metrics.preemptions - preemptions)
    return out


def refusals(model):
    """The messages of the configurations a 4-device mesh engine refuses, by case."""
    from flax import nnx

    from hisparse_jax import models
    from hisparse_jax.engine.mesh import MeshEngine

    cases = {"seats": (model, dict(max_seats=6), (4, 1)),
             "devices": (model, {}, (3, 1)),
             # An abstract model (no initialisation): the check runs before any placement.
             "heads": (nnx.eval_shape(lambda: models.Transformer(
                 models.get_config("tiny", num_heads=2), rngs=nnx.Rngs(0))), {}, (1, 4))}
    out = {}
    for name, (m, kw, shape) in cases.items():
        try:
            MeshEngine(m, engine_config("hisparse", **kw), mesh_shape=shape)
        except ValueError as e:
            out[name] = str(e)
    return out


def process(out_path, spec, port, process_id):
    os.environ["XLA_FLAGS"] = cpu_devices_flags(2)
    os.environ["JAX_PLATFORMS"] = "cpu"
    from pallas_kernels import _compat

    _compat.initialize_distributed(f"localhost:{port}", 2, int(process_id))
    import jax

    from hisparse_jax import models
    from hisparse_jax.engine.mesh import MeshEngine

    shape, mode, *features = spec.split(":")
    engine = MeshEngine(models.init_model("tiny", seed=0), engine_config(mode, features),
                        mesh_shape=tuple(int(n) for n in shape.split("x")))
    got = run(engine)
    record = {"process": jax.process_index(), "devices": len(jax.devices()),
              "local_devices": len(jax.local_devices()),
              "shards": [sh.index for sh in engine.shards],
              "tokens": {i: t for i, (t, _) in got.items()}, **figures(engine),
              "drains": engine.metrics.drains}
    engine.close()
    with open(out_path, "w") as f:
        json.dump(record, f)


# ---------------------------------------------------------------- compose (test_mesh_compose)

COMPOSE_SIZES = dict(max_seats=6, max_model_len=64, block_size=4)
COMPOSE_MODES = {"pressured": {"num_gpu_blocks": 22}, "all_resident": {}}
SPEC_K = 2


def _turns():
    """The multi-turn mix: (key, prompt, max_new_tokens, temperature, arrives at step) of the
    first turns (4 conversations, one sampled, and 2 single requests arriving later), and per
    conversation the new tokens of its second turn (added once its first turn finished:
    first-turn prompt + generated + these)."""
    import numpy as np

    first = [(f"c{i}", np.random.default_rng(100 + i).integers(0, 512, 18 + 6 * i).tolist(),
              10, 0.0 if i != 1 else 0.8, 0) for i in range(4)]
    single = [(f"s{i}", np.random.default_rng(200 + i).integers(0, 512, 12 + 8 * i).tolist(),
               8, 0.0 if i == 0 else 0.9, 3 + 2 * i) for i in range(2)]
    follow = {f"c{i}": np.random.default_rng(300 + i).integers(0, 512, 3).tolist()
              for i in range(4)}
    return first + single, follow


def compose_run(engine, *, tag="", max_steps=400, on_step=None):
    """Serves `_turns()` on `engine` (a second turn added the step after its first turn
    finished, among the others running); returns {key: Request}. `tag` prefixes the ids."""
    first, follow = _turns()
    ids, step = {}, 0
    queued = list(first)
    while True:
        for key, prompt, n, temperature, at in [q for q in queued if q[4] <= step]:
            queued.remove((key, prompt, n, temperature, at))
            ids[key] = engine.add_request(prompt, max_new_tokens=n, temperature=temperature,
                                          request_id=tag + key, seed=sum(map(ord, key)))
        for key, new in follow.items():
            rid = ids.get(key)
            if rid in engine.finished and key + "+" not in ids:
                req = engine.finished[rid]
                queued.append((key + "+", [*req.prompt, *req.generated, *new], 6,
                               req.temperature, step + 1))
                ids[key + "+"] = None  # placeholder until added
        if not engine.has_work and not queued:
            break
        engine.step()
        if on_step is not None:
            on_step(engine)
        step += 1
        assert step < max_steps, "no progress"
    engine.drain()
    engine.scheduler.deliver(wait=True)
    return {key: engine.finished[rid] for key, rid in ids.items()}


class _ReferenceDraft:
    """A `ScriptedDraft` whose known tokens come from the all-resident reference of the
    request itself (its drafts right when accept(j): generated token index j)."""

    def __new__(cls, reference, accept):
        from hisparse_jax.draft_sources import ScriptedDraft

        class Drafts(ScriptedDraft):
            def known_tokens(self, request):
                return reference(request)[1]

        return Drafts({}, lambda i, j: accept(j))


def _device_draft(reference, accept):
    """A `DeviceScriptedDraft` of the reference tokens of every request `compose_run` serves
    (a second turn's prompt: its first turn's reference tokens), keyed by sampling seed,
    right when accept(j) (generated token index j)."""
    import types

    from hisparse_jax.draft_sources import DeviceScriptedDraft

    def ref(key, prompt, n, temperature):
        seed = sum(map(ord, key))
        out = reference(types.SimpleNamespace(
            prompt=tuple(prompt), max_new_tokens=n, temperature=temperature,
            stop_token_ids=frozenset(), sampling_seed=seed))[1]
        known[seed] = out
        return out

    first, follow = _turns()
    known = {}
    for key, prompt, n, temperature, _ in first:
        out = ref(key, prompt, n, temperature)
        if key in follow:
            ref(key + "+", [*prompt, *out, *follow[key]], 6, temperature)
    return DeviceScriptedDraft(known, lambda seed, j: accept(j))


def _compose_engine(spec, model, reference):
    import jax

    from hisparse_jax.engine import (
        AllResident,
        EngineConfig,
        HiSparse,
        PrefillPolicy,
        Sizes,
        Speculative,
    )
    from hisparse_jax.engine.mesh import MeshEngine, make_mesh

    shape, mode, *features = spec.split(":")
    D, M = (int(n) for n in shape.split("x"))
    chunk = "chunk" in features
    speculative = None
    if "mtp" in features:
        speculative = Speculative(num_tokens=SPEC_K)
    elif "scripted" in features:
        speculative = Speculative(num_tokens=SPEC_K,
                                  draft=_ReferenceDraft(reference, lambda j: j % 3 != 2))
    elif "devdraft" in features:
        speculative = Speculative(num_tokens=SPEC_K,
                                  draft=_device_draft(reference, lambda j: j % 3 != 2))
    sizes = {**COMPOSE_SIZES, **COMPOSE_MODES[mode]}
    if speculative is not None and mode == "pressured":
        sizes["num_gpu_blocks"] = 40  # a hot region of 2 (1 + k) top-k rows
    config = EngineConfig(
        sizes=Sizes(**sizes), compilation_cache=False,
        prefill=PrefillPolicy(bucket=8, chunk_size=8 if chunk else None,
                              prefix_caching="prefix" in features),
        residency=AllResident() if mode == "all_resident" else HiSparse(),
        async_scheduling="async" in features, speculative=speculative)
    return MeshEngine(model, config, mesh=make_mesh((D, M), jax.devices()[:D * M]))


def _watch_in_flight(engine):
    """Counts the scheduler passes given in-flight ids of requests not running on their own
    shard (each shard's pass must count only its own steps in flight); returns [count]."""
    foreign = [0]
    for sh in engine.shards:
        sched = sh.scheduler

        def schedule(in_flight=frozenset(), sched=sched, fn=sched.schedule):
            foreign[0] += any(rid not in sched.running for rid in in_flight)
            return fn(in_flight)

        sched.schedule = schedule
    return foreign


def _check_shards(engine):
    """No request left, every copy delivered, every shard's coordinator consistent."""
    from host_tier import Coordinator

    assert not engine.running and not engine.waiting
    for sh in engine.shards:
        assert not sh.scheduler.pass_decode and not sh.scheduler.pass_admitted
        manager = sh.scheduler.manager
        if isinstance(manager, Coordinator):
            sh.scheduler.deliver(wait=True)
            manager.check_invariants()
            assert not manager.request_ids and not manager.has_pending_transfers()


def compose(out_path, specs):
    os.environ["XLA_FLAGS"] = cpu_devices_flags(4)
    from hisparse_jax import models
    from hisparse_jax.engine import PrefillPolicy, Sizes
    from tests.engine_reference import AllResidentReference

    references = {}
    record = {}
    for spec in specs:
        features = spec.split(":")[2:]
        mtp = "mtp" in features
        if mtp not in references:
            model = models.init_model(models.get_config("tiny", mtp_layers=1 if mtp else 0),
                                      seed=0)
            references[mtp] = (model, AllResidentReference(
                model, sizes=Sizes(**COMPOSE_SIZES), prefill=PrefillPolicy(bucket=64)))
        model, reference = references[mtp]
        try:
            engine = _compose_engine(spec, model, reference)
        except ValueError as e:  # a combination EngineConfig refuses (recorded, not served)
            record[spec] = {"refused": str(e)}
            continue
        foreign = _watch_in_flight(engine)
        warm = {}
        if "warmup" in features:
            from hisparse_jax.engine.metrics import CompileWatch

            engine.warmup()
            compiles = CompileWatch.count
            got = compose_run(engine)
            warm["served_compiles"] = CompileWatch.count - compiles
        else:
            got = compose_run(engine)
        _check_shards(engine)
        s = engine.summary()
        entry = {
            "mismatches": {k: [r.finish_reason, r.generated, *reference(r)] for k, r in
                           got.items() if (r.finish_reason, r.generated) != reference(r)},
            "finish_reasons": {k: r.finish_reason for k, r in got.items()},
            "shards": {k: next(sh.index for sh in engine.shards
                               if sh.scheduler.knows(r.request_id)) for k, r in got.items()},
            "num_cached": {k: r.num_cached for k, r in got.items()},
            "summary": {k: s[k] for k in (
                "prefix_hit_tokens", "prefix_hit_requests", "spilled_pages", "hot_lookups",
                "drains", "dropped_rows", "preemptions", "accepted_tokens", "draft_tokens",
                "tokens_per_request_step", "replay_mismatches", "decode_steps")},
            "traces": dict(engine.trace_counts), **warm,
            "foreign_in_flight": foreign[0]}
        if "faults" in features:
            entry["faults"] = compose_faults(engine, reference)
        record[spec] = entry
        engine.close()
    with open(out_path, "w") as f:
        json.dump(record, f)


def _once(fn, at, what):
    """`fn` raising RuntimeError(f"injected failure: {what}") at its call number `at` (after
    the call when what ends with "after the call": its donated operands are then gone)."""
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at and not what.endswith("after the call"):
            raise RuntimeError(f"injected failure: {what}")
        out = fn(*args, **kwargs)
        if calls[0] == at:
            import jax
            jax.block_until_ready(out)
            raise RuntimeError(f"injected failure: {what}")
        return out
    return wrapped


def compose_faults(engine, reference):
    """The mix again on `engine` (idle), with failures injected once each: one request's
    prefill raising (that request fails alone), shard 0's scheduler pass raising while it
    plans (`build_plan`), the mesh decode call raising after the call (every shard's donated
    caches gone), shard 1's collection of a decode step raising (the next step already
    dispatched on its tokens, or the collection after a failed launch). Steps until done,
    catching what a step raises. Returns the requests that differ from the reference, the
    raised messages (with their notes) and the figures."""
    sh0, sh1 = engine.shards[0], engine.shards[-1]

    def failing_prefill(req, *args, fn, **kwargs):
        if req.request_id == "f:c2":
            raise RuntimeError("prefill exploded")
        return fn(req, *args, **kwargs)

    for sh in engine.shards:  # wherever the request runs
        sh.runner.prefill = functools.partial(failing_prefill, fn=sh.runner.prefill)
        sh.runner.prefill_chunk = functools.partial(failing_prefill,
                                                    fn=sh.runner.prefill_chunk)
    manager = sh0.scheduler.manager
    manager.build_plan = _once(manager.build_plan, 9, "shard 0's plan")
    sh1.runner.collect_decode = _once(sh1.runner.collect_decode, 4, "shard 1's collection")
    jitted = engine.decoder.jitted
    calls = [0]

    def count(fn):
        def wrapped(*args, **kwargs):
            calls[0] += 1
            out = fn(*args, **kwargs)
            if calls[0] == 13:
                import jax
                jax.block_until_ready(out)
                raise RuntimeError("injected failure: the mesh decode call, after the call")
            return out
        return wrapped

    jitted.update({name: count(fn) for name, fn in jitted.items()})
    m = engine.metrics
    resets, preemptions = m.device_resets, m.preemptions
    raised = []
    real_step = engine.step

    def step():
        try:
            return real_step()
        except RuntimeError as e:  # with its notes: a collection after it failed too
            raised.append("; ".join([str(e), *getattr(e, "__notes__", ())]))
            return []

    engine.step = step
    got = compose_run(engine, tag="f:")
    del engine.step
    _check_shards(engine)
    return {"raised": raised,
            "failed": {k: r.error for k, r in got.items() if r.finish_reason == "error"},
            "mismatches": [k for k, r in got.items() if r.finish_reason != "error"
                           and (r.finish_reason, r.generated) != reference(r)],
            "device_resets": m.device_resets - resets, "preemptions": m.preemptions - preemptions,
            "replay_mismatches": m.replay_mismatches}


if __name__ == "__main__":
    os.environ.setdefault("HISPARSE_JAX_COMPILATION_CACHE", "0")
    command, out = sys.argv[1], sys.argv[2]
    if command == "meshes":
        meshes(out, sys.argv[3:])
    elif command == "compose":
        compose(out, sys.argv[3:])
    else:
        process(out, *sys.argv[3:])
