"""`bench/mesh_decode.py` on two virtual CPU devices in a tiny smoke run (a subprocess: the
device count is fixed before jax starts; the figures come from the GPU run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests._mesh_worker import cpu_devices_flags

ROOT = Path(__file__).resolve().parents[1]


def test_mesh_benchmark_runs_and_writes_its_record(tmp_path):
    out = tmp_path / "mesh.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HISPARSE_JAX_COMPILATION_CACHE="0",
               JAX_PLATFORMS="cpu", XLA_FLAGS=cpu_devices_flags(2))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.mesh_decode", "--mesh", "2x1", "--config", "tiny",
         "--context", "128", "--gen-budget", "64", "--block-size", "16", "--concurrency", "3",
         "--warmup-steps", "1", "--measure-steps", "3", "--output", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    runs = record["results"]
    assert record["config"]["mesh"] == [2, 1] and record["machine"]["devices"] == 2
    assert runs["hisparse-1"]["concurrency"] == 3 and runs["hisparse-mesh"]["concurrency"] == 6
    for r in runs.values():
        assert r["measured_steps"] == 3 and r["decode_tokens_per_s"] > 0
    assert runs["hisparse-mesh"]["running_max"] == 6
    assert runs["hisparse-mesh"]["hit_rate"] > 0 and runs["all-resident-mesh"]["hit_rate"] is None
    tps = {k: r["decode_tokens_per_s"] for k, r in runs.items()}
    assert abs(record["ratios"]["mesh_over_one_device"]
               - tps["hisparse-mesh"] / tps["hisparse-1"]) < 1e-9
