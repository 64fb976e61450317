"""Multi-turn serving: N conversations x T turns with real (chunked) prefill.

Each conversation starts with a prompt of `--first-prompt` random tokens; every turn submits
the conversation so far (earlier prompts and generated tokens) plus `--user-tokens` new
ones and generates `--gen-tokens` greedily; the next turn's prompt extends it. The turns run
in rounds: all N conversations submit turn t together and the engine steps until every one
finished, so each turn's figures compare across modes.

Modes (one engine each, one after another, the same model, GPU KV budget and workload):

  * `hisparse-reuse`: the host tier with prefix reuse (`EngineConfig.prefill.prefix_caching`):
    a turn's prompt hits the pages its conversation published, on the GPU or in the pinned
    pool, and only the new tokens are prefilled (`--prefix-hit-pages`: pool pages restored
    whole before the prefill, or only the rows its chunks select staged);
  * `hisparse`: the host tier, every turn prefills its whole prompt again;
  * `all-resident-reuse`: every row on the GPU (no host tier) with seat reuse
    (`EngineConfig.prefill.prefix_caching` in the all-resident mode: a finished turn's seat
    keeps its rows and the conversation's next turn reuses them while nobody else took the
    seat); the same GPU KV budget holds `(budget - 1) // pages` full conversations at once
    (seats), the rest wait;
  * `all-resident`: the same without reuse (not run by default);
  * `hisparse-reuse-async`: `hisparse-reuse` with asynchronous scheduling
    (`EngineConfig.async_scheduling`; not run by default): its tokens must equal
    `hisparse-reuse`'s, and the ratios give its throughput and TTFT against it.

`--speculative-tokens k` adds speculation to every mode (MTP drafts, or `--acceptance-rate r`:
the benchmark source that accepts each draft with probability r, whose tokens are not the
model's but are the same in every mode with the same seed).

Prefill is REAL (the model runs over every prompt token it computes, in chunks of
`--prefill-chunk-size` sharing steps with decode), unlike `bench/e2e_decode.py`'s synthetic
rows. Reported per (mode, turn): time to first token p50 / p95 (seconds from submission to
the step that sampled the request's first token), wall seconds, prompt tokens submitted,
computed and reused, generated tokens, bytes host -> device; per mode the totals and
tokens/s; ratios of `hisparse-reuse` against the other two (TTFT from `--ttft-from-turn` on,
total throughput). JSON in `bench/results/multiturn-<backend>.json` and a PNG (matplotlib).

    python3 -m bench.multiturn                                     # GPU defaults (dsv32-2l)
    python3 -m bench.multiturn --config tiny --conversations 3 --turns 3 --first-prompt 96 \\
        --user-tokens 24 --gen-tokens 8 --block-size 8 --prefill-chunk-size 32   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench._common import RESULTS_DIR, write_result
from hisparse_jax import models
from hisparse_jax.draft_sources import AcceptanceRateDraft, MTPDraft
from hisparse_jax.engine import (
    AllResident,
    Engine,
    EngineConfig,
    HiSparse,
    PrefillPolicy,
    Sizes,
    Speculative,
)
from host_tier.sizes import cdiv

MODES = ("hisparse-reuse", "hisparse", "all-resident-reuse", "all-resident",
         "hisparse-reuse-async")
DEFAULT_MODES = MODES[:3]


def _modes(text: str) -> list[str]:
    modes = [m for m in text.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise argparse.ArgumentTypeError(f"must list modes of {MODES}, got {text!r}")
    return modes


def max_model_len(args: argparse.Namespace) -> int:
    """Room for the last turn: every prompt, user turn and generated token, one block spare."""
    return (args.first_prompt + args.turns * (args.user_tokens + args.gen_tokens)
            + args.block_size)


def gpu_budget(args: argparse.Namespace) -> tuple[int, int]:
    """(GPU KV budget in blocks per layer, full conversations it holds all-resident): the
    budget is `--gpu-blocks`, by default every conversation's last turn plus two blocks."""
    pages = cdiv(max_model_len(args), args.block_size)
    budget = args.gpu_blocks or (args.conversations * (pages + 2) + 1)
    return budget, min(args.conversations, (budget - 1) // pages)


def engine_config(args: argparse.Namespace, mode: str) -> EngineConfig:
    """The `EngineConfig` of `mode` (raises ValueError where the engine refuses it): the
    HiSparse modes seat every conversation in the budget's blocks, the all-resident modes
    as many full conversations as the budget holds."""
    budget, resident_seats = gpu_budget(args)
    all_resident = mode.startswith("all-resident")
    reuse = mode in ("hisparse-reuse", "all-resident-reuse", "hisparse-reuse-async")
    speculative = None
    if args.speculative_tokens:
        draft = (MTPDraft() if args.acceptance_rate is None
                 else AcceptanceRateDraft(args.acceptance_rate))
        speculative = Speculative(num_tokens=args.speculative_tokens, draft=draft)
    if all_resident and resident_seats < 1:
        raise ValueError(f"the GPU KV budget of {budget} blocks holds no full conversation "
                         f"of {max_model_len(args)} tokens")
    return EngineConfig(
        sizes=Sizes(max_seats=resident_seats if all_resident else args.conversations,
                    max_model_len=max_model_len(args), block_size=args.block_size,
                    hot_size=args.hot_size, num_gpu_blocks=None if all_resident else budget),
        prefill=PrefillPolicy(
            chunk_size=args.prefill_chunk_size, bucket=args.prefill_chunk_size,
            max_tokens_per_step=args.max_prefill_tokens_per_step,
            prefix_caching=reuse,
            prefix_hit_pages=(args.prefix_hit_pages if reuse and not all_resident
                              else "restore")),
        residency=AllResident() if all_resident else HiSparse(), seed=0,
        speculative=speculative, async_scheduling=mode == "hisparse-reuse-async")


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def run_mode(model: models.Transformer, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """Every turn of every conversation in one engine of `mode`."""
    engine = Engine(model, engine_config(args, mode))
    try:
        warmup = 0.0 if args.no_warmup else engine.warmup()
        rng = np.random.default_rng(args.seed)
        vocab = model.cfg.vocab_size
        convs = [rng.integers(2, vocab, args.first_prompt).tolist()
                 for _ in range(args.conversations)]
        m = engine.metrics
        turns, outputs = [], []
        t_mode = time.perf_counter()
        for turn in range(args.turns):
            ids = {}
            submitted = 0
            p0, g0 = m.prompt_tokens, m.generated_tokens
            h0, st0 = engine.summary()["bytes_moved_h2d"], m.staged_bytes_host
            t0 = time.perf_counter()
            for i, conv in enumerate(convs):
                prompt = conv + rng.integers(2, vocab, args.user_tokens).tolist()
                ids[i] = engine.add_request(prompt, max_new_tokens=args.gen_tokens,
                                            request_id=(i, turn))
                convs[i] = prompt
                submitted += len(prompt)
            first: dict[int, float] = {}
            steps = 0
            while any(ids[i] not in engine.finished for i in ids):
                engine.step()
                steps += 1
                now = time.perf_counter() - t0
                for i, rid in ids.items():
                    if i in first:
                        continue
                    req = engine.running.get(rid) or engine.finished.get(rid)
                    if req is not None and req.generated:
                        first[i] = now
            wall = time.perf_counter() - t0
            failed = {i: engine.finished[rid].error for i, rid in ids.items()
                      if engine.finished[rid].finish_reason not in ("length", "stop")}
            if failed:
                raise RuntimeError(f"{mode}, turn {turn}: requests failed: {failed}")
            gen = {i: list(engine.finished[rid].generated) for i, rid in ids.items()}
            for i in ids:
                convs[i] = convs[i] + gen[i]
            outputs.append([gen[i] for i in sorted(gen)])
            ttft = [first[i] for i in sorted(first)]
            computed = m.prompt_tokens - p0
            turns.append({
                "turn": turn, "steps": steps, "wall_s": wall,
                "ttft_s_p50": _percentile(ttft, 50), "ttft_s_p95": _percentile(ttft, 95),
                "context_tokens_max": max(len(c) for c in convs),
                "prompt_tokens_submitted": submitted, "prompt_tokens_computed": computed,
                "prompt_tokens_reused": submitted - computed,
                "generated_tokens": m.generated_tokens - g0,
                "bytes_h2d": engine.summary()["bytes_moved_h2d"] - h0,
                "staged_bytes_h2d": m.staged_bytes_host - st0})
            print(f"[multiturn] {mode:14s} turn {turn}: TTFT p50 {turns[-1]['ttft_s_p50']:.3f} s "
                  f"p95 {turns[-1]['ttft_s_p95']:.3f} s, prompt computed {computed} of "
                  f"{submitted}, wall {wall:.2f} s, {steps} steps", flush=True)
        total = time.perf_counter() - t_mode
        s = engine.summary()
        generated = sum(t["generated_tokens"] for t in turns)
        return {"mode": mode, "seats": engine.config.sizes.max_seats, "warmup_s": warmup,
                "wall_s": total, "generated_tokens": generated,
                "generated_tokens_per_s": generated / total,
                "prompt_tokens_submitted": sum(t["prompt_tokens_submitted"] for t in turns),
                "prompt_tokens_computed": sum(t["prompt_tokens_computed"] for t in turns),
                "processed_tokens_per_s": (generated + sum(t["prompt_tokens_submitted"]
                                                           for t in turns)) / total,
                "preemptions": engine.metrics.preemptions, "bytes_h2d": s["bytes_moved_h2d"],
                "staged_bytes_h2d": s["staged_bytes_host"],
                "prefix_restored_pages": s["prefix_restored_pages"],
                "turns": turns, "tokens": outputs}
    finally:
        engine.close()
        gc.collect()


def ratios(results: list[dict[str, Any]], from_turn: int) -> dict[str, Any]:
    """`hisparse-reuse` over each other mode: TTFT p50 (theirs / ours, turns >= from_turn,
    mean over turns) and total throughput (ours / theirs, prompt + generated tokens/s)."""
    by = {r["mode"]: r for r in results if "turns" in r}
    ours = by.get("hisparse-reuse")
    out: dict[str, Any] = {}
    if ours is None:
        return out
    for mode, r in by.items():
        if mode == ours["mode"]:
            continue
        pairs = [(a["ttft_s_p50"], b["ttft_s_p50"]) for a, b in
                 zip(ours["turns"], r["turns"], strict=True)
                 if a["turn"] >= from_turn and a["ttft_s_p50"] and b["ttft_s_p50"]]
        out[f"ttft_p50_{mode}_over_reuse"] = (float(np.mean([b / a for a, b in pairs]))
                                             if pairs else None)
        out[f"throughput_reuse_over_{mode}"] = (ours["processed_tokens_per_s"]
                                                / r["processed_tokens_per_s"])
        out[f"tokens_identical_to_{mode}"] = ours["tokens"] == r["tokens"]
    if "hisparse-reuse-async" in by:  # asynchronous over synchronous, same features
        out["throughput_async_over_sync"] = out.pop(
            "throughput_reuse_over_hisparse-reuse-async") ** -1
        ttft = out.pop("ttft_p50_hisparse-reuse-async_over_reuse")
        out["ttft_p50_async_over_sync"] = ttft
        out["tokens_identical_async_sync"] = out.pop(
            "tokens_identical_to_hisparse-reuse-async")
    return out


def plot(path_json: Path, path_png: Path) -> None:
    """TTFT p50 per turn per mode (left), prompt tokens computed per turn (right)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    record = json.loads(Path(path_json).read_text())
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r, style in zip(record["results"], ("o-", "^:", "s--", "d-."), strict=False):
        if "turns" not in r:
            continue
        turns = [t["turn"] for t in r["turns"]]
        ax.plot(turns, [t["ttft_s_p50"] for t in r["turns"]], style, label=r["mode"])
        ax2.plot(turns, [t["prompt_tokens_computed"] for t in r["turns"]], style,
                 label=r["mode"])
    cfg = record["config"]
    ax.set_yscale("log")
    ax.set_xlabel("turn")
    ax.set_ylabel("time to first token, p50 (s)")
    ax.set_title(f"{cfg['model']}: {cfg['conversations']} conversations, first prompt "
                 f"{cfg['first_prompt']}, +{cfg['user_tokens']} / {cfg['gen_tokens']} per turn",
                 fontsize=9)
    ax2.set_xlabel("turn")
    ax2.set_ylabel("prompt tokens computed")
    for a in (ax, ax2):
        a.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        a.grid(True, which="both", alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="dsv32-2l", choices=sorted(models.CONFIGS))
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--first-prompt", type=int, default=49152, help="tokens of turn 0's prompt")
    p.add_argument("--user-tokens", type=int, default=2048, help="new prompt tokens per turn")
    p.add_argument("--gen-tokens", type=int, default=128, help="generated tokens per turn")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--hot-size", type=int, default=None)
    p.add_argument("--gpu-blocks", type=int, default=None,
                   help="GPU KV budget in blocks per layer, every mode (default: every "
                        "conversation's last turn fits); all-resident seats as many full "
                        "conversations as it holds")
    p.add_argument("--prefill-chunk-size", type=int, default=4096)
    p.add_argument("--max-prefill-tokens-per-step", type=int, default=None)
    p.add_argument("--modes", type=_modes, default=list(DEFAULT_MODES))
    p.add_argument("--prefix-hit-pages", choices=("restore", "stage"), default="restore",
                   help="hisparse-reuse: restore a hit's host pages whole before its prefill, "
                        "or stage the rows its chunks select "
                        "(EngineConfig.prefill.prefix_hit_pages)")
    p.add_argument("--speculative-tokens", type=int, default=0,
                   help="k draft tokens per step in every mode (0: no speculation)")
    p.add_argument("--acceptance-rate", type=float, default=None,
                   help="with --speculative-tokens: the benchmark draft source accepting each "
                        "draft with this probability (default: the model's MTP drafts)")
    p.add_argument("--ttft-from-turn", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--output", default=None, help="default bench/results/multiturn-<backend>.json")
    p.add_argument("--no-plot", action="store_true")
    args = p.parse_args(argv)
    for name in ("conversations", "turns", "first_prompt", "user_tokens", "gen_tokens",
                 "block_size", "prefill_chunk_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    configs = {}
    for mode in args.modes:  # every config checked before any work
        try:
            configs[mode] = engine_config(args, mode)
        except ValueError as e:
            raise SystemExit(f"mode {mode}: {e}") from None
    import jax

    budget, resident_seats = gpu_budget(args)
    cfg = models.get_config(args.config)
    if args.speculative_tokens and args.acceptance_rate is None:
        cfg = dataclasses.replace(cfg, mtp_layers=1)  # MTP drafts need the module
    model = models.init_model(cfg, seed=0)
    out_json = (Path(args.output) if args.output
                else RESULTS_DIR / f"multiturn-{jax.default_backend()}.json")
    config = {"model": cfg.name, "conversations": args.conversations, "turns": args.turns,
              "first_prompt": args.first_prompt, "user_tokens": args.user_tokens,
              "gen_tokens": args.gen_tokens, "block_size": args.block_size,
              "prefill_chunk_size": args.prefill_chunk_size,
              "prefix_hit_pages": args.prefix_hit_pages,
              "speculative_tokens": args.speculative_tokens,
              "acceptance_rate": args.acceptance_rate,
              "max_model_len": max_model_len(args),
              "gpu_blocks": budget, "all_resident_seats": resident_seats,
              "prefill": "real (the model over every computed prompt token, chunked)",
              "sampling": "greedy"}
    results: list[dict[str, Any]] = []
    for mode in args.modes:
        try:
            results.append(run_mode(model, args, mode))
        except Exception as e:  # noqa: BLE001 - recorded; the other modes still run
            results.append({"mode": mode, "failed": f"{type(e).__name__}: {e}"})
            print(f"[multiturn] {mode}: failed: {e}", flush=True)
        write_result("multiturn", {"config": config, "results": results,
                                   "ratios": ratios(results, args.ttft_from_turn)}, out_json)
    print(json.dumps(ratios(results, args.ttft_from_turn), indent=1))
    if not args.no_plot:
        try:
            plot(out_json, out_json.with_suffix(".png"))
        except ImportError:
            print("[multiturn] matplotlib is not installed: no plot")
    return 1 if any("failed" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
