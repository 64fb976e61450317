"""Host tier on the GPU: pinned pools above 64 GiB, and the engine with the data plane's GPU ops.

Run on the GPU machine: `python3 -m pytest -m gpu tests/test_host_tier_gpu.py`. The large-pool
tests run in a fresh interpreter, because XLA reads `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` once,
when JAX initialises its GPU backend (pytest's session already has).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from host_tier.worker.host_pool import HOST_MEMORY_LIMIT_ENV, available_ram_bytes

GIB = 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != HOST_MEMORY_LIMIT_ENV}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=400)


@pytest.mark.gpu
def test_pool_above_64_gib_sets_the_limit_and_spills_into_it():
    pool_gib = 66
    if 0.95 * available_ram_bytes() < (pool_gib + 4) * GIB:
        pytest.skip(f"needs ~{pool_gib + 4} GiB of free RAM")
    result = _python(f"""
        import json, os, time
        import numpy as np
        from host_tier import HostPool, TransferEngine
        from host_tier.plan import PageSpill, StepPlan, TableRows, TableUpdate
        t0 = time.perf_counter()
        pool = HostPool(num_layers=1, block_size=64, row_width=576, dtype="bfloat16",
                        host_pool_gib={pool_gib})
        alloc_s = time.perf_counter() - t0
        import jax, jax.numpy as jnp
        # The data plane comes after the pool, which must be made before JAX starts the GPU.
        from hisparse_jax.ops import mirror_rows, restore_rows
        limit = os.environ["{HOST_MEMORY_LIMIT_ENV}"]
        kv = jnp.ones((8, 64, 576), jnp.bfloat16) * jnp.arange(8, dtype=jnp.bfloat16)[:, None, None]
        empty = TableRows(np.zeros(0, np.int32), np.zeros((0, 1), np.int32))
        last = pool.num_blocks - 1
        plan = StepPlan(0, (), TableUpdate(empty, empty, empty), (), (), (),
                        (PageSpill(1, 3, last), PageSpill(2, 5, 1)))
        engine = TransferEngine(pool, mirror_fn=mirror_rows)
        t0 = time.perf_counter()
        engine.after_forward(plan, [kv])
        report = engine.poll(wait=True)
        spill_s = time.perf_counter() - t0
        kind = pool.layer(0).sharding.memory_kind
        rows = jnp.array([last * 64, 64, 128], jnp.int32)  # first row of blocks last, 1, 2
        small = restore_rows(pool.layer(0), jnp.zeros((1, 3, 576), jnp.bfloat16),
                             rows, jnp.arange(3, dtype=jnp.int32))
        got = [float(x) for x in np.asarray(small, np.float32).reshape(3, -1).max(axis=1)]
        arrays = pool.arrays
        pool.close()
        print(json.dumps(dict(limit=limit, blocks=pool.num_blocks, gib=pool.nbytes / 2**30,
                              alloc_s=alloc_s, spill_s=spill_s, kind=kind, got=got,
                              completed=list(report.completed),
                              deleted=all(a.is_deleted() for a in arrays))))
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    print(out)
    assert int(out["limit"]) >= pool_gib * 1.05
    assert out["kind"] == "pinned_host" and out["gib"] > 64
    assert out["got"] == [3.0, 5.0, 0.0]
    assert out["completed"] == [1, 2] and out["deleted"]


@pytest.mark.gpu
def test_pool_above_the_limit_after_jax_started_is_a_clear_error():
    result = _python("""
        import jax
        jax.devices()
        from host_tier import HostPool
        try:
            HostPool(num_layers=1, block_size=64, row_width=576, dtype="bfloat16",
                     host_pool_gib=80)
        except ValueError as e:
            print("ERR", e)
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"set {HOST_MEMORY_LIMIT_ENV}=" in result.stdout, result.stdout + result.stderr


@pytest.mark.gpu
def test_soak_with_the_data_plane_ops_on_the_gpu():
    import random

    from hisparse_jax.ops import mirror_rows, restore_rows
    from host_tier.testing import SimulatedServer, run_seeded_soak

    rng = random.Random(3)
    sim = SimulatedServer(seed=3, mirror_fn=mirror_rows, restore_fn=restore_rows, row_width=8)
    try:
        run_seeded_soak(sim, rng, 250)
        assert sim.coord.stats["lost_pages"] > 0 and sim.coord.stats["copy_on_write"] > 0
        sim.release_all_and_check_leaks()
    finally:
        sim.close()
