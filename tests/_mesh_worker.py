"""Runs `MeshEngine` on virtual CPU devices for `tests/test_mesh_engine.py` (a subprocess:
the device count must be set before jax starts, and the main suite runs with one device).

  python tests/_mesh_worker.py meshes OUT.json 4x1:hisparse 2x2:pressured:warmup 1x4:all_resident
      The single-device `Engine` (all-resident, the reference) and a `MeshEngine` per
      argument over 4 virtual devices, on the same requests; writes tokens and figures.
      ":warmup": `MeshEngine.warmup()` first, and the compiles of the run are counted;
      ":recover": then the requests again with failures injected (`faults`);
      ":grouped": the model with both layers in one index group (its host pool packed), against
      its own single-device reference (recorded as the entry's "reference_tokens").
  python tests/_mesh_worker.py process OUT.json MESH:MODE PORT PROCESS_ID
      One of two processes (`jax.distributed`, 2 virtual devices each) running a
      `MeshEngine` over the 4 global devices; writes its own shards' requests.
"""

from __future__ import annotations

import json
import os
import sys

MODES = {"hisparse": {}, "pressured": {"num_gpu_blocks": 22}, "all_resident": {}}
SIZES = dict(max_seats=4, max_model_len=64, block_size=4)
NUM_REQUESTS, GEN = 6, 12


def engine_config(mode="all_resident", **sizes):
    """The EngineConfig of `mode` (a key of MODES: its sizes, and all-resident or HiSparse),
    `sizes` changed; imports the engine, so call it once the device flags are set."""
    from hisparse_jax.engine import AllResident, Debug, EngineConfig, HiSparse, PrefillPolicy, Sizes
    return EngineConfig(sizes=Sizes(**{**SIZES, **MODES[mode], **sizes}),
                        prefill=PrefillPolicy(bucket=64), debug=Debug(collect_attention=True),
                        compilation_cache=False,
                        residency=AllResident() if mode == "all_resident" else HiSparse())


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

    shape, mode = spec.split(":")
    engine = MeshEngine(models.init_model("tiny", seed=0), engine_config(mode),
                        mesh_shape=tuple(int(n) for n in shape.split("x")))
    got = run(engine)
    record = {"process": jax.process_index(), "devices": len(jax.devices()),
              "local_devices": len(jax.local_devices()),
              "shards": [sh.index for sh in engine.shards],
              "tokens": {i: t for i, (t, _) in got.items()}, **figures(engine)}
    engine.close()
    with open(out_path, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    os.environ.setdefault("HISPARSE_JAX_COMPILATION_CACHE", "0")
    command, out = sys.argv[1], sys.argv[2]
    if command == "meshes":
        meshes(out, sys.argv[3:])
    else:
        process(out, *sys.argv[3:])
