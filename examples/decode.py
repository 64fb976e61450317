"""Continuous-batching decode with the HiSparse host tier, on a random model or a checkpoint.

By default: the `tiny` config on the CPU, 6 requests on 4 seats, and a device KV pool that
holds only part of the contexts, so the host tier spills pages, unpins them, loses some to
other requests and serves the lost rows through each request's hot region. Prints a
progress bar over the decode steps and a summary (tokens/s, hot-buffer hit rate, rows and
bytes moved host -> device, memory in use). `--all-resident` runs the baseline with every
KV row on the device; `--check` runs both and compares the generated tokens (greedy, or
sampled under one `--seed` with `--temperature` > 0: sampling depends only on the seed, the
request's order and the token's index, so both modes draw the same tokens).

`--model PATH` serves a Hugging Face checkpoint folder (DeepSeek-V3.2 or GLM-5: config.json and
safetensors weights) instead of a random `--config` model; `--prompt TEXT` (encoded with the
folder's tokenizer.json; prints each request's decoded output) or `--prompt-ids 1,2,3` (prints
the generated ids), each repeatable, give the requests' prompts instead of random tokens.

Every argument is checked before any work: a bad value or combination, or a configuration
the engine refuses, prints one line naming the flag and the rule and exits with status 2.

    python3 examples/decode.py                       # tiny, CPU, under pressure
    python3 examples/decode.py --all-resident        # the baseline
    python3 examples/decode.py --config tiny576 --kv-format fp8_ds_mla --check   # fp8 rows
    python3 examples/decode.py --speculative-tokens 2 --check   # MTP drafts, 3 rows per step
    python3 examples/decode.py --async-scheduling --check   # step t + 1 dispatched during t
    python3 examples/decode.py --model PATH --prompt "The capital of France is" \\
        --max-model-len 4096 --block-size 64 --all-resident   # a checkpoint (GPU)
    python3 examples/decode.py --config dsv32-2l --requests 4 --prompt-len 3072 \\
        --gen-len 32 --block-size 64 --max-model-len 4096 --gpu-pool-fraction 0.5   # GPU
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

import jax
import numpy as np

from hisparse_jax import models
from hisparse_jax.config import HiSparseConfig
from hisparse_jax.draft_sources import AcceptanceRateDraft
from hisparse_jax.engine import (
    AllResident,
    Engine,
    EngineConfig,
    HiSparse,
    PrefillPolicy,
    Sizes,
    Speculative,
)
from hisparse_jax.engine.engine import host_tier_coordinator
from hisparse_jax.models.checkpoint import CONFIG_FILE, open_checkpoint
from hisparse_jax.models.tokenizer import Tokenizer, load_tokenizer
from host_tier import CapacityError
from host_tier.sizes import cdiv
from host_tier.worker.host_pool import available_ram_bytes, check_available_ram
from pallas_kernels import kv_format as kvf

MAX_SEED = 2**32 - 1          # jax.random.PRNGKey keeps the low 32 bits: larger seeds collide
DEFAULT_GPU_POOL_FRACTION = 0.4
MAX_HOT_SIZE = 32768          # hot slot ids are int16 (docs/semantics.md)
# EngineConfig fields -> the flags that set them (to name the flag in an engine's refusal).
FIELD_FLAGS = {"num_host_blocks": "--host-blocks", "num_gpu_blocks": "--gpu-blocks",
               "host pool": "--host-blocks", "device pool": "--gpu-blocks / --gpu-pool-fraction",
               "hot_size": "--hot-size", "block_size": "--block-size",
               "max_model_len": "--max-model-len", "max_seats": "--seats",
               "prefill.bucket": "--prefill-bucket", "top_k": "--top-k", "seed": "--seed",
               "temperature": "--temperature", "max_new_tokens": "--gen-len",
               "kv_format": "--kv-format", "speculative.num_tokens": "--speculative-tokens",
               "acceptance_rate": "--acceptance-rate",
               "prefill.chunk_size": "--prefill-chunk-size"}
DTYPES = ("bfloat16", "float32")   # --dtype: a checkpoint's parameter and compute dtype


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


# ------------------------------------------------------------------ argument types


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None


def _int_at_least_0(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _int(text, "an int >= 0")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an int >= 0, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _int(text, "a positive integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (>= 1), got {value}")
    return value


def seed_int(text: str) -> int:
    """argparse type: an integer in [0, 2^32 - 1]."""
    value = _int(text, f"an integer in [0, {MAX_SEED}]")
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_SEED}], got {value}")
    return value


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def non_negative_float(text: str) -> float:
    """argparse type: a finite number >= 0."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def probability(text: str) -> float:
    """argparse type: a number in [0, 1]."""
    value = _float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {value:g}")
    return value


def pool_fraction(text: str) -> float:
    """argparse type: a fraction in (0, 1]."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {value:g}")
    return value


def token_ids(text: str) -> list[int]:
    """argparse type: comma-separated token ids (ints >= 0), at least one."""
    parts = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() and t.isascii() for t in parts):
        raise argparse.ArgumentTypeError(f"must be comma-separated token ids (ints >= 0), e.g. "
                                         f"1,2,3; got {text!r}")
    return [int(t) for t in parts]


class StoreGiven(argparse.Action):
    """Stores the value like "store" and adds the flag's name to `args.given`: the flags a
    user set, told apart from their defaults (the rules between --model / --prompt and
    --config / --requests / --prompt-len read it)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = tuple(sorted({*namespace.given, self.dest}))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to a flag's help once: not where the help text already says
    its default, nor for a default of None or False (an option that is off, or whose help
    says what it falls back to)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model, --dtype, --prompt, --prompt-ids: a checkpoint and given prompts (and
    `args.given`, the flags StoreGiven saw set)."""
    p.set_defaults(given=())
    p.add_argument("--model", default=None, metavar="PATH",
                   help="serve this Hugging Face checkpoint folder (config.json, safetensors "
                        "weights; DeepSeek-V3.2 or GLM-5) instead of a random --config model")
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="with --model: parameter and compute dtype (default: float32 for a "
                        "float32 checkpoint, else bfloat16)")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="with --model: a request's prompt, encoded by the folder's "
                        "tokenizer.json; repeat for more requests (their number and longest "
                        "prompt replace --requests and --prompt-len); prints each request's "
                        "decoded output, which stops at the tokenizer's end-of-sequence ids")
    p.add_argument("--prompt-ids", action="append", default=None, type=token_ids,
                   metavar="IDS",
                   help="a request's prompt as comma-separated token ids, e.g. 1,2,3; repeat "
                        "for more requests (as --prompt); prints each request's generated ids")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="decode.py", usage="%(prog)s [options]",
                                description=__doc__.splitlines()[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--config", default="tiny", choices=sorted(models.CONFIGS), action=StoreGiven,
                   help="random model config (hisparse_jax.models.CONFIGS): tiny and tiny576 run "
                        "on the CPU; dsv32-2l has DeepSeek-V3.2's attention dimensions (2 layers)")
    add_model_flags(p)
    p.add_argument("--requests", type=positive_int, default=6, action=StoreGiven,
                   help="requests to decode (random prompts drawn from --seed)")
    p.add_argument("--seats", type=positive_int, default=4,
                   help="decode batch rows (max_num_reqs); at most --requests are used")
    p.add_argument("--prompt-len", type=positive_int, default=64, action=StoreGiven,
                   help="longest prompt (random tokens, 3/4 of it to all of it)")
    p.add_argument("--gen-len", type=positive_int, default=48, help="new tokens per request")
    p.add_argument("--max-model-len", type=positive_int, default=128,
                   help="longest request: --prompt-len + --gen-len must fit")
    p.add_argument("--block-size", type=positive_int, default=4,
                   help="KV rows per block (page) of the device and host pools")
    p.add_argument("--top-k", type=positive_int, default=None,
                   help="override the config's top_k (default: the config's)")
    p.add_argument("--index-group-size", type=positive_int, default=None, metavar="G",
                   help="override the config's layers per index group (G layers share one "
                        "indexer's top-k; the host pool keeps them side by side; default: the "
                        "config's)")
    p.add_argument("--hot-size", type=positive_int, default=None,
                   help="hot-region rows per request, >= top_k (default: 2 * top_k rounded up "
                        "to --block-size)")
    p.add_argument("--gpu-blocks", type=positive_int, default=None,
                   help="device pool blocks per layer (excludes --gpu-pool-fraction)")
    p.add_argument("--gpu-pool-fraction", type=pool_fraction, default=None,
                   help=f"without --gpu-blocks: device pool = this fraction in (0, 1] of the "
                        f"contexts, never below what a lone request needs (default: "
                        f"{DEFAULT_GPU_POOL_FRACTION})")
    p.add_argument("--host-blocks", type=positive_int, default=None,
                   help="host pool blocks (default: one full-length request per seat, plus one)")
    p.add_argument("--prefill-bucket", type=positive_int, default=64,
                   help="prefill lengths are padded up to a multiple of this many tokens (one "
                        "compiled prefill per bucket)")
    p.add_argument("--prefill-chunk-size", type=positive_int, default=None, metavar="C",
                   help="prefill prompts in chunks of at most C tokens, sharing steps with "
                        "decode (default: one shot); --check compares with all-resident "
                        "decoding that prefills in one shot")
    p.add_argument("--check-chunked", action="store_true",
                   help="with --prefill-chunk-size: --check's all-resident reference prefills "
                        "in the same chunks (on a GPU, chunked and one-shot prefill round "
                        "their bf16 GEMMs differently; this checks the residency alone)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=seed_int, default=0,
                   help="model, prompts and sampling seed, in [0, 2^32 - 1]")
    p.add_argument("--kv-format", default="bf16", choices=kvf.KV_FORMATS,
                   help="stored KV row: bf16 values, or fp8_ds_mla (656-byte rows: fp8 latent "
                        "with per-128 scales, bf16 rope; needs 512 + 64 rows: --config "
                        "tiny576 or dsv32-2l; docs/kv_format.md)")
    p.add_argument("--speculative-tokens", type=_int_at_least_0, default=0, metavar="K",
                   help="draft tokens verified per request and step (0: no speculation); the "
                        "drafts come from the model's MTP module (built with it); --check "
                        "compares with all-resident decoding with the same speculation")
    p.add_argument("--acceptance-rate", type=probability, default=None, metavar="R",
                   help="with --speculative-tokens: accept each draft with probability R "
                        "instead (a benchmark device: the tokens are then not the model's)")
    p.add_argument("--all-resident", action="store_true", help="no host tier (baseline)")
    p.add_argument("--async-scheduling", action="store_true",
                   help="EngineConfig.async_scheduling: the host plans and dispatches step t + 1 "
                        "while step t runs (--check's all-resident reference stays "
                        "synchronous); excludes --speculative-tokens")
    p.add_argument("--check", action="store_true",
                   help="also run all-resident and require identical tokens (greedy, or "
                        "sampled under --seed with --temperature > 0)")
    p.add_argument("--no-compile-cache", action="store_true",
                   help="do not use jax's persistent compilation cache (default: on, under "
                        "~/.cache/hisparse_jax/jax; HISPARSE_JAX_COMPILATION_CACHE=0 also "
                        "turns it off, or names another directory)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the flags, each mode's summary and --check's verdict to "
                        "PATH as JSON")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip Engine.warmup (the first steps of each new shape then compile "
                        "while serving; their time is reported as compile time)")
    return p


HOST_TIER_FLAGS = ("hot_size", "gpu_blocks", "gpu_pool_fraction", "host_blocks")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The rules between flags, before any work; `p.error` (exit 2) names the flags."""
    check_model_flags(p, args)        # first: given prompts set --requests and --prompt-len
    total = args.prompt_len + args.gen_len
    if total > args.max_model_len:
        p.error(f"--prompt-len {args.prompt_len} + --gen-len {args.gen_len} = {total} exceeds "
                f"--max-model-len {args.max_model_len}: a request's prompt and new tokens must "
                f"fit in max_model_len")
    if args.gpu_blocks is not None and args.gpu_pool_fraction is not None:
        p.error("--gpu-blocks and --gpu-pool-fraction exclude each other (the fraction sizes "
                "the device pool only without --gpu-blocks)")
    if args.all_resident:
        if args.check:
            p.error("--check compares HiSparse with all-resident: it excludes --all-resident")
        given = [f"--{f.replace('_', '-')}" for f in HOST_TIER_FLAGS
                 if getattr(args, f) is not None]
        if given:
            p.error(f"{', '.join(given)} {'sizes' if len(given) == 1 else 'size'} the host "
                    f"tier, which --all-resident does not use")
    k = args.speculative_tokens
    if k >= args.block_size:
        p.error(f"--speculative-tokens {k} must be < --block-size {args.block_size} (a step's "
                f"draft rows open at most one page)")
    if args.acceptance_rate is not None:
        if not k:
            p.error("--acceptance-rate needs --speculative-tokens >= 1")
        if args.check:
            p.error("--acceptance-rate emits tokens the model did not choose: it excludes "
                    "--check")
    if args.check_chunked and (args.prefill_chunk_size is None or not args.check):
        p.error("--check-chunked needs --check and --prefill-chunk-size")
    check_model_rules(p, args, model_facts(p, args))
    if args.hot_size is not None and args.hot_size > MAX_HOT_SIZE:
        p.error(f"--hot-size {args.hot_size} must be <= {MAX_HOT_SIZE} (hot slot ids are "
                f"int16)")
    if args.top_k is not None and args.top_k > MAX_HOT_SIZE:
        p.error(f"--top-k {args.top_k} must be <= {MAX_HOT_SIZE}: the hot region (>= top_k "
                f"rows) holds at most {MAX_HOT_SIZE} slots")
    if args.json is not None:
        reason = unwritable(args.json)
        if reason:
            p.error(f"--json {args.json}: {reason} (the record is written when the run ends, "
                    f"so the path must be a writable file in an existing folder)")


def check_model_rules(p: argparse.ArgumentParser, args: argparse.Namespace,
                      model: models.ModelConfig | models.ModelSpec) -> None:
    """The rules between the flags and the served model's facts (`model_facts`)."""
    k = args.speculative_tokens
    source = f"--config {args.config}" if args.model is None else f"--model {args.model}"
    if args.kv_format == kvf.FP8_DS_MLA and (model.kv_lora_rank, model.rope_dim) != (
            kvf.LATENT_DIM, kvf.ROPE_DIM):
        fits = sorted(n for n, c in models.CONFIGS.items()
                      if (c.kv_lora_rank, c.rope_dim) == (kvf.LATENT_DIM, kvf.ROPE_DIM))
        p.error(f"--kv-format {args.kv_format} stores rows of {kvf.LATENT_DIM} latent + "
                f"{kvf.ROPE_DIM} rope values; {source} has "
                f"{model.kv_lora_rank} + {model.rope_dim}"
                + (f" (use --config {' or '.join(fits)})" if args.model is None else ""))
    if args.index_group_size is not None and model.num_layers % args.index_group_size:
        p.error(f"--index-group-size {args.index_group_size} must divide the {args.config} "
                f"config's {model.num_layers} layers (index groups hold whole layers)")
    top_k = args.top_k if args.top_k is not None else model.top_k
    if args.hot_size is not None and args.hot_size < (1 + k) * top_k:
        owner = (f"the {args.config} config's" if args.model is None
                 else "--model's index_topk")
        p.error(f"--hot-size {args.hot_size} must be >= (1 + --speculative-tokens {k}) x "
                f"top_k {top_k} (--top-k, or {owner}): the hot region "
                f"takes a whole step's misses")
    if args.model is not None and k and args.acceptance_rate is None and not model.has_draft:
        p.error(f"--speculative-tokens {k} drafts with the model's MTP layer; --model "
                f"{args.model} has none (config.json num_nextn_predict_layers is 0; "
                f"--acceptance-rate R drafts without one)")


def check_model_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--model, --dtype, --prompt and --prompt-ids: their rules, the checkpoint folder opened
    (config.json, every safetensors header; no weight read) and the prompts encoded. Given
    prompts set args.requests and args.prompt_len to their number and the longest one."""
    if args.model is None:
        for flag, value in (("--dtype", args.dtype), ("--prompt", args.prompt)):
            if value is not None:
                p.error(f"{flag} needs --model (a checkpoint folder"
                        + ("; its tokenizer.json encodes the text)" if flag == "--prompt"
                           else ")"))
    else:
        if "config" in args.given:
            p.error("--model and --config exclude each other (--model serves the "
                    "checkpoint's own config; --config picks a random model)")
        for flag, value in (("--top-k", args.top_k),
                            ("--index-group-size", args.index_group_size)):
            if value is not None:
                p.error(f"{flag} overrides a random --config model's setting; --model "
                        f"{args.model} keeps its config.json's (index_topk, indexer types)")
        try:
            open_checkpoint(args.model).close()
        except ValueError as e:
            p.error(f"--model: {one_line(e)}")
    if args.prompt is not None and args.prompt_ids is not None:
        p.error("--prompt and --prompt-ids exclude each other (one kind of prompt per run)")
    if args.prompt is None and args.prompt_ids is None:
        return
    for dest in ("requests", "prompt_len"):
        if dest in args.given:
            p.error(f"--{dest.replace('_', '-')} sizes random prompts; with --prompt / "
                    f"--prompt-ids the requests are the prompts given (one per flag)")
    prompts = request_prompts(p, args)
    args.requests, args.prompt_len = len(prompts), max(map(len, prompts))


@functools.cache
def _tokenizer(folder: str) -> Tokenizer | None:
    return load_tokenizer(folder)


def model_tokenizer(p: argparse.ArgumentParser, args: argparse.Namespace) -> Tokenizer:
    """--model's tokenizer, which --prompt needs (`p.error` naming --prompt without one)."""
    try:
        tokenizer = _tokenizer(args.model)
    except (ImportError, ValueError) as e:
        p.error(f"--prompt: {one_line(e)}")
    if tokenizer is None:
        p.error(f"--prompt needs a tokenizer: --model {args.model} has no tokenizer.json (give "
                f"token ids with --prompt-ids instead)")
    return tokenizer


def request_prompts(p: argparse.ArgumentParser, args: argparse.Namespace
                    ) -> list[list[int]] | None:
    """The token ids of the --prompt / --prompt-ids prompts (None: random prompts), each
    checked: at least one token, ids below the model's vocab size, and the prompt plus
    --gen-len new tokens within --max-model-len."""
    if args.prompt is not None:
        flag, given = "--prompt", args.prompt
        tokenizer = model_tokenizer(p, args)
        prompts = [tokenizer.encode(text) for text in given]
    elif args.prompt_ids is not None:
        flag, given = "--prompt-ids", [",".join(map(str, ids)) for ids in args.prompt_ids]
        prompts = args.prompt_ids
    else:
        return None
    vocab = model_facts(p, args).vocab_size
    for text, ids in zip(given, prompts, strict=True):
        shown = repr(text if len(text) <= 40 else text[:37] + "...")
        if not ids:
            p.error(f"{flag} {shown} encodes to no tokens")
        if max(ids) >= vocab:
            p.error(f"{flag} {shown}: token id {max(ids)} is not below the model's vocab size "
                    f"{vocab}")
        if len(ids) + args.gen_len > args.max_model_len:
            p.error(f"{flag} {shown}: {len(ids)} tokens + --gen-len {args.gen_len} = "
                    f"{len(ids) + args.gen_len} exceeds --max-model-len {args.max_model_len}")
    return prompts


def checkpoint_spec(args: argparse.Namespace) -> models.ModelSpec:
    """The `ModelSpec` of the checkpoint at --model from its config.json alone (`DSAConfig`,
    the served model's `dsa_spec`): what the checks and the engine's sizes need before any
    weight is read."""
    from hisparse_jax.models.dsa import dsa_spec
    from hisparse_jax.models.dsa_config import DSAConfig

    with open(os.path.join(args.model, CONFIG_FILE), encoding="utf-8") as f:
        return dsa_spec(DSAConfig.from_hf(json.load(f), dtype=args.dtype))


def model_facts(p: argparse.ArgumentParser, args: argparse.Namespace
                ) -> models.ModelConfig | models.ModelSpec:
    """The served model's static facts for the flags' rules: the --config entry, or --model's
    `checkpoint_spec` (`p.error` naming --model when its config.json is refused)."""
    if args.model is None:
        return models.CONFIGS[args.config]
    try:
        return checkpoint_spec(args)
    except (ValueError, TypeError, KeyError, ImportError) as e:
        p.error(f"--model {args.model}: {one_line(e)}")


def unwritable(path: str) -> str | None:
    """Why a file cannot be written at `path` (None: it can). Probes by opening it: an
    existing file for appending (its contents stay), a new one by creating and removing it."""
    if os.path.isdir(path):
        return "is a folder, not a file"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"folder {folder} does not exist"
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        return f"cannot be written ({e.strerror or type(e).__name__})"
    if not existed:
        os.remove(path)
    return None


def device_memory() -> tuple[int, str]:
    """(bytes, where): the first device's memory limit where the backend reports one (GPU),
    else the available RAM (the CPU backend keeps device arrays in RAM)."""
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return int(stats["bytes_limit"]), f"the {device.device_kind} holds"
    return available_ram_bytes(), "of RAM available (the CPU device's memory)"


def check_pools(args: argparse.Namespace, cfg: models.ModelConfig | models.ModelSpec,
                ec: EngineConfig) -> None:
    """The engine's rules on the pool sizes of `ec`, before any model or engine is built
    (ValueError naming the setting, as the engine would raise): the device KV caches fit the
    device's memory; the host pool fits 95% of the available RAM; the host tier accepts the
    pool sizes; and a lone request of --prompt-len + --gen-len tokens (the longest this run
    draws) can be served."""
    hs = ec.hisparse_config(cfg)
    block_bytes = hs.block_size * hs.row_bytes * cfg.num_layers      # one block, every layer
    need, (limit, where) = hs.num_gpu_blocks * block_bytes, device_memory()
    if need > limit:
        sizes = ("--seats x --max-model-len" if isinstance(ec.residency, AllResident)
                 else "EngineConfig.sizes.num_gpu_blocks: the device pool")
        raise ValueError(f"the device KV caches of {hs.num_gpu_blocks} blocks ({sizes}) x "
                         f"{cfg.num_layers} layers x {hs.block_size} rows of {hs.row_bytes} B "
                         f"need {need / 2**30:.2f} GiB, more than the {limit / 2**30:.2f} GiB "
                         f"{where}")
    if isinstance(ec.residency, AllResident):
        return                            # every request fits its seat (max_model_len)
    try:
        check_available_ram(hs.num_host_blocks * block_bytes, what="num_host_blocks")
    except ValueError as e:
        raise ValueError(f"the host pool of EngineConfig.sizes.num_host_blocks="
                         f"{hs.num_host_blocks}: {e}") from None
    try:
        tier = host_tier_coordinator(ec, hs)
    except ValueError as e:
        raise ValueError(f"EngineConfig.sizes.num_gpu_blocks={hs.num_gpu_blocks} / "
                         f"num_host_blocks={hs.num_host_blocks} refused by the host tier: {e}"
                         ) from None
    total = args.prompt_len + args.gen_len
    reason = tier.capacity_error(args.prompt_len, total - 1,
                                 num_lookahead_tokens=ec.num_speculative_tokens)
    if reason is not None:
        raise ValueError(f"a request of --prompt-len {args.prompt_len} + --gen-len "
                         f"{args.gen_len} tokens can never be served: {reason}")


# ------------------------------------------------------------------ engine


def model_config(args: argparse.Namespace) -> models.ModelConfig | models.ModelSpec:
    """The model's config; with speculation (MTP drafts) it also has an MTP module (the main
    model's parameters do not change with it). With --model: the checkpoint's `ModelSpec`."""
    if args.model is not None:
        return checkpoint_spec(args)
    overrides = {} if args.top_k is None else {"top_k": args.top_k}
    if args.index_group_size is not None:
        overrides["index_group_size"] = args.index_group_size
    if args.speculative_tokens and args.acceptance_rate is None:
        overrides["mtp_layers"] = 1
    return models.get_config(args.config, **overrides)


def engine_config(args: argparse.Namespace, cfg: models.ModelConfig | models.ModelSpec, *,
                  all_resident: bool, reference: bool = False) -> EngineConfig:
    """The EngineConfig of one mode (sizes derived from the flags; builds nothing);
    `reference`: the --check engine, which prefills in one shot (and schedules
    synchronously)."""
    B = args.block_size
    pages = cdiv(args.max_model_len, B)
    k = args.speculative_tokens
    hot_size = (args.hot_size if args.hot_size is not None
                else HiSparseConfig.default_hot_size(cfg.top_k, B, k))
    hot_blocks = cdiv(hot_size, B)
    seats = min(args.seats, args.requests)
    if args.gpu_blocks is not None:
        gpu_blocks = args.gpu_blocks
    else:  # a fraction of what the contexts need, never below what one request needs
        fraction = args.gpu_pool_fraction or DEFAULT_GPU_POOL_FRACTION
        ctx_pages = cdiv(args.prompt_len + args.gen_len, B)
        # (a lone request must fit its pages and its hot region, or it stalls forever)
        gpu_blocks = max(int(fraction * seats * ctx_pages), ctx_pages + hot_blocks + 3) + 1
    host_blocks = (args.host_blocks if args.host_blocks is not None
                   else 1 + (seats + 1) * pages)
    draft = None if args.acceptance_rate is None else AcceptanceRateDraft(args.acceptance_rate)
    return EngineConfig(
        sizes=Sizes(max_seats=seats, max_model_len=args.max_model_len, block_size=B,
                    hot_size=hot_size, num_gpu_blocks=gpu_blocks, num_host_blocks=host_blocks),
        residency=AllResident() if all_resident else HiSparse(), seed=args.seed,
        kv_format=args.kv_format,
        prefill=PrefillPolicy(bucket=args.prefill_bucket,
                              chunk_size=(None if reference and not args.check_chunked
                                          else args.prefill_chunk_size)),
        speculative=Speculative(num_tokens=k, draft=draft) if k else None,
        async_scheduling=args.async_scheduling and not reference, **compile_cache_kwargs(args))


def compile_cache_kwargs(args: argparse.Namespace) -> dict:
    """{"compilation_cache": False} with --no-compile-cache, else {} (the engine's default:
    on)."""
    return {"compilation_cache": False} if args.no_compile_cache else {}


def one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def refusal(error: BaseException, what: str) -> str:
    """The one-line report of a configuration error, naming the flags behind the settings
    its message names."""
    text = one_line(error)
    flags = sorted({flag for key, named in FIELD_FLAGS.items() if key in text
                    for flag in named.split(" / ")})
    return f"{what}: {text}" + (f" (set by {', '.join(flags)})" if flags else "")


def build_engine(args: argparse.Namespace, model, ec: EngineConfig,
                 prompts: list[list[int]] | None = None,
                 stop_token_ids: tuple[int, ...] = ()) -> Engine:
    """The engine of `ec` with the run's requests queued: `prompts`, or --requests random ones
    drawn from --seed (raises ValueError / CapacityError for a configuration or request it
    refuses)."""
    engine = Engine(model, ec)
    cfg = engine.model_config
    try:
        rng = np.random.default_rng(args.seed)
        for i in range(args.requests):
            if prompts is None:
                length = int(rng.integers(max(1, args.prompt_len * 3 // 4),
                                          args.prompt_len + 1))
                prompt = rng.integers(0, cfg.vocab_size, length).tolist()
            else:
                prompt = prompts[i]
            engine.add_request(prompt, max_new_tokens=args.gen_len,
                               temperature=args.temperature, stop_token_ids=stop_token_ids)
    except BaseException:
        engine.close()
        raise
    return engine


def run(args: argparse.Namespace, engine: Engine) -> Engine:
    """Decodes every queued request of `engine` with a progress bar; returns the engine."""
    ec, cfg = engine.config, engine.model_config
    mode = engine.mode
    print(f"[{mode}] {cfg.name} on {jax.default_backend()} ({jax.devices()[0].device_kind}): "
          f"{args.requests} requests on {ec.sizes.max_seats} seats, prompts <= "
          f"{args.prompt_len}, {args.gen_len} new tokens, top_k {cfg.top_k}, block "
          f"{ec.sizes.block_size}, hot {ec.sizes.hot_size}, device pool "
          f"{engine.num_gpu_blocks} blocks"
          + ("" if isinstance(ec.residency, AllResident)
             else f", host pool {ec.sizes.num_host_blocks} blocks")
          + f", KV rows {ec.kv_format} ({engine.row_bytes} B)", flush=True)
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


def compare_tokens(hisparse: dict, resident: dict, *, temperature: float, seed: int
                   ) -> tuple[str, bool]:
    """The --check line and verdict: the finished requests (id -> Request) of both modes
    have the same ids and, for each, the same generated tokens and finish reason."""
    same = hisparse.keys() == resident.keys() and all(
        hisparse[k].generated == resident[k].generated
        and hisparse[k].finish_reason == resident[k].finish_reason for k in hisparse)
    what = ("greedy tokens" if temperature == 0
            else f"sampled tokens under seed {seed} (temperature {temperature:g})")
    return f"{what} identical to all-resident: {same}", same


def print_summary(engines: list[Engine]) -> None:
    rows = [
        ("requests finished", lambda s: f"{s['requests_finished']}"),
        ("prompt / generated tokens", lambda s: f"{s['prompt_tokens']} / "
                                                f"{s['generated_tokens']}"),
        ("decode steps (fast path)", lambda s: f"{s['decode_steps']} ({s['fast_path_steps']})"),
        ("decode tokens/s (steady state)", lambda s: f"{s['decode_tokens_per_s']:.1f}"),
        ("decode step time (no compiles)", lambda s: f"{s['decode_step_ms']:.1f} ms"),
        ("warm-up (compiles ahead)", lambda s: f"{s['warmup_seconds']:.1f} s"),
        ("compile time while serving", lambda s: f"{s['compile_seconds']:.1f} s"),
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
        ("drafts accepted (tokens/step)", lambda s: "-" if not s["draft_tokens"]
         else f"{s['accepted_tokens']} of {s['draft_tokens']} "
              f"({s['tokens_per_request_step']:.2f})"),
        ("device pool blocks", lambda s: f"{s['gpu_blocks']}"),
        ("device memory: params + caches", lambda s: _fmt_bytes(s["device_bytes"])),
        ("device memory: allocator in use", lambda s: "-" if s["device_allocator_bytes"] is None
         else _fmt_bytes(s["device_allocator_bytes"])),
        ("host memory: pinned KV pool", lambda s: _fmt_bytes(s["host_bytes"])),
        ("KV row format (bytes per row)", lambda s: f"{s['kv_format']} ({s['row_bytes']} B)"),
        ("host pool per full request", lambda s: _fmt_bytes(s["host_bytes_per_request"])),
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


def print_outputs(engine: Engine, given: bool, tokenizer: Tokenizer | None) -> None:
    """Random prompts: the first request's last prompt tokens and first generated ones. Given
    prompts: every request's output in request order, decoded (--prompt) or as ids."""
    if not given:
        first = next(iter(engine.finished.values()))
        print(f"request {first.request_id}: prompt[-8:] {list(first.prompt[-8:])} -> generated "
              f"{first.generated[:16]}{' ...' if len(first.generated) > 16 else ''}")
        return
    for rid, r in sorted(engine.finished.items()):
        if tokenizer is None:
            print(f"request {rid} ({r.finish_reason}): {list(r.generated)}")
        else:
            print(f"--- request {rid} ({r.finish_reason}, {len(r.generated)} tokens)")
            print(tokenizer.decode(r.generated, skip_special_tokens=True))


def load_model(args: argparse.Namespace, cfg: models.ModelConfig | models.ModelSpec):
    """The served model: --model's checkpoint (`models.from_pretrained`, weights read now),
    else a random model of `cfg` drawn from --seed."""
    if args.model is None:
        return models.init_model(cfg, seed=args.seed)
    from hisparse_jax.models import from_pretrained

    return from_pretrained(args.model, dtype=args.dtype)


def write_json(args: argparse.Namespace, engines: list[Engine], same: bool | None) -> None:
    """--json: the flags, each mode's summary (`Engine.summary`), its generated tokens per
    request (to compare runs of other processes, e.g. under other XLA flags) and --check's
    verdict."""
    record = {"args": vars(args), "backend": jax.default_backend(),
              "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "xla_flags": os.environ.get("XLA_FLAGS", ""),
              "summaries": [e.summary() for e in engines],
              "tokens": [{str(rid): list(r.generated) for rid, r in e.finished.items()}
                         for e in engines],
              "tokens_identical": same}
    with open(args.json, "w") as f:
        json.dump(record, f, indent=2, default=str)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    check_args(p, args)
    modes = [args.all_resident] + ([True] if args.check else [])
    try:                                  # every config the run needs, before any work
        cfg = model_config(args)
        configs = [engine_config(args, cfg, all_resident=mode, reference=i > 0)
                   for i, mode in enumerate(modes)]
        for ec in configs:
            ec.hisparse_config(cfg)       # the sizes' rules (HiSparseConfig), builds nothing
    except (ValueError, TypeError) as e:
        p.error(refusal(e, "invalid configuration"))
    for ec in configs:                    # the engine's pool rules, still before any work
        try:
            check_pools(args, cfg, ec)
        except ValueError as e:
            p.error(refusal(e, "the engine refused this configuration"))

    prompts = request_prompts(p, args)
    tokenizer = model_tokenizer(p, args) if args.prompt is not None else None
    model = load_model(args, cfg)
    engines: list[Engine] = []
    try:
        for ec in configs:
            try:
                engine = build_engine(args, model, ec, prompts,
                                      tokenizer.eos_token_ids if tokenizer else ())
            except (ValueError, CapacityError) as e:
                p.error(refusal(e, "the engine refused this configuration"))
            engines.append(engine)
            if not args.no_warmup:
                seconds = engine.warmup()
                print(f"[{engine.mode}] warm-up: every shape bucket compiled in {seconds:.1f} s"
                      + (f" (compilation cache {engine.compilation_cache_dir})"
                         if engine.compilation_cache_dir else " (no compilation cache)"),
                      flush=True)
            run(args, engine)
        print_summary(engines)
        print_outputs(engines[0], prompts is not None, tokenizer)
        same = None
        if len(engines) == 2:
            line, same = compare_tokens(engines[0].finished, engines[1].finished,
                                        temperature=args.temperature, seed=args.seed)
            print(line)
        if args.json is not None:
            write_json(args, engines, same)
        return 1 if same is False else 0
    finally:
        for e in engines:
            e.close()


if __name__ == "__main__":
    sys.exit(main())
