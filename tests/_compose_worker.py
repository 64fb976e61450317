"""Runs the mesh half of `tests/test_compose.py` under 4 virtual CPU devices (a subprocess:
the device count is fixed when jax starts).

  python tests/_compose_worker.py EXAMPLES
      Hypothesis draws EXAMPLES feature sets with a mesh shape (2x1 or 2x2) and a request
      mix each; every request must decode the single-device reference's tokens. Prints
      "EXAMPLES mesh examples exact" and exits 0, or prints the falsifying example and
      exits 1.
  python tests/_compose_worker.py soak REQUESTS
      `tests/soak.py` on each mesh combination of `MESH_SOAK`; prints "mesh soak exact" and
      exits 0, or prints the problems and exits 1.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests._mesh_worker import cpu_devices_flags

    os.environ["XLA_FLAGS"] = cpu_devices_flags(4)
    from hypothesis import HealthCheck, example, given, settings

    from tests import compose

    if sys.argv[1] == "soak":
        from tests import soak

        problems = []
        for f in soak.MESH_SOAK:
            problems += soak.soak(f, requests=int(sys.argv[2]), seed=7)
            print(f"{f.label()}: {len(problems)} problems so far", flush=True)
        print("\n".join(problems[:20]) if problems else "mesh soak exact", flush=True)
        sys.exit(1 if problems else 0)
    examples = int(sys.argv[1])
    count = [0]

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(f=compose.features(mesh=True), mix=compose.mixes())
    @example(f=compose.everything("2x2")[0], mix=compose.EVERYTHING_MIX)
    @example(f=compose.everything("2x1")[1], mix=compose.EVERYTHING_MIX)
    def check(f, mix):
        engine = compose.build_engine(f)
        try:
            problems = compose.serve_mix(engine, mix, f)
        finally:
            engine.close()
        assert not problems, "\n".join(problems)
        count[0] += 1

    check()
    print(f"{examples} mesh examples exact ({count[0]} runs)", flush=True)
