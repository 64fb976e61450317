"""The mesh engine (`hisparse_jax/engine/mesh.py`, `docs/mesh.md`) on virtual CPU devices.

Each test runs `tests/_mesh_worker.py` in subprocesses (the virtual device count is fixed
before jax starts; the main suite runs on one device): meshes 4x1, 2x2 and 1x4 in one
process, and a 2x2 mesh over two processes (`jax.distributed`, 2 devices each; with
asynchronous scheduling and chunked prefill). Every mesh engine must decode, for the same
requests (greedy and sampled), the tokens of the single-device engine; attention outputs
agree to bf16 rounding (the tensor-parallel split and the batch shape change the float
rounding of the projections, `docs/mesh.md`), but for a rare step where that rounding flips
a near-tie of the indexer's top-k. Features composed on meshes (async scheduling, chunked
prefill, prefix caching, speculation): `tests/test_mesh_compose.py`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hisparse_jax import models
from hisparse_jax.engine.mesh import make_mesh, param_specs

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "_mesh_worker.py"
ATTENTION_TOLERANCE = 0.05  # bf16 attention outputs of magnitude ~1-4: a few ulps


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT), HISPARSE_JAX_COMPILATION_CACHE="0",
               JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return env


def _worker(*args, timeout=600):
    return subprocess.Popen([sys.executable, str(WORKER), *map(str, args)], env=_env(),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def _wait(proc, timeout=600):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    out = tmp_path_factory.mktemp("mesh") / "meshes.json"
    _wait(_worker("meshes", out, "4x1:hisparse", "2x2:pressured:warmup:recover",
                    "1x4:all_resident", "2x2:pressured:grouped"))
    return json.loads(out.read_text())


def test_every_mesh_decodes_the_single_device_tokens(meshes):
    ref = meshes["reference"]
    assert len(ref) == 6
    for spec, run in meshes["meshes"].items():
        assert run["tokens"] == run.get("reference_tokens", ref), spec
        assert run["finish_reasons"] == {"length": 6}, spec
        # Per (request, step, layer) attention output: a few ulps apart at most (other
        # batch shapes or splits round differently; a data-parallel mesh may round exactly
        # alike: 4x1 read 0.0), except where that rounding flips a near-tie of the indexer's
        # top-k, which changes the attended rows (seen once in 144 slices, 1x4 on jax
        # 0.12.0.1: 0.32, tokens still equal). At most one slice in a hundred may.
        diffs = run["attention_slice_max_diffs"]
        assert len(diffs) == 6 * 12 * 2, spec  # 6 requests x 12 steps x 2 layers
        assert sum(d >= ATTENTION_TOLERANCE for d in diffs) <= len(diffs) // 100, (spec, diffs)
        # One jitted step per variant for the whole mesh.
        assert set(run["traces"].values()) == {1}, spec


def test_warmup_compiles_every_mesh_step_a_run_reaches(meshes):
    # The 2x2 engine ran `MeshEngine.warmup()` first (both decode variants, under pressure):
    # the served run compiled nothing and decoded the single-device tokens (checked above).
    run = meshes["meshes"]["2x2:pressured"]
    assert run["warmup_compiles"] > 0 and run["served_compiles"] == 0
    assert run["warmup_seconds"] > 0 and run["metrics_warmup_seconds"] == run["warmup_seconds"]
    assert run["compile_seconds"] == 0.0  # the step clock counts every first call as warm
    assert run["traces"] == {"decode_fast": 1, "decode_hot": 1}


def test_failures_finish_only_their_request_and_the_next_step_works(meshes):
    # On the warmed 2x2 engine: one request's admission raises, one's prefill raises (each
    # finishes alone with "error"), and the mesh decode call raises once before the call and
    # once after it (its donated caches gone): both steps raise, the next steps work, and
    # every other request decodes the single-device tokens.
    rec = meshes["meshes"]["2x2:pressured"]["recovery"]
    assert "requests are running" in rec["warmup_refused"]  # warmup refuses mid-run
    assert len(rec["raised"]) == 2
    assert "injected failure before the call" in rec["raised"][0]
    assert "injected failure after the call" in rec["raised"][1]
    for rid, what in (("bad-admit", "admission exploded"), ("bad-prefill", "prefill exploded")):
        assert rec["reasons"][rid] == "error" and what in rec["errors"][rid]
        assert rec["tokens"][rid] == []
    ref = meshes["reference"]
    for i in range(len(ref)):
        assert rec["reasons"][f"r{i}"] == "length", i
        assert rec["tokens"][f"r{i}"] == ref[str(i)], i
    assert rec["preemptions"] > 0  # the failed steps' batches, recomputed by replay
    assert rec["device_resets"] == 2  # the lost caches of both data shards, rebuilt


def test_admission_spreads_requests_over_the_data_shards(meshes):
    for spec, run in meshes["meshes"].items():
        shards = run["shards"]
        assert sum(shards) == 6 and len(shards) == int(spec[0]), spec
        assert min(shards) >= 1, spec


def test_pressured_mesh_reads_through_hot_regions(meshes):
    run = meshes["meshes"]["2x2:pressured"]
    assert run["hot_lookups"] > 0 and run["spilled_pages"] > 0
    # Both layers in one index group: each data shard's host pool is one packed array, and
    # the mesh decodes its own single-device reference's tokens (checked above) under pressure.
    grouped = meshes["meshes"]["2x2:pressured:grouped"]
    assert grouped["pool_arrays"] == [1, 1]
    assert grouped["hot_lookups"] > 0 and grouped["spilled_pages"] > 0
    assert grouped["reference_tokens"] != meshes["reference"]  # another model
    assert run["traces"] == {"decode_fast": 1, "decode_hot": 1}
    assert run["fast_path_steps"] < run["decode_steps"]
    assert meshes["meshes"]["1x4:all_resident"]["spilled_pages"] == 0


def test_bad_meshes_are_refused_naming_the_rule(meshes):
    errors = meshes["errors"]
    assert "EngineConfig.sizes.max_seats=6" in errors["seats"]
    assert "data axis (4)" in errors["seats"]
    assert "3x1" in errors["devices"] and "4 devices" not in errors["devices"]
    assert "model axis (4)" in errors["heads"] and "w_uk" in errors["heads"]


def test_param_specs_split_the_dense_kernels_over_the_model_axis():
    import jax

    model = models.init_model("tiny", seed=0)
    specs = param_specs(model, 2)
    split = sum(any(s) for s in specs)
    assert 0 < split < len(specs)  # norms stay replicated
    with pytest.raises(ValueError, match="model axis \\(3\\) must divide"):
        param_specs(model, 3)
    with pytest.raises(ValueError, match="needs data \\* model = 2 devices"):
        make_mesh((2, 1))
    with pytest.raises(ValueError, match="mesh_shape must be"):
        make_mesh((0, 1))
    assert make_mesh((1, len(jax.devices()))).axis_names == ("data", "model")


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("spec", ["2x2:pressured:async:chunk"])
def test_two_processes_decode_the_single_device_tokens(tmp_path, spec):
    # Asynchronous scheduling and chunked prefill: every process dispatches the same mesh
    # decode steps (agreed through the all-gather) and drains at the same steps.
    from hisparse_jax.engine import Engine
    from tests import _mesh_worker

    port = _free_port()
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [_worker("process", outs[i], spec, port, i) for i in range(2)]
    for proc in procs:
        _wait(proc)
    records = [json.loads(o.read_text()) for o in outs]
    ref = _mesh_worker.run(Engine(models.init_model("tiny", seed=0),
                                  _mesh_worker.engine_config()))
    merged = {}
    for i, r in enumerate(records):
        assert r["process"] == i and r["devices"] == 4 and r["local_devices"] == 2
        assert r["shards"] == [i]  # each process drives the data shard of its devices
        assert r["tokens"] and not set(r["tokens"]) & set(merged)
        assert r["spilled_pages"] > 0 and r["drains"] > 0  # under pressure, async
        merged.update(r["tokens"])
    assert merged == {str(i): t for i, (t, _) in ref.items()}
