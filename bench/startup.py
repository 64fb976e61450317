"""Start-up cost of the decode example: a cold start (empty persistent compilation cache)
against warm starts (the cache the cold start filled), each a fresh process.

    python3 -m bench.startup                 # the GPU example (dsv32-2l, 8 requests, --check)
    python3 -m bench.startup --smoke         # a tiny CPU run of the same plumbing

Each start runs `examples/decode.py ... --json` in a new process with
`HISPARSE_JAX_COMPILATION_CACHE` set to a fresh directory (and `JAX_COMPILATION_CACHE_DIR`
unset, so the engine's own cache setting is what is measured). Reported per start: process
wall seconds (interpreter start to exit: imports, model init, warm-up, both modes' runs), the
engine's warm-up seconds per mode, compile seconds while serving (0 when the warm-up reached
every bucket) and the steady decode step time per mode (compiles excluded). The baseline of
every warm figure is the cold start of the same run; the file goes to
`bench/results/startup-<backend>.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench._common import write_result

ROOT = Path(__file__).resolve().parents[1]
GPU_EXAMPLE = ["--config", "dsv32-2l", "--requests", "8", "--seats", "8", "--prompt-len", "3500",
               "--gen-len", "32", "--max-model-len", "4096", "--block-size", "64",
               "--hot-size", "2048", "--gpu-blocks", "400", "--prefill-bucket", "4096",
               "--check"]
SMOKE_EXAMPLE = ["--requests", "2", "--seats", "2", "--prompt-len", "12", "--gen-len", "4",
                 "--max-model-len", "32", "--prefill-bucket", "32", "--check"]


def one_start(example_args: list[str], cache_dir: str, json_path: Path) -> dict[str, Any]:
    """Runs the example once in a fresh process; its figures."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["HISPARSE_JAX_COMPILATION_CACHE"] = cache_dir
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"]
                                     if env.get("PYTHONPATH") else "")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "decode.py"), *example_args,
                           "--json", str(json_path)], env=env, capture_output=True, text=True,
                          check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"decode.py exited {proc.returncode}:\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-2000:]}")
    return start_figures(json.loads(json_path.read_text()), wall)


def start_figures(record: dict[str, Any], wall: float) -> dict[str, Any]:
    """One start's figures from its `decode.py --json` record and its process wall seconds."""
    modes = {s["mode"]: {"warmup_s": s["warmup_seconds"],
                         "compile_while_serving_s": s["compile_seconds"],
                         "decode_step_ms": s["decode_step_ms"]}
             for s in record["summaries"]}
    return {"process_wall_s": wall, "modes": modes,
            "tokens_identical": record["tokens_identical"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a tiny CPU-sized example")
    p.add_argument("--warm-starts", type=int, default=2, help="warm starts after the cold one")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    if args.warm_starts < 1:
        p.error(f"--warm-starts must be >= 1, got {args.warm_starts}")
    example = SMOKE_EXAMPLE if args.smoke else GPU_EXAMPLE
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "cache")
        starts = []
        for i in range(1 + args.warm_starts):
            starts.append(one_start(example, cache, Path(tmp) / f"start{i}.json"))
            label = "cold" if i == 0 else f"warm {i}"
            print(f"{label}: {starts[-1]['process_wall_s']:.1f} s process wall, "
                  + ", ".join(f"{m} warm-up {v['warmup_s']:.1f} s, step {v['decode_step_ms']:.2f}"
                              f" ms, compile while serving {v['compile_while_serving_s']:.1f} s"
                              for m, v in starts[-1]["modes"].items()), flush=True)
    cold, warm = starts[0], starts[1:]
    best_warm = min(s["process_wall_s"] for s in warm)
    payload = {
        "example_args": example,
        "cold": cold,
        "warm": warm,
        "figure": {"name": "warm start process wall seconds (best of the warm starts)",
                   "value": best_warm, "baseline": "cold start, same run",
                   "baseline_value": cold["process_wall_s"],
                   "ratio": best_warm / cold["process_wall_s"]},
        "note": "process wall: interpreter start to exit, both modes (--check); step times "
                "exclude compilation; warm-up compiles every shape bucket ahead",
    }
    path = write_result("startup", payload, args.output)
    print(f"warm / cold process wall: {payload['figure']['ratio']:.2f} "
          f"({best_warm:.1f} s / {cold['process_wall_s']:.1f} s) -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
