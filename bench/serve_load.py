"""Load on the HTTP server: N concurrent streaming clients, then the offline check.

    python3 -m bench.serve_load --clients 64 --requests 256 --out /tmp/serve-cpu.json \\
        -- --model tiny --seats 16 --max-model-len 128              # CPU, HiSparse
    python3 -m bench.serve_load --clients 256 --requests 1024 --prompt-len 3072 \\
        --output-len 64 --out serve-gpu.json -- --model dsv32-2l --seats 256 \\
        --max-model-len 4096 --block-size 64 --prefill-bucket 1024 \\
        --gpu-pool-fraction 0.5          # GPU, HiSparse (or --all-resident instead of the fraction)

Flags after `--` are the server's (`python3 -m hisparse_jax.serve --help`: the model, its
residency and sizes); without `--model` the `tiny` config is served. The benchmark starts
that server as a subprocess on 127.0.0.1 (a free port) and waits for its warm-up, or talks
to a running one at `--url` (give the same server flags, for the offline check). Each of
`--clients` asyncio clients (httpx) takes the next of `--requests` requests until none is
left or `--time-limit` seconds have passed; a request streams (`stream: true`) a random
token-id prompt of 3/4 to all of `--prompt-len` tokens with `max_tokens` = `--output-len`,
`--temperature` and `seed` = its index. A 503 (the server full) is retried after its
Retry-After. `--warmup-requests` requests run first, outside the figures.

Figures: generated tokens per second over the timed wall time (first request sent -> last
one finished), requests per second, TTFT (request sent -> first token's chunk) and ITL (the
gaps between a request's token chunks, divided among the chunk's tokens) p50 / p99 / mean as
the clients see them (one asyncio process reads every stream: when it falls behind, chunks
queued in a socket arrive together and count near-zero gaps), and from the server's
/metrics its own mean TTFT and ITL (where tokens leave the engine), the hot-buffer hit rate,
rows / bytes host -> device and the mean engine step time. Then the server is stopped
(SIGTERM; its exit status is recorded) and an offline `Engine` of the same model and
configuration serves every completed request (same prompt, max_tokens, temperature, seed
and stop tokens): "outputs equal offline: yes" when every response's token_ids and
finish_reason equal the offline engine's. `--out PATH` writes everything as JSON; the exit
status is 1 when a request failed or an output differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
FINISH = {"stop": "stop", "length": "length", "max_model_len": "length"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m bench.serve_load",
                                description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, default=256, help="requests in all (timed)")
    p.add_argument("--warmup-requests", type=int, default=4,
                   help="requests sent first, outside the figures")
    p.add_argument("--prompt-len", type=int, default=32, help="longest prompt, in tokens")
    p.add_argument("--output-len", type=int, default=32, help="max_tokens of each request")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--seed", type=int, default=0, help="seeds the prompts")
    p.add_argument("--time-limit", type=float, default=600.0,
                   help="seconds after which no new request starts (and in-flight ones stop)")
    p.add_argument("--start-timeout", type=float, default=1800.0,
                   help="seconds the server's start (model, warm-up) may take")
    p.add_argument("--url", default=None,
                   help="a running server (default: start one with the flags after --)")
    p.add_argument("--no-check", action="store_true", help="skip the offline comparison")
    p.add_argument("--out", default=None, metavar="PATH", help="write the results as JSON")
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the benchmark's flags, the server's: those after `--`, with --model tiny by default)."""
    if "--" in argv:
        at = argv.index("--")
        ours, server = argv[:at], argv[at + 1:]
    else:
        ours, server = argv, []
    if "--model" not in server:
        server = ["--model", "tiny", *server]
    return ours, server


def make_requests(args: argparse.Namespace, vocab: int, count: int, offset: int
                  ) -> list[dict[str, Any]]:
    """`count` request bodies (indices from `offset`): random prompts from --seed."""
    rng = np.random.default_rng(args.seed + offset)
    out = []
    for i in range(offset, offset + count):
        n = int(rng.integers(max(1, args.prompt_len * 3 // 4), args.prompt_len + 1))
        out.append({"prompt": rng.integers(0, vocab, n).tolist(), "max_tokens": args.output_len,
                    "temperature": args.temperature, "seed": i, "stream": True})
    return out


# ------------------------------------------------------------------ the server


class ServerProcess:
    """`python3 -m hisparse_jax.serve` as a subprocess on a free loopback port."""

    def __init__(self, flags: list[str], timeout: float) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"]
                                         if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hisparse_jax.serve", *flags, "--host", "127.0.0.1",
             "--port", "0"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=ROOT)
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout) or self.url is None:
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines[-40:]))

    url: str | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("serving ") and self.url is None:
                self.url = line.split(" on ")[-1].strip()
                self._ready.set()
        self._ready.set()  # exited

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (the server drains and exits); its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# ------------------------------------------------------------------ the clients


async def one_request(client: Any, url: str, body: dict[str, Any], deadline: float
                      ) -> dict[str, Any]:
    """Streams one request; its token ids, finish reason, times and 503 retries."""
    retries = 0
    while True:
        sent = time.perf_counter()
        ids, gaps, first, last, reason, error = [], [], None, sent, None, None
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code == 503 and time.perf_counter() < deadline:
                retries += 1
                await r.aread()
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
                continue
            if r.status_code != 200:
                return {"status": r.status_code, "error": (await r.aread()).decode()[:500],
                        "retries": retries}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    continue
                for choice in chunk["choices"]:
                    new = choice["token_ids"]
                    now = time.perf_counter()
                    if new:
                        if first is None:
                            first = now
                        else:
                            gaps += [(now - last) / len(new)] * len(new)
                        last = now
                        ids += new
                    reason = choice["finish_reason"] or reason
        return {"status": 200, "token_ids": ids, "finish_reason": reason, "error": error,
                "sent": sent, "first": first, "done": time.perf_counter(), "gaps": gaps,
                "retries": retries}


async def run_clients(url: str, bodies: list[dict[str, Any]], clients: int,
                      time_limit: float) -> tuple[list[dict[str, Any] | None], float, float]:
    """Runs `bodies` over `clients` concurrent clients; (results by index, None for the ones
    never started, the wall start and end)."""
    import httpx

    results: list[dict[str, Any] | None] = [None] * len(bodies)
    todo = iter(range(len(bodies)))
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    # An idle pooled connection expires on the client before the server's keep-alive timeout
    # (uvicorn's default 5 s) closes it: else a request sent on a connection the server is
    # closing fails with a ReadError (seen once in 512 on the GPU).
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients,
                          keepalive_expiry=2.0)
    timeout = httpx.Timeout(time_limit + 60.0, connect=60.0)

    async def worker(client: Any) -> None:
        for i in todo:
            if time.perf_counter() > deadline:
                return
            try:
                results[i] = await asyncio.wait_for(
                    one_request(client, url, bodies[i], deadline),
                    max(deadline - time.perf_counter(), 0) + 60.0)
            except (TimeoutError, httpx.HTTPError) as e:
                results[i] = {"status": None, "error": f"{type(e).__name__}: {e}"}

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    return results, t0, time.perf_counter()


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None, "n": 0}
    a = np.asarray(values) * 1e3
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)),
            "mean": float(a.mean()), "n": int(a.size)}


def load_figures(results: list[dict[str, Any] | None], t0: float, t1: float
                 ) -> dict[str, Any]:
    done = [r for r in results if r is not None and r.get("status") == 200
            and r.get("error") is None]
    ok = {id(r) for r in done}
    failed = [r for r in results if r is not None and id(r) not in ok]
    tokens = sum(len(r["token_ids"]) for r in done)
    wall = max((r["done"] for r in done), default=t1) - t0
    return {
        "requests_completed": len(done),
        "requests_failed": len(failed),
        "requests_not_started": sum(1 for r in results if r is None),
        "retries_503": sum(r.get("retries", 0) for r in results if r is not None),
        "wall_s": wall,
        "generated_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(done) / wall if wall > 0 else 0.0,
        "ttft_ms": percentiles([r["first"] - r["sent"] for r in done if r["first"]]),
        "itl_ms": percentiles([g for r in done for g in r["gaps"]]),
        "errors": sorted({str(r.get("error"))[:200] for r in failed})[:10],
    }


def server_figures(url: str) -> dict[str, Any]:
    """Hit rate, rows / bytes host -> device, step time and the server's mean TTFT / ITL
    (measured where the tokens leave the engine, without the clients' own delays) from its
    /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for s in family.samples:
            if not s.labels.get("le") and not s.name.endswith("_created"):
                key = s.name + "".join(f"[{v}]" for k, v in sorted(s.labels.items())
                                       if k != "model_name")
                values[key] = s.value
    hits = values.get("vllm:hisparse_cache_hits_total", 0.0)
    lookups = hits + values.get("vllm:hisparse_cache_misses_total", 0.0)
    steps = values.get("hisparse_jax:engine_step_seconds_count", 0.0)

    def mean_ms(histogram: str) -> float | None:  # the server's own view of a latency
        count = values.get(histogram + "_count", 0.0)
        return 1e3 * values[histogram + "_sum"] / count if count else None

    return {"hot_hit_rate": hits / lookups if lookups else None, "hot_lookups": lookups,
            "rows_h2d": values.get("hisparse_jax:host_to_device_rows_total"),
            "bytes_h2d": values.get("vllm:hisparse_host_to_device_bytes_total"),
            "engine_steps": steps,
            "engine_step_ms_mean": (1e3 * values["hisparse_jax:engine_step_seconds_sum"] / steps
                                    if steps else None),
            "preemptions": values.get("vllm:num_preemptions_total"),
            "ttft_ms_mean": mean_ms("vllm:time_to_first_token_seconds"),
            "itl_ms_mean": mean_ms("vllm:inter_token_latency_seconds"),
            "metrics": values}


# ------------------------------------------------------------------ the offline check


def offline_check(server_args: argparse.Namespace, bodies: list[dict[str, Any]],
                  results: list[dict[str, Any] | None]) -> dict[str, Any]:
    """Serves every completed request with an offline engine of the same model and config;
    whether each response equals it (token ids and finish reason)."""
    from hisparse_jax.engine import Engine
    from hisparse_jax.models.tokenizer import load_tokenizer
    from hisparse_jax.serve import args as serve_args

    model = serve_args.load_model(server_args)
    eos = ()
    if serve_args.is_checkpoint(server_args.model):
        tokenizer = load_tokenizer(server_args.model)
        eos = tokenizer.eos_token_ids if tokenizer is not None else ()
    engine = Engine(model, serve_args.engine_config(server_args, model.spec))
    try:
        rids = {}
        for i, (body, result) in enumerate(zip(bodies, results, strict=True)):
            if result is not None and result.get("status") == 200 and not result["error"]:
                rids[i] = engine.add_request(body["prompt"], max_new_tokens=body["max_tokens"],
                                             temperature=body["temperature"], seed=body["seed"],
                                             stop_token_ids=eos)
        done = engine.run()
        from bench._common import machine_description
        machine = machine_description()
    finally:
        engine.close()
    mismatches = []
    for i, rid in rids.items():
        req, got = done[rid], results[i]
        if (list(req.generated), FINISH.get(req.finish_reason)) != (got["token_ids"],
                                                                    got["finish_reason"]):
            mismatches.append({"request": i, "server": got["token_ids"][:16],
                               "offline": list(req.generated)[:16],
                               "finish": [got["finish_reason"], req.finish_reason]})
    return {"checked": len(rids), "equal": not mismatches and bool(rids),
            "mismatches": mismatches[:5], "num_mismatches": len(mismatches),
            "machine": machine}


def package_versions() -> dict[str, str | None]:
    """The versions of the server's and the clients' packages (None: not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("jax", "starlette", "uvicorn", "httpx", "prometheus_client", "tokenizers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def main(argv: list[str] | None = None) -> int:
    ours, server_flags = split_argv(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(ours)
    from hisparse_jax.serve import args as serve_args

    server_args = serve_args.parse_args(server_flags)  # exits 2 naming a bad server flag
    if args.prompt_len + args.output_len > server_args.max_model_len:
        sys.exit(f"--prompt-len {args.prompt_len} + --output-len {args.output_len} exceeds the "
                 f"server's --max-model-len {server_args.max_model_len}")
    vocab = serve_args.model_spec(server_args).vocab_size
    warm = make_requests(args, vocab, args.warmup_requests, offset=10**6)
    bodies = make_requests(args, vocab, args.requests, offset=0)
    server = None if args.url else ServerProcess(server_flags, args.start_timeout)
    url = args.url or server.url
    try:
        print(f"server {url}: {' '.join(server_flags)}", flush=True)
        asyncio.run(run_clients(url, warm, max(1, min(args.clients, len(warm))), 600.0))
        results, t0, t1 = asyncio.run(run_clients(url, bodies, args.clients, args.time_limit))
        figures = load_figures(results, t0, t1)
        figures["server"] = server_figures(url)
    finally:
        exit_status = server.stop() if server is not None else None
    record: dict[str, Any] = {
        "bench": "serve_load", "args": vars(args), "server_flags": server_flags,
        "mode": "all-resident" if server_args.all_resident else "hisparse",
        "server_exit_status": exit_status, "packages": package_versions(), **figures}
    check = None if args.no_check else offline_check(server_args, bodies, results)
    record["offline"] = check
    record["outputs_equal_offline"] = None if check is None else check["equal"]
    ttft, itl = figures["ttft_ms"], figures["itl_ms"]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    print(f"{record['mode']}: {figures['requests_completed']} requests "
          f"({figures['requests_failed']} failed) by {args.clients} clients in "
          f"{figures['wall_s']:.1f} s: {figures['tokens_per_s']:.1f} tokens/s, "
          f"{figures['requests_per_s']:.2f} requests/s")
    srv = figures["server"]
    rate = srv["hot_hit_rate"]
    print(f"clients' TTFT ms p50 {ms(ttft['p50'])} p99 {ms(ttft['p99'])}, ITL ms p50 "
          f"{ms(itl['p50'])} p99 {ms(itl['p99'])}; server's mean TTFT ms "
          f"{ms(srv['ttft_ms_mean'])}, ITL ms {ms(srv['itl_ms_mean'])}, engine step ms "
          f"{ms(srv['engine_step_ms_mean'])}; hot hit rate "
          f"{'-' if rate is None else f'{rate:.1%}'}")
    if check is not None:
        print(f"outputs equal offline: {'yes' if check['equal'] else 'no'} "
              f"({check['checked']} requests, {check['num_mismatches']} differ)")
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    ok = (check is None or check["equal"]) and figures["requests_failed"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
