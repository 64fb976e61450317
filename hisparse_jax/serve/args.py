"""The server's command line: its flags, their rules, and the model and engine they build.

`--model` is a synthetic config name (`hisparse_jax.models.CONFIGS`: the weights of
`init_model(config, seed=0)`) or a Hugging Face checkpoint folder (`models.from_pretrained`,
with its tokenizer.json and chat template when it has them). The engine flags are the decode
example's (`examples/decode.py`), with the same meaning and defaults: seats, max_model_len,
block size, the hot region, the device pool (by default a fraction of what the seats'
full-length contexts need, so the host tier works under pressure) and host pool, prefill
bucket and chunks, KV format, speculation, all-resident; asynchronous scheduling is on by
default (`--no-async-scheduling` turns it off; speculation needs it off). Server flags:
--host, --port (0: any free port; the chosen one is printed), --served-model-name,
--max-queue (requests beyond the seats before 503), --grace-period (seconds a SIGTERM
waits for running requests).

`parse_args` checks every flag and the rules between them before any work (argparse's
`error`: one line naming the flag, exit status 2); `engine_config` and `model_spec` build
nothing heavy, so a refused configuration is reported before the weights are read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from hisparse_jax import models
from hisparse_jax.config import MAX_HOT_SIZE, HiSparseConfig
from hisparse_jax.engine import (
    AllResident,
    EngineConfig,
    HiSparse,
    PrefillPolicy,
    Sizes,
    Speculative,
)
from host_tier.sizes import cdiv
from pallas_kernels import kv_format as kvf

DEFAULT_GPU_POOL_FRACTION = 0.4
DTYPES = ("bfloat16", "float32")
MAX_SEED = 2**32 - 1


def _number(kind: type, minimum: float | None = None, maximum: float | None = None,
            *, above: bool = False) -> Any:
    """An argparse type: a `kind` (int or float) within bounds (`above`: > minimum)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        low_ok = minimum is None or (value > minimum if above else value >= minimum)
        if not low_ok or (maximum is not None and value > maximum):
            low = "" if minimum is None else f"{'>' if above else '>='} {minimum:g}"
            high = "" if maximum is None else f"<= {maximum:g}"
            raise argparse.ArgumentTypeError(f"must be {' and '.join(filter(None, (low, high)))}"
                                             f", got {text}")
        return value
    return parse


POSITIVE = _number(int, 1)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The decode example's engine flags (same names, meanings and defaults)."""
    g = p.add_argument_group("engine (as examples/decode.py names them)")
    g.add_argument("--seats", type=POSITIVE, default=4,
                   help="decode batch rows: requests served at once (default: 4)")
    g.add_argument("--max-model-len", type=_number(int, 2), default=128,
                   help="longest request, prompt + generated tokens (default: 128)")
    g.add_argument("--block-size", type=POSITIVE, default=4,
                   help="KV rows per block (page) of the device and host pools (default: 4)")
    g.add_argument("--dtype", default=None, choices=DTYPES,
                   help="a checkpoint's parameter and compute dtype (default: float32 for a "
                        "float32 checkpoint, else bfloat16)")
    g.add_argument("--top-k", type=_number(int, 1, MAX_HOT_SIZE), default=None,
                   help="override a synthetic config's top_k")
    g.add_argument("--index-group-size", type=POSITIVE, default=None, metavar="G",
                   help="override a synthetic config's layers per index group")
    g.add_argument("--hot-size", type=_number(int, 1, MAX_HOT_SIZE), default=None,
                   help="hot-region rows per request, >= (1 + speculative tokens) x top_k "
                        "(default: twice that, rounded up to --block-size)")
    g.add_argument("--gpu-blocks", type=_number(int, 2), default=None,
                   help="device pool blocks per layer (excludes --gpu-pool-fraction)")
    g.add_argument("--gpu-pool-fraction", type=_number(float, 0, 1, above=True), default=None,
                   help=f"device pool = this fraction of the seats' full-length contexts, "
                        f"never below what a lone request needs (default: "
                        f"{DEFAULT_GPU_POOL_FRACTION})")
    g.add_argument("--host-blocks", type=_number(int, 2), default=None,
                   help="host pool blocks (default: one full-length request per seat, plus "
                        "one)")
    g.add_argument("--prefill-bucket", type=POSITIVE, default=64,
                   help="prefill lengths are padded up to a multiple of this (default: 64)")
    g.add_argument("--prefill-chunk-size", type=POSITIVE, default=None, metavar="C",
                   help="prefill prompts in chunks of at most C tokens (default: one shot)")
    g.add_argument("--enable-prefix-caching", action="store_true",
                   help="reuse the pages of earlier requests that share a prompt prefix "
                        "(EngineConfig.prefill.prefix_caching; vLLM's flag name)")
    g.add_argument("--seed", type=_number(int, 0, MAX_SEED), default=0,
                   help="EngineConfig.seed: the sampling seed (a request's 'seed' picks its "
                        "own keys under it; default: 0)")
    g.add_argument("--kv-format", default="bf16", choices=kvf.KV_FORMATS,
                   help="stored KV row format (fp8_ds_mla needs 512 + 64 rows; default: bf16)")
    g.add_argument("--speculative-tokens", type=_number(int, 0), default=0, metavar="K",
                   help="MTP draft tokens verified per request and step (default: 0)")
    g.add_argument("--all-resident", action="store_true",
                   help="no host tier: every KV row on the device (the baseline)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="dispatch step t + 1 while step t runs (default: on)")
    g.add_argument("--no-compile-cache", action="store_true",
                   help="do not use jax's persistent compilation cache")
    g.add_argument("--no-warmup", action="store_true",
                   help="skip Engine.warmup (new shapes then compile while serving)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python3 -m hisparse_jax.serve",
        description="An OpenAI-compatible HTTP server (completions, chat completions, "
                    "streaming, Prometheus metrics) over the HiSparse engine.")
    p.add_argument("--model", required=True, metavar="PATH|CONFIG_NAME",
                   help=f"a Hugging Face checkpoint folder, or a synthetic config name "
                        f"({', '.join(sorted(models.CONFIGS))}: random weights, seed 0)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_number(int, 0, 65535), default=8000,
                   help="port to listen on (0: a free one, printed at start)")
    p.add_argument("--max-queue", type=_number(int, 0), default=64,
                   help="requests the server holds beyond --seats; one more is answered 503 "
                        "with Retry-After (default: 64)")
    p.add_argument("--grace-period", type=_number(float, 0), default=30.0,
                   help="seconds SIGTERM waits for running requests before cancelling them "
                        "(default: 30)")
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default: warning)")
    _add_engine_flags(p)
    return p


def is_checkpoint(model: str) -> bool:
    return os.path.isdir(model)


def parse_args(argv: list[str] | None = None,
               parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    """The checked flags (`parser.error` names the flag of a broken rule: exit 2)."""
    p = parser or build_parser()
    args = p.parse_args(argv)
    if not is_checkpoint(args.model) and args.model not in models.CONFIGS:
        p.error(f"--model {args.model!r} is neither a checkpoint folder nor a synthetic "
                f"config ({', '.join(sorted(models.CONFIGS))})")
    if is_checkpoint(args.model):
        for flag, value in (("--top-k", args.top_k),
                            ("--index-group-size", args.index_group_size)):
            if value is not None:
                p.error(f"{flag} overrides a synthetic config; a checkpoint keeps its "
                        f"config.json's")
    elif args.dtype is not None:
        p.error("--dtype is a checkpoint's; a synthetic config has its own dtype")
    k = args.speculative_tokens
    if args.async_scheduling is None:
        args.async_scheduling = True
    if k >= args.block_size:
        p.error(f"--speculative-tokens {k} must be < --block-size {args.block_size}")
    if args.gpu_blocks is not None and args.gpu_pool_fraction is not None:
        p.error("--gpu-blocks and --gpu-pool-fraction exclude each other")
    if args.all_resident:
        given = [f for f in ("--hot-size", "--gpu-blocks", "--gpu-pool-fraction",
                             "--host-blocks")
                 if getattr(args, f[2:].replace("-", "_")) is not None]
        if given:
            verb = "sizes" if len(given) == 1 else "size"
            p.error(f"{', '.join(given)} {verb} the host tier, which --all-resident does not "
                    f"use")
    try:
        spec = model_spec(args)
        ec = engine_config(args, spec)
        ec.check_model(spec)
        ec.hisparse_config(spec)
    except (ValueError, TypeError, KeyError) as e:
        p.error(f"--model {args.model}: {' '.join(str(e).split())}")
    if k and not spec.has_draft:
        p.error(f"--speculative-tokens {k} drafts with the model's MTP layer; --model "
                f"{args.model} has none")
    return args


def model_config(args: argparse.Namespace) -> models.ModelConfig:
    """A synthetic --model's config, with --top-k / --index-group-size (and an MTP module
    when speculating)."""
    overrides: dict[str, Any] = {}
    if args.top_k is not None:
        overrides["top_k"] = args.top_k
    if args.index_group_size is not None:
        overrides["index_group_size"] = args.index_group_size
    if args.speculative_tokens:
        overrides["mtp_layers"] = 1
    return models.get_config(args.model, **overrides)


def model_spec(args: argparse.Namespace) -> models.ModelSpec:
    """The served model's `ModelSpec` without its weights (a checkpoint's config.json)."""
    if not is_checkpoint(args.model):
        return models.model_spec(model_config(args))
    from hisparse_jax.models.checkpoint import CONFIG_FILE, open_checkpoint
    from hisparse_jax.models.dsa import dsa_spec
    from hisparse_jax.models.dsa_config import DSAConfig

    open_checkpoint(args.model).close()  # ValueError naming what the folder lacks
    with open(os.path.join(args.model, CONFIG_FILE), encoding="utf-8") as f:
        return dsa_spec(DSAConfig.from_hf(json.load(f), dtype=args.dtype))


def engine_config(args: argparse.Namespace, spec: models.ModelSpec) -> EngineConfig:
    """The `EngineConfig` of the flags (the decode example's sizing rules)."""
    B, L, S = args.block_size, args.max_model_len, args.seats
    pages = cdiv(L, B)
    k = args.speculative_tokens
    hot_size = (args.hot_size if args.hot_size is not None
                else HiSparseConfig.default_hot_size(spec.top_k, B, k))
    if args.gpu_blocks is not None:
        gpu_blocks = args.gpu_blocks
    else:  # a fraction of the seats' contexts, never below what a lone request needs
        fraction = args.gpu_pool_fraction or DEFAULT_GPU_POOL_FRACTION
        gpu_blocks = max(int(fraction * S * pages), pages + cdiv(hot_size, B) + 3) + 1
    host_blocks = args.host_blocks if args.host_blocks is not None else 1 + (S + 1) * pages
    return EngineConfig(
        sizes=Sizes(max_seats=S, max_model_len=L, block_size=B, hot_size=hot_size,
                    num_gpu_blocks=gpu_blocks, num_host_blocks=host_blocks),
        residency=AllResident() if args.all_resident else HiSparse(), seed=args.seed,
        kv_format=args.kv_format,
        prefill=PrefillPolicy(bucket=args.prefill_bucket, chunk_size=args.prefill_chunk_size,
                              prefix_caching=args.enable_prefix_caching),
        speculative=Speculative(num_tokens=k) if k else None,
        async_scheduling=args.async_scheduling,
        compilation_cache=not args.no_compile_cache)


def load_model(args: argparse.Namespace) -> models.ServedModel:
    """The served model: a checkpoint's weights, or a synthetic config's (seed 0)."""
    if is_checkpoint(args.model):
        return models.from_pretrained(args.model, dtype=args.dtype)
    return models.init_model(model_config(args), seed=0)
