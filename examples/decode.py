"""Continuous-batching decode with the HiSparse host tier, on a randomly initialised model.

By default: the `tiny` config on the CPU, 6 requests on 4 seats, and a device KV pool that
holds only part of the contexts, so the host tier spills pages, unpins them, loses some to
other requests and serves the lost rows through each request's hot region. Prints a
progress bar over the decode steps and a summary (tokens/s, hot-buffer hit rate, rows and
bytes moved host -> device, memory in use). `--all-resident` runs the baseline with every
KV row on the device; `--check` runs both and compares the greedy tokens.

    python3 examples/decode.py                       # tiny, CPU, under pressure
    python3 examples/decode.py --all-resident        # the baseline
    python3 examples/decode.py --config dsv32-2l --requests 4 --prompt-len 3072 \\
        --gen-len 32 --block-size 64 --max-model-len 4096 --gpu-pool-fraction 0.5   # GPU
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from hisparse_jax import nn
from hisparse_jax.engine import Engine, EngineConfig
from host_tier.sizes import cdiv, round_up


class ProgressBar:
    """A dependency-free one-line progress bar on stderr."""

    def __init__(self, total: int, desc: str, width: int = 30) -> None:
        self.total, self.desc, self.width = max(total, 1), desc, width
        self.t0 = time.perf_counter()
        self.enabled = sys.stderr.isatty()
        self.last = -1.0

    def update(self, done: int, info: str = "") -> None:
        now = time.perf_counter()
        if not self.enabled and done < self.total and now - self.last < 2.0:
            return  # no terminal: a line every 2 s
        self.last = now
        frac = min(done / self.total, 1.0)
        bar = "#" * int(frac * self.width)
        line = (f"{self.desc} [{bar:<{self.width}}] {done}/{self.total} tokens "
                f"{now - self.t0:6.1f}s {info}")
        sys.stderr.write(("\r" + line) if self.enabled else (line + "\n"))
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def run(args: argparse.Namespace, *, all_resident: bool, model=None) -> Engine:
    cfg = nn.get_config(args.config, **({"top_k": args.top_k} if args.top_k else {}))
    model = model or nn.init_model(cfg, seed=args.seed)
    B = args.block_size
    pages = cdiv(args.max_model_len, B)
    hot_size = args.hot_size or round_up(2 * cfg.top_k, B)
    hot_blocks = cdiv(hot_size, B)
    seats = min(args.seats, args.requests)
    if args.gpu_blocks:
        gpu_blocks = args.gpu_blocks
    else:  # a fraction of what the contexts need, never below what one request needs
        ctx_pages = cdiv(args.prompt_len + args.gen_len, B)
        # (a lone request must fit its pages and its hot region, or it stalls forever)
        gpu_blocks = max(int(args.gpu_pool_fraction * seats * ctx_pages),
                         ctx_pages + hot_blocks + 3) + 1
    host_blocks = args.host_blocks or 1 + (seats + 1) * pages
    ec = EngineConfig(max_seats=seats, max_model_len=args.max_model_len, block_size=B,
                      hot_size=hot_size, num_gpu_blocks=gpu_blocks, num_host_blocks=host_blocks,
                      all_resident=all_resident, prefill_bucket=args.prefill_bucket,
                      seed=args.seed)
    engine = Engine(model, ec)
    rng = np.random.default_rng(args.seed)
    for _ in range(args.requests):
        length = int(rng.integers(max(1, args.prompt_len * 3 // 4), args.prompt_len + 1))
        engine.add_request(rng.integers(0, cfg.vocab_size, length).tolist(),
                           max_new_tokens=args.gen_len, temperature=args.temperature)
    mode = engine.mode
    print(f"[{mode}] {cfg.name} on {jax.default_backend()} ({jax.devices()[0].device_kind}): "
          f"{args.requests} requests on {seats} seats, prompts <= {args.prompt_len}, "
          f"{args.gen_len} new tokens, top_k {cfg.top_k}, block {B}, hot {hot_size}, device "
          f"pool {engine.num_gpu_blocks} blocks"
          + ("" if all_resident else f", host pool {host_blocks} blocks"), flush=True)
    bar = ProgressBar(args.requests * args.gen_len, mode)

    def on_step(e: Engine) -> None:
        m = e.metrics
        lookups = m.hot_hits + m.hot_misses
        rate = f"hit {m.hot_hits / lookups:5.1%}" if lookups else "fast path"
        bar.update(m.generated_tokens, f"| running {len(e.running)} waiting {len(e.waiting)} "
                   f"| {rate} | {_fmt_bytes(m.bytes_moved)} moved")

    engine.run(on_step=on_step)
    bar.close()
    return engine


def print_summary(engines: list[Engine]) -> None:
    rows = [
        ("requests finished", lambda s: f"{s['requests_finished']}"),
        ("prompt / generated tokens", lambda s: f"{s['prompt_tokens']} / "
                                                f"{s['generated_tokens']}"),
        ("decode steps (fast path)", lambda s: f"{s['decode_steps']} ({s['fast_path_steps']})"),
        ("decode tokens/s (steady state)", lambda s: f"{s['decode_tokens_per_s']:.1f}"),
        ("decode step time", lambda s: f"{s['decode_step_ms']:.1f} ms"),
        ("compile time (first calls)", lambda s: f"{s['compile_seconds']:.1f} s"),
        ("end-to-end tokens/s", lambda s: f"{s['tokens_per_s']:.1f}"),
        ("hot-buffer hit rate", lambda s: "-" if s["hot_lookups"] == 0
         else f"{s['hot_hit_rate']:.1%} of {s['hot_lookups']}"),
        ("rows moved host->device", lambda s: f"{s['rows_moved_h2d']} "
                                              f"({s['rows_moved_per_step']:.1f}/step)"),
        ("bytes moved host->device", lambda s: f"{_fmt_bytes(s['bytes_moved_h2d'])} "
                                               f"({_fmt_bytes(s['bytes_moved_per_step'])}/step)"),
        ("pages spilled / unpinned / lost", lambda s: f"{s['spilled_pages']} / "
                                                      f"{s['unpinned_pages']} / {s['lost_pages']}"),
        ("hot regions / preemptions", lambda s: f"{s['hot_grants']} / {s['preemptions']}"),
        ("device pool blocks", lambda s: f"{s['gpu_blocks']}"),
        ("device memory: params + caches", lambda s: _fmt_bytes(s["device_bytes"])),
        ("device memory: allocator in use", lambda s: "-" if s["device_allocator_bytes"] is None
         else _fmt_bytes(s["device_allocator_bytes"])),
        ("host memory: pinned KV pool", lambda s: _fmt_bytes(s["host_bytes"])),
    ]
    summaries = [e.summary() for e in engines]
    heads = [s["mode"] for s in summaries]
    width = max(len(r[0]) for r in rows)
    cols = [max(len(h), *(len(f(s)) for f_name, f in rows)) for h, s in zip(heads, summaries,
                                                                              strict=True)]
    line = "+" + "-" * (width + 2) + "".join("+" + "-" * (c + 2) for c in cols) + "+"
    print(line)
    print(f"| {'metric':<{width}} " + "".join(f"| {h:>{c}} " for h, c in zip(heads, cols,
                                                                            strict=True)) + "|")
    print(line)
    for name, f in rows:
        print(f"| {name:<{width}} " + "".join(f"| {f(s):>{c}} " for s, c in zip(summaries, cols,
                                                                               strict=True))
              + "|")
    print(line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="tiny", choices=sorted(nn.CONFIGS))
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--seats", type=int, default=4, help="decode batch rows (max_num_reqs)")
    p.add_argument("--prompt-len", type=int, default=64, help="longest prompt (random tokens)")
    p.add_argument("--gen-len", type=int, default=48, help="new tokens per request")
    p.add_argument("--max-model-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=4)
    p.add_argument("--top-k", type=int, default=None, help="override the config's top_k")
    p.add_argument("--hot-size", type=int, default=None, help="default 2 * top_k")
    p.add_argument("--gpu-blocks", type=int, default=None, help="device pool blocks per layer")
    p.add_argument("--gpu-pool-fraction", type=float, default=0.4,
                   help="without --gpu-blocks: device pool = this fraction of the contexts")
    p.add_argument("--host-blocks", type=int, default=None, help="host pool blocks")
    p.add_argument("--prefill-bucket", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--all-resident", action="store_true", help="no host tier (baseline)")
    p.add_argument("--check", action="store_true",
                   help="also run all-resident and require identical greedy tokens")
    args = p.parse_args(argv)

    model = nn.init_model(nn.get_config(args.config, **(
        {"top_k": args.top_k} if args.top_k else {})), seed=args.seed)
    engines = [run(args, all_resident=args.all_resident, model=model)]
    if args.check and not args.all_resident:
        engines.append(run(args, all_resident=True, model=model))
    print_summary(engines)
    first = next(iter(engines[0].finished.values()))
    print(f"request {first.request_id}: prompt[-8:] {list(first.prompt[-8:])} -> generated "
          f"{first.generated[:16]}{' ...' if len(first.generated) > 16 else ''}")
    if len(engines) == 2:
        a, b = engines[0].finished, engines[1].finished
        same = all(a[k].generated == b[k].generated for k in a)
        print(f"greedy tokens identical to all-resident: {same}")
        for e in engines:
            e.close()
        return 0 if same else 1
    for e in engines:
        e.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
