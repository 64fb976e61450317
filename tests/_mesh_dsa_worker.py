"""Runs `MeshEngine` on a loaded DSA checkpoint over virtual CPU devices, for
`tests/test_mesh_dsa.py` (a subprocess: the device count is fixed before jax starts).

  python tests/_mesh_dsa_worker.py OUT.json FIXTURE:DxM:MODE[:hlo] ...
      For each case: `from_pretrained(tests/fixtures/hf/FIXTURE, mesh=)` over the first D * M
      of 4 virtual devices (float32 weights and rows), a `MeshEngine` of MODE
      ("all_resident", or "pressured": HiSparse with a small device pool), both fixture
      prompts, 16 greedy tokens each. Writes, per case, the tokens, hot misses, the shapes of
      the expert stacks and split dense kernels and of each device's share, whether the
      engine serves the loaded arrays as placed, and with ":hlo" the result shapes of the
      compiled decode steps' all-gathers.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
MAX_LEN, BLOCK, GEN = 64, 4, 16
# Device blocks per layer and data shard under pressure: the fixtures' prompts are 40 and 25
# tokens (14 and 11 pages with their 16 tokens); one data shard holds both, two hold one each.
PRESSURE_BLOCKS = {1: 20, 2: 16}
_GATHER = re.compile(r"=\s*(\w+)\[([\d,]*)\](?:\{[^}]*\})?\s+all-gather(?:-start)?\(")


def all_gathers(hlo: str) -> list[list]:
    """[dtype, shape] of each all-gather result in a compiled HLO text."""
    return [[dt, [int(n) for n in dims.split(",") if n]] for dt, dims in _GATHER.findall(hlo)]


def spy(decoder, residency):
    """Replaces the decoder's jitted variant of `residency` by one that records the abstract
    arguments of its calls; returns (the jitted function, the record)."""
    import jax

    from hisparse_jax.engine.step_builder import variant_name

    fn, seen = decoder._jit(residency), {}

    def recorded(*args):
        seen.setdefault("args", jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), args))
        return fn(*args)

    decoder.jitted[variant_name(residency)] = recorded
    return fn, seen


def shard_shapes(array) -> list[list[int]]:
    """The shape of each local device's share of `array`, sorted."""
    return sorted(list(s.data.shape) for s in array.addressable_shards)


def run_case(case: str, models: dict) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from hisparse_jax.cache import AllResident
    from hisparse_jax.engine import EngineConfig, HiSparse, PrefillPolicy, Sizes
    from hisparse_jax.engine.mesh import MeshEngine, make_mesh, param_specs
    from hisparse_jax.models import from_pretrained

    name, shape, mode, *flags = case.split(":")
    D, M = (int(n) for n in shape.split("x"))
    key = (name, shape)
    if key not in models:
        mesh = make_mesh((D, M), jax.devices()[:D * M])
        models[key] = (mesh, from_pretrained(os.path.join(FIXTURES, name),
                                             kv_dtype="float32", mesh=mesh))
    mesh, model = models[key]
    sizes = Sizes(max_seats=2, max_model_len=MAX_LEN, block_size=BLOCK,
                  num_gpu_blocks=PRESSURE_BLOCKS[D] if mode == "pressured" else None)
    engine = MeshEngine(model, EngineConfig(
        sizes=sizes, residency=HiSparse() if mode == "pressured" else AllResident(),
        prefill=PrefillPolicy(bucket=MAX_LEN), compilation_cache=False), mesh=mesh)
    variants = [AllResident()] + ([engine.residency] if mode == "pressured" else [])
    spies = [spy(engine.decoder, r) for r in variants]
    want = dict(np.load(os.path.join(FIXTURES, name, "expected.npz")))
    t0 = time.perf_counter()
    ids = [engine.add_request(want["prompt" + s].tolist(), max_new_tokens=GEN)
           for s in ("", "2")]
    out = engine.run()
    seconds = time.perf_counter() - t0
    moe = next(b.mlp for b in model.blocks if hasattr(b.mlp, "w_gate_up"))
    dense = model.blocks[0]
    leaves = jax.tree.leaves(nnx.split(model)[1])
    record = {
        "tokens": [list(out[i].generated) for i in ids],
        "greedy": [want["greedy" + s].tolist() for s in ("", "2")],
        "hot_misses": engine.metrics.hot_misses, "traces": dict(engine.trace_counts),
        **{k: engine.summary()[k] for k in ("fast_path_steps", "decode_steps")},
        "experts": moe.cfg.n_routed_experts,
        "shares": {name: {"shape": list(x.shape), "shards": shard_shapes(x)} for name, x in (
            ("w_gate_up", moe.w_gate_up[...]), ("w_down", moe.w_down[...]),
            ("wq_b", dense.attn.wq_b.kernel[...]), ("wo", dense.attn.wo.kernel[...]),
            ("mlp_down", dense.mlp.down.kernel[...]))},
        "served_as_placed": all(a is b for a, b in zip(engine.params, leaves, strict=True)),
        # The full shapes of the parameters split over "model" (expert stacks included).
        "split_shapes": sorted({tuple(x.shape) for x, spec in zip(
            leaves, param_specs(model, M), strict=True) if any(spec)}),
        "seconds": seconds}
    if "hlo" in flags:
        record["all_gathers"] = [
            g for fn, seen in spies if "args" in seen
            for g in all_gathers(fn.lower(*seen["args"]).compile().as_text())]
    engine.close()
    return record


def main(out_path: str, cases: list[str]) -> None:
    flags = ["--xla_force_host_platform_device_count=4",
             os.environ.get("HISPARSE_TEST_XLA_FLAGS", "")]
    os.environ["XLA_FLAGS"] = " ".join(filter(None, flags))
    os.environ["JAX_PLATFORMS"] = "cpu"
    models: dict = {}
    record = {case: run_case(case, models) for case in cases}
    with open(out_path, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    os.environ.setdefault("HISPARSE_JAX_COMPILATION_CACHE", "0")
    main(sys.argv[1], sys.argv[2:])
