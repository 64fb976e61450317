"""Soak: each combination of serving features that used to be refused (asynchronous
scheduling with prefix caching and chunked prefill, prefix caching with MTP drafts and
chunked prefill, asynchronous scheduling with MTP drafts, all of them together, with bf16
and fp8 rows) serves a stream of requests with random lengths, stop tokens, sampling,
multi-turn continuations and cancels, with each fault injected once (`tests/soak.py`);
every finished request equals the synchronous, one-shot, all-resident engine's output. The
mesh combinations (`soak.MESH_SOAK`: 2x1 and 2x2, chunked prefill, prefix caching,
asynchronous scheduling, speculation) run in a subprocess with 4 virtual CPU devices
(`tests/_compose_worker.py soak`). HISPARSE_SOAK_REQUESTS sets the requests per combination
(default 40).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from tests import soak
from tests.compose import Features

REQUESTS = int(os.environ.get("HISPARSE_SOAK_REQUESTS", "40"))
ROOT = Path(__file__).resolve().parents[1]

COMBOS = [
    Features(async_scheduling=True, prefix_caching=True, chunk_size=8),
    Features(prefix_caching=True, chunk_size=5, spec_k=2, draft="reference"),
    Features(async_scheduling=True, spec_k=2, draft="mtp"),
    Features(async_scheduling=True, spec_k=1, draft="reference", kv_format="fp8_ds_mla"),
    Features(async_scheduling=True, prefix_caching=True, chunk_size=8, spec_k=2, draft="mtp",
             kv_format="fp8_ds_mla"),
]


@pytest.mark.parametrize("f", COMBOS, ids=lambda f: f.label())
def test_soak_every_finished_request_equals_the_reference(f):
    problems = soak.soak(f, requests=REQUESTS, seed=zlib.crc32(f.label().encode()) % 2 ** 16)
    assert not problems, "\n".join(problems[:20])


def test_soak_on_meshes():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "_compose_worker.py"), "soak",
                           str(REQUESTS)], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0 and "mesh soak exact" in proc.stdout, (
        proc.stdout[-6000:] + proc.stderr[-6000:])
