"""End-to-end decode on a mesh against one device: `python3 -m bench.mesh_decode --mesh 2x1`.

At concurrency C per device (default: the most the default host pool of a device holds at
`--context`), three runs with synthetic prefill and drift top-k (`bench/e2e_decode.py`'s
method: ramp to the steady state, then `--measure-steps` timed engine steps):

  * "hisparse-1": the single-device `Engine` with C requests on one device's KV budget;
  * "hisparse-mesh": `MeshEngine` (`hisparse_jax/engine/mesh.py`) with D * C requests, each
    data shard with the same budget and its own host pool;
  * "all-resident-mesh": `MeshEngine` all-resident with as many requests as the shards'
    budgets hold (at most D * C).

Writes `bench/results/mesh_decode-<backend>.json` with decode tokens/s, the mesh / one-device
ratio (target >= 1.8x on 2 GPUs) and HiSparse / all-resident on the mesh. Set the device
count before jax starts (on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2).

`--async-scheduling`, `--prefill-chunk-size C` and `--prefix-caching` turn the serving feature
on in all three engines alike. Chunked prefill and prefix caching need the model's indexer
(`EngineConfig`'s rule), so with either the indexer selects (over the synthetic prefill's
unit-normal index keys) instead of the drift top-k source, and a chunk runs the model's
`prefill_chunk` (a real prefill of the prompt); the requests' prompts share all but their
last token, so with prefix caching every request after the first reuses published pages.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import platform
import time
from pathlib import Path
from typing import Any

import jax

from bench import e2e_decode
from bench._common import HelpFormatter
from hisparse_jax import models
from hisparse_jax.engine import Engine, EngineConfig
from hisparse_jax.engine.mesh import MeshEngine
from hisparse_jax.topk_sources import DriftTopK

RESULTS = Path(__file__).resolve().parent / "results"


def _run(model, args, sizes, *, mode: str, concurrency: int, build, shards: int,
         counter) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine = e2e_decode.make_engine(model, args, sizes, mode=mode, concurrency=concurrency,
                                    source=DriftTopK(turnover=args.turnover, seed=1), pool=None,
                                    build=build, shards=shards)
    try:
        info = {"setup_seconds": time.perf_counter() - t0, **e2e_decode.ramp(engine, args)}
        window = e2e_decode.Window(engine)
        window.measure(args.measure_steps, counter)
        return {"concurrency": concurrency, **window.result(), **info}
    finally:
        engine.close()
        gc.collect()


def with_features(ec: EngineConfig, args: argparse.Namespace) -> EngineConfig:
    """`ec` with `--prefill-chunk-size` / `--prefix-caching` (module docstring: the indexer
    selects; chunks padded to a multiple of their size); `--async-scheduling` is read by
    `e2e_decode.make_engine` itself."""
    chunk, prefix = args.prefill_chunk_size, args.prefix_caching
    if chunk is None and not prefix:
        return ec
    prefill = dataclasses.replace(ec.prefill, chunk_size=chunk, prefix_caching=prefix,
                                  bucket=ec.prefill.bucket if chunk is None else chunk)
    return dataclasses.replace(ec, topk_source=None, prefill=prefill)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--mesh", default="2x1", help="data x model (data * model = devices)")
    p.add_argument("--config", default="dsv32-2l", choices=sorted(models.CONFIGS),
                   help="model config (hisparse_jax.models.CONFIGS), randomly initialised")
    p.add_argument("--context", type=int, default=65536, help="prompt tokens per request")
    p.add_argument("--gen-budget", type=int, default=1024,
                   help="room for generated tokens (max_model_len = context + this)")
    p.add_argument("--concurrency", type=int, default=128, help="requests per device")
    p.add_argument("--turnover", type=float, default=0.05,
                   help="drift model: share of the top-k replaced per step")
    p.add_argument("--block-size", type=int, default=64, help="KV rows per block (page)")
    p.add_argument("--hot-size", type=int, default=None,
                   help="hot-region rows per request (default: 2 * top_k)")
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="device KV budget per shard, blocks per layer (default: sized for "
                        "--concurrency)")
    p.add_argument("--warmup-steps", type=int, default=8,
                   help="untimed engine steps after the ramp to the steady state")
    p.add_argument("--measure-steps", type=int, default=48, help="timed engine steps per run")
    p.add_argument("--max-ramp-steps", type=int, default=2000,
                   help="a run that has not reached its steady state after this many steps "
                        "fails")
    p.add_argument("--async-scheduling", action="store_true",
                   help="asynchronous scheduling in every engine (decode step t + 1 dispatched "
                        "before step t is collected)")
    p.add_argument("--prefill-chunk-size", type=int, default=None,
                   help="prefill prompts in chunks of this many tokens, in every engine (the "
                        "model's indexer selects instead of the drift source)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="prefix caching in every engine (per data shard on the mesh; the "
                        "model's indexer selects instead of the drift source)")
    p.add_argument("--output", default=None,
                   help="JSON path (default: bench/results/mesh_decode-<backend>.json)")
    args = p.parse_args(argv)
    if args.prefill_chunk_size is not None and args.prefill_chunk_size < 1:
        p.error(f"--prefill-chunk-size must be >= 1, got {args.prefill_chunk_size}")
    try:
        D, M = (int(n) for n in args.mesh.split("x"))
    except ValueError:
        p.error(f"--mesh must be DATAxMODEL, e.g. 2x1, got {args.mesh!r}")
    if D * M != len(jax.devices()):
        p.error(f"--mesh {args.mesh} needs {D * M} devices, there are {len(jax.devices())}")
    args.concurrency = [args.concurrency]  # e2e_decode.plan_sizes reads a list
    model = models.init_model(args.config, seed=0)
    sizes = e2e_decode.plan_sizes(args, model.spec)
    C = args.concurrency[0]
    counter = e2e_decode.CompileCounter()

    def one(m, ec):
        return Engine(m, with_features(ec, args))

    def mesh(m, ec):
        return MeshEngine(m, with_features(ec, args), mesh_shape=(D, M))

    runs = {
        "hisparse-1": _run(model, args, sizes, mode="hisparse", concurrency=C, build=one,
                           shards=1, counter=counter),
        "hisparse-mesh": _run(model, args, sizes, mode="hisparse", concurrency=D * C,
                              build=mesh, shards=D, counter=counter),
        "all-resident-mesh": _run(model, args, sizes, mode="all-resident",
                                  concurrency=D * C, build=mesh, shards=D, counter=counter),
    }
    for name, r in runs.items():
        print(f"{name:>18}: {r['concurrency']:5d} requests {r['decode_tokens_per_s']:10.1f} "
              f"tok/s  itl p50 {r['itl_ms_p50']:.2f} ms  hit {r['hit_rate']}")
    tps = {k: r["decode_tokens_per_s"] for k, r in runs.items()}
    record = {
        "date": datetime.date.today().isoformat(),
        "machine": {"device": str(jax.devices()[0].device_kind), "devices": len(jax.devices()),
                    "backend": jax.default_backend(), "jax": jax.__version__,
                    "python": platform.python_version()},
        "config": {"mesh": [D, M], "model": args.config, "context": args.context,
                   "concurrency_per_device": C, "turnover": args.turnover, **sizes,
                   "async_scheduling": args.async_scheduling,
                   "prefill_chunk_size": args.prefill_chunk_size,
                   "prefix_caching": args.prefix_caching},
        "results": runs,
        "ratios": {"mesh_over_one_device": tps["hisparse-mesh"] / tps["hisparse-1"],
                   "hisparse_over_all_resident_on_mesh":
                       tps["hisparse-mesh"] / tps["all-resident-mesh"]},
    }
    out = Path(args.output or RESULTS / f"mesh_decode-{jax.default_backend()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record["ratios"]), "->", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
