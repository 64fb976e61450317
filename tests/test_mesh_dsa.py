"""The mesh engine serving loaded DSA checkpoints (`docs/mesh.md`, "DSA models").

`tests/_mesh_dsa_worker.py` runs in two subprocesses at once (one per fixture, 4 virtual CPU
devices each): the fixture is loaded with `from_pretrained(..., mesh=)` (each parameter
created over the mesh from the checkpoint slices its devices hold) and served by a
`MeshEngine` per mesh shape 1x2, 2x1, 2x2 and 1x4, HiSparse under pool pressure (its steps
before the pressure run the all-resident decode variant, the rest the host-reading one),
and all-resident on one mesh per fixture; float32 weights and rows. Every engine decodes
transformers' greedy tokens (the fixture's `greedy`, which the single-device engine decodes:
`tests/test_models_hf.py`). The expert stacks hold E / M experts per device, the dense
kernels their tensor-parallel share, the engine serves the loaded arrays as placed, and the
compiled decode steps all-gather activations of the batch rows only, never a parameter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from hisparse_jax.models import from_pretrained
from hisparse_jax.models.dsa_moe import MoE
from hisparse_jax.models.placement import _parameter_slots, _slice_reader
from hisparse_jax.models.protocol import MODEL_AXIS, partition_specs, path_name

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_mesh_dsa_worker.py"
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
CASES = {
    "dsv32-yarn": ["1x2:pressured:hlo", "2x1:pressured", "2x2:pressured:hlo",
                   "1x4:pressured", "2x2:all_resident"],
    "glm5-shared": ["1x2:pressured", "2x1:pressured", "2x2:pressured",
                    "1x4:pressured:hlo", "1x4:all_resident"],
}


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), HISPARSE_JAX_COMPILATION_CACHE="0",
               JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mesh_dsa")
    procs = {}
    for name, cases in CASES.items():
        out = folder / f"{name}.json"
        procs[name] = (out, subprocess.Popen(
            [sys.executable, str(WORKER), str(out), *(f"{name}:{c}" for c in cases)],
            env=_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    record = {}
    for out, proc in procs.values():
        log, _ = proc.communicate(timeout=900)
        assert proc.returncode == 0, log[-4000:]
        record.update(json.loads(out.read_text()))
    return record


def _mesh(case: str) -> tuple[int, int]:
    D, M = case.split(":")[1].split("x")
    return int(D), int(M)


def test_every_mesh_decodes_transformers_greedy_tokens(runs):
    assert len(runs) == sum(map(len, CASES.values()))
    for case, run in runs.items():
        assert run["tokens"] == run["greedy"], case
        if ":pressured" in case:
            # Pages spilled and were read back through the hot regions; both decode
            # variants ran (all-resident lookups before the pressure, host reads after).
            assert run["hot_misses"] > 0, case
            assert 0 < run["fast_path_steps"] < run["decode_steps"], case
            assert run["traces"] == {"decode_fast": 1, "decode_hot": 1}, case
        else:
            assert run["hot_misses"] == 0 and run["traces"] == {"decode_fast": 1}, case


def test_each_device_holds_its_share_of_the_experts_and_dense_kernels(runs):
    # The expert stacks on E; q_b_proj by heads (its output dim); o_proj and the dense MLP's
    # down_proj on their input dim.
    dims = {"w_gate_up": 0, "w_down": 0, "wq_b": 1, "wo": 0, "mlp_down": 0}
    for case, run in runs.items():
        D, M = _mesh(case)
        assert run["shares"]["w_gate_up"]["shape"][0] == run["experts"] == 8, case
        for name, dim in dims.items():
            share = list(run["shares"][name]["shape"])
            share[dim] //= M
            assert run["shares"][name]["shards"] == [share] * (D * M), (case, name)
        assert run["served_as_placed"], case  # the engine neither re-placed nor gathered


def test_the_compiled_decode_steps_gather_no_parameter(runs):
    checked = 0
    for case, run in runs.items():
        if "all_gathers" not in run:
            continue
        D, M = _mesh(case)
        seats = 2 // D
        split = [list(s) for s in run["split_shapes"]]
        assert [8, 64, 64] in split, case  # the expert stack w_gate_up
        assert run["all_gathers"], case  # the check sees the step's collectives
        for dtype, shape in run["all_gathers"]:
            assert shape not in split, (case, shape)  # no parameter gathered whole
            # What is gathered over "model": activations of the shard's batch rows (hidden
            # states, the sampler's per-shard best logits), never a weight.
            assert shape[0] == seats, (case, dtype, shape)
        checked += 1
    assert checked == 3


# ------------------------------------------------------------------ in-process units


@pytest.fixture(scope="module")
def dsv32():
    return from_pretrained(FIXTURES / "dsv32-yarn", kv_dtype="float32")


def test_tensor_parallel_dims_of_the_dsa_parameters(dsv32):
    specs = partition_specs(dsv32, 2)
    _, params = nnx.split(dsv32)
    names = [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    dims = {n.removesuffix(".value"): next((i for i, a in enumerate(s) if a), None)
            for n, s in zip(names, specs, strict=True)}
    want = {
        "embed.embedding": 1, "lm_head.kernel": 1, "final_norm.scale": None,
        "blocks.0.attn.wq_a.kernel": None, "blocks.0.attn.wq_b.kernel": 1,
        "blocks.0.attn.wkv_a.kernel": None, "blocks.0.attn.w_uk": 0, "blocks.0.attn.w_uv": 0,
        "blocks.0.attn.wo.kernel": 0, "blocks.0.indexer.wq.kernel": None,
        "blocks.0.indexer.wk.kernel": None, "blocks.0.indexer.w_heads.kernel": None,
        "blocks.0.mlp.gate.kernel": 1, "blocks.0.mlp.up.kernel": 1,
        "blocks.0.mlp.down.kernel": 0, "blocks.1.mlp.router.kernel": None,
        "blocks.1.mlp.router.bias": None, "blocks.1.mlp.w_gate_up": 0,
        "blocks.1.mlp.w_down": 0, "blocks.1.mlp.shared.gate.kernel": 1,
        "blocks.1.mlp.shared.down.kernel": 0, "mtp.eh_proj.kernel": None,
        "mtp.head.kernel": 1}
    assert {n: dims[n] for n in want} == want


def test_the_slice_reader_reads_only_its_experts(dsv32):
    cfg = dsv32.cfg
    fills = _parameter_slots(cfg)[("blocks", 1, "mlp", "w_gate_up")]
    shape = tuple(dsv32.blocks[1].mlp.w_gate_up[...].shape)
    read_names = []

    def read(name, dtype):
        read_names.append(name)
        return np.full(_shape_of(cfg, name), int(name.split(".")[5]), dtype)

    make = _slice_reader(read, cfg, fills, shape, np.dtype(np.float32))
    got = make((slice(4, 6), slice(None), slice(None)))
    assert got.shape == (2, *shape[1:])
    assert sorted({int(n.split(".")[5]) for n in read_names}) == [4, 5]
    assert len(read_names) == 4  # gate_proj and up_proj of experts 4 and 5
    assert (got[0] == 4).all() and (got[1] == 5).all()


def _shape_of(cfg, name):
    from hisparse_jax.models.dsa_weights import expected_tensors

    return expected_tensors(cfg)[name]


def test_a_one_device_mesh_loads_the_same_values(dsv32):
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", MODEL_AXIS))
    placed = from_pretrained(FIXTURES / "dsv32-yarn", kv_dtype="float32", mesh=mesh)
    a, b = jax.tree.leaves(nnx.state(placed)), jax.tree.leaves(nnx.state(dsv32))
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.sharding.mesh == mesh and np.array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="must have an axis 'model'"):
        from_pretrained(FIXTURES / "dsv32-yarn",
                        mesh=Mesh(np.array(jax.devices()[:1]), ("x",)))


def test_for_mesh_splits_the_experts_of_a_copy(dsv32):
    one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", MODEL_AXIS))
    assert dsv32.for_mesh(one, MODEL_AXIS) is dsv32  # one device: today's path
    two = jax.sharding.AbstractMesh((1, 2), ("data", MODEL_AXIS))
    split = dsv32.for_mesh(two, MODEL_AXIS)
    moes = [b.mlp for b in split.blocks if isinstance(b.mlp, MoE)]
    assert moes and all(m.expert_axis == MODEL_AXIS and m.expert_mesh is two for m in moes)
    assert all(b.mlp.expert_axis is None for b in dsv32.blocks if isinstance(b.mlp, MoE))
    assert split.blocks[1].mlp.w_gate_up[...] is dsv32.blocks[1].mlp.w_gate_up[...]
    with pytest.raises(ValueError, match="must divide n_routed_experts=8"):
        moes[0].split_experts(jax.sharding.AbstractMesh((3,), (MODEL_AXIS,)), MODEL_AXIS)
