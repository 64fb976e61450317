"""Every serving feature composes: random feature sets (asynchronous scheduling, prefix
caching, prefill chunk size, k MTP draft tokens and their source, fp8 rows, HiSparse under
pressure / with room / all-resident / naive offload, and a 2x1 or 2x2 mesh on virtual CPU
devices) serve random multi-turn request mixes, and every request decodes exactly the tokens
of the synchronous, one-shot, all-resident engine (`tests/compose.py`). No combination is
refused: building the engine must succeed.

The mesh cases run in a subprocess (`tests/_compose_worker.py`: the virtual device count is
fixed when jax starts; the suite runs with one device). Budgets: HISPARSE_COMPOSE_EXAMPLES
(single device, default 10) and HISPARSE_COMPOSE_MESH_EXAMPLES (default 4).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings

from tests import compose

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = int(os.environ.get("HISPARSE_COMPOSE_EXAMPLES", "10"))
MESH_EXAMPLES = int(os.environ.get("HISPARSE_COMPOSE_MESH_EXAMPLES", "4"))


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
@given(f=compose.features(), mix=compose.mixes())
@example(f=compose.everything()[0], mix=compose.EVERYTHING_MIX)
@example(f=compose.everything()[1], mix=compose.EVERYTHING_MIX)
def test_every_feature_set_decodes_the_reference_tokens(f, mix):
    engine = compose.build_engine(f)
    try:
        problems = compose.serve_mix(engine, mix, f)
    finally:
        engine.close()
    assert not problems, "\n".join(problems)


def test_every_feature_set_on_a_mesh_decodes_the_reference_tokens():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_compose_worker.py"),
                           str(MESH_EXAMPLES)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-6000:]
    assert f"{MESH_EXAMPLES} mesh examples exact" in proc.stdout, proc.stdout[-3000:]
