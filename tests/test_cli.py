"""examples/decode.py's command line: every bad argument is refused at parsing, before any
work, with exit status 2 and one line naming the flag and the rule; no silent fallbacks.

`main([...])` runs in-process (capsys, pytest.raises(SystemExit)); `models.init_model` is made
to fail the test wherever a bad argument must stop before any work. One subprocess checks
that a refused configuration prints no traceback. The good default run is covered by
tests/test_engine.py::test_example_runs_end_to_end (not repeated here: it decodes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from examples import decode
from hisparse_jax import models
from hisparse_jax.engine import EngineConfig
from hisparse_jax.models.checkpoint import save_safetensors
from host_tier import CapacityError

ROOT = Path(__file__).resolve().parents[1]
PROG = "decode.py"


@pytest.fixture
def no_work(monkeypatch):
    """Any model construction fails the test: the argument had to be refused before."""
    def boom(*args, **kwargs):
        pytest.fail("a bad argument reached models.init_model (work ran before the check)")
    monkeypatch.setattr(models, "init_model", boom)


def refused(argv, capsys) -> str:
    """Runs main(argv), expects exit status 2, returns the one error line (checked to be the
    only line besides the short usage line, with no traceback)."""
    with pytest.raises(SystemExit) as exc:
        decode.main(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert "Traceback" not in captured.err
    assert lines[0] == f"usage: {PROG} [options]", captured.err
    assert len(lines) == 2, captured.err
    assert lines[1].startswith(f"{PROG}: error: "), captured.err
    return lines[1]


# ------------------------------------------------------------------ one flag at a time

BAD_VALUES = [
    ("--top-k", "0"), ("--top-k", "-3"), ("--index-group-size", "0"), ("--hot-size", "0"),
    ("--prompt-len", "0"),
    ("--block-size", "0"), ("--gen-len", "0"), ("--max-model-len", "-4"), ("--requests", "0"),
    ("--seats", "0"), ("--gpu-blocks", "0"), ("--host-blocks", "0"), ("--prefill-bucket", "0"),
    ("--gpu-pool-fraction", "-1"), ("--gpu-pool-fraction", "0"), ("--gpu-pool-fraction", "1.5"),
    ("--gpu-pool-fraction", "nan"), ("--temperature", "-1"), ("--temperature", "inf"),
    ("--temperature", "warm"), ("--seed", "-1"), ("--seed", str(2**32)), ("--requests", "2.5"),
    ("--config", "bogus"), ("--kv-format", "fp8"), ("--speculative-tokens", "-1"),
    ("--acceptance-rate", "1.5"), ("--acceptance-rate", "nan"), ("--prefill-chunk-size", "0"),
    ("--prefill-chunk-size", "-8"),
]


@pytest.mark.parametrize("flag, value", BAD_VALUES)
def test_bad_value_is_refused_at_parsing(flag, value, capsys, no_work):
    line = refused([flag, value], capsys)
    assert f"argument {flag}:" in line
    assert value in line or value.lstrip("-") in line


@pytest.mark.parametrize("flag, rule", [
    ("--top-k", "positive integer"), ("--gpu-pool-fraction", "(0, 1]"),
    ("--temperature", ">= 0"), ("--seed", "[0, 4294967295]")])
def test_bad_value_message_states_the_rule(flag, rule, capsys, no_work):
    assert rule in refused([flag, "-1"], capsys)


# ------------------------------------------------------------------ rules between flags

CROSS_FIELD = [
    (["--prompt-len", "100"], ["--prompt-len", "--gen-len", "--max-model-len"]),
    (["--prompt-len", "40", "--gen-len", "30", "--max-model-len", "69"], ["--max-model-len"]),
    (["--hot-size", "8"], ["--hot-size", "top_k 16"]),              # tiny's top_k is 16
    (["--top-k", "40", "--hot-size", "32"], ["--hot-size", "top_k 40"]),
    (["--hot-size", "40000"], ["--hot-size", "32768"]),
    (["--top-k", "40000"], ["--top-k", "32768"]),
    (["--check", "--all-resident"], ["--check", "--all-resident"]),
    (["--all-resident", "--gpu-blocks", "10"], ["--gpu-blocks", "--all-resident"]),
    (["--all-resident", "--hot-size", "32", "--host-blocks", "99"],
     ["--hot-size", "--host-blocks"]),
    (["--gpu-blocks", "10", "--gpu-pool-fraction", "0.5"],
     ["--gpu-blocks", "--gpu-pool-fraction"]),
    (["--kv-format", "fp8_ds_mla"], ["--kv-format", "--config tiny", "512", "tiny576"]),
    (["--speculative-tokens", "4"], ["--speculative-tokens 4", "--block-size 4"]),
    (["--acceptance-rate", "0.8"], ["--acceptance-rate", "--speculative-tokens"]),
    (["--speculative-tokens", "1", "--acceptance-rate", "0.8", "--check"],
     ["--acceptance-rate", "--check"]),
    (["--speculative-tokens", "1", "--hot-size", "16"],
     ["--hot-size", "--speculative-tokens 1", "top_k 16"]),
    (["--check", "--check-chunked"], ["--check-chunked", "--prefill-chunk-size"]),
    (["--index-group-size", "3"], ["--index-group-size 3", "2 layers"]),
    (["--prefill-chunk-size", "8", "--check-chunked"], ["--check-chunked", "--check"]),
]


@pytest.mark.parametrize("argv, names", CROSS_FIELD)
def test_cross_field_rules_are_checked_before_any_work(argv, names, capsys, no_work):
    line = refused(argv, capsys)
    for name in names:
        assert name in line


def test_fitting_lengths_pass_the_checks(no_work):
    """The bound is inclusive: prompt + new tokens == max_model_len is accepted (the run
    then stops at models.init_model, which no_work turns into a failure: so check_args only)."""
    p = decode.build_parser()
    args = p.parse_args(["--prompt-len", "40", "--gen-len", "30", "--max-model-len", "70",
                         "--hot-size", "16", "--check", "--temperature", "0.8"])
    decode.check_args(p, args)                 # no SystemExit


# ------------------------------------------------------------------ output path, pool sizes


@pytest.mark.parametrize("where, rule", [
    ("missing/run.json", "does not exist"),     # a folder that is not there
    (".", "is a folder"),                        # a folder, not a file
])
def test_json_path_is_checked_before_any_work(where, rule, tmp_path, capsys, no_work):
    path = str(tmp_path / where)
    line = refused(["--json", path], capsys)
    assert f"--json {path}" in line and rule in line
    assert not (tmp_path / "missing").exists()


def test_json_probe_leaves_no_file(tmp_path, no_work):
    """A writable new path passes the checks and is not created by them."""
    p = decode.build_parser()
    path = tmp_path / "run.json"
    decode.check_args(p, p.parse_args(["--json", str(path)]))     # no SystemExit
    assert not path.exists()
    path.write_text("kept")                                     # an existing file: appendable
    decode.check_args(p, p.parse_args(["--json", str(path)]))
    assert path.read_text() == "kept"


def test_missing_json_folder_exits_2_quickly(tmp_path):
    """The newcomer's case, as a fresh process: exit 2 and one line naming --json, with no
    model, engine or decode run first (nothing on stdout, where a run prints its header)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    target = tmp_path / "no-such-folder" / "run.json"
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "decode.py"), "--json",
                           str(target)], capture_output=True, text=True, env=env, timeout=120,
                          check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"{PROG}: error: --json "), proc.stderr


POOL_REFUSALS = [
    (["--host-blocks", "2"], ["--host-blocks", "host pool", "--prompt-len 64"]),
    (["--gpu-blocks", "5"], ["--gpu-blocks", "refused by the host tier"]),
    (["--gpu-blocks", "20"], ["--gpu-blocks", "--gpu-pool-fraction", "device pool"]),
    (["--host-blocks", str(10**12)], ["--host-blocks", "RAM"]),
    (["--gpu-blocks", str(10**12)], ["--gpu-blocks", "device KV caches"]),
    (["--all-resident", "--max-model-len", str(10**12)], ["--seats x --max-model-len"]),
]


@pytest.mark.parametrize("argv, names", POOL_REFUSALS)
def test_pool_sizes_are_checked_before_any_work(argv, names, capsys, no_work):
    """The engine's pool rules (device memory, host RAM, the host tier's sizes, a lone
    request of --prompt-len + --gen-len tokens) refuse before the model is built, with the
    line the engine's refusal gives."""
    line = refused(argv, capsys)
    assert "the engine refused this configuration" in line
    for name in names:
        assert name in line


# ------------------------------------------------------------------ --help


def help_blocks(text: str) -> dict[str, str]:
    """--help output -> {flag line: its help text}: a flag's block runs from its line (two
    spaces, then "-") to the next flag's."""
    blocks: dict[str, list[str]] = {}
    head = None
    for line in text.splitlines():
        if line.startswith("  -"):
            parts = line.strip().split("  ", 1)
            head = parts[0]
            blocks[head] = [parts[1].strip()] if len(parts) > 1 else []
        elif head is not None and line.startswith("   "):
            blocks[head].append(line.strip())
        else:
            head = None
    return {head: " ".join(words) for head, words in blocks.items()}


def check_help(parser: argparse.ArgumentParser, text: str) -> None:
    """Every flag of `parser` has a help text and its --help block states a default at most
    once."""
    silent = [a.option_strings[0] for a in parser._actions if not a.help]
    assert not silent, f"flags without a help text: {silent}"
    blocks = help_blocks(text)
    assert len(blocks) == len(parser._actions), blocks
    for head, words in blocks.items():
        assert words, f"{head}: no help text"
        assert words.count("(default") <= 1, f"{head}: {words}"


def test_every_flag_has_help_and_one_default(capsys):
    p = decode.build_parser()
    check_help(p, p.format_help())
    with pytest.raises(SystemExit) as exc:
        decode.main(["--help"])
    assert exc.value.code == 0
    blocks = help_blocks(capsys.readouterr().out)
    for flag in ("--config", "--requests", "--block-size", "--prefill-bucket"):
        (words,) = [w for head, w in blocks.items() if head.split()[0] == flag]
        assert words, flag
    assert "(default: 0.4)" in blocks["--gpu-pool-fraction GPU_POOL_FRACTION"]
    assert not any("(default: None)" in w for w in blocks.values())


@pytest.mark.parametrize("module", ["e2e_decode", "mesh_decode"])
def test_bench_help_has_a_text_per_flag_and_one_default(module, capsys, monkeypatch):
    """The benches a user is pointed to build their parser in main(): --help is parsed
    before anything runs."""
    import importlib
    bench = importlib.import_module(f"bench.{module}")
    parsers = []
    real = argparse.ArgumentParser.parse_args

    def keep(self, *args, **kwargs):
        parsers.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep)
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    check_help(parsers[0], capsys.readouterr().out)


# ------------------------------------------------------------------ defaults, no fallbacks


def _config(argv, all_resident=False) -> EngineConfig:
    args = decode.build_parser().parse_args(argv)
    return decode.engine_config(args, decode.model_config(args), all_resident=all_resident)


def test_omitted_flags_mean_their_defaults():
    default = _config([])
    assert default.sizes.hot_size == 2 * models.CONFIGS["tiny"].top_k    # rounded up to B = 4
    assert default == _config(["--gpu-pool-fraction", str(decode.DEFAULT_GPU_POOL_FRACTION)])
    assert _config(["--top-k", "6"]).sizes.hot_size == 12
    assert _config(["--top-k", "6", "--block-size", "8"]).sizes.hot_size == 16
    assert _config(["--hot-size", "20"]).sizes.hot_size == 20
    assert _config(["--gpu-blocks", "77"]).sizes.num_gpu_blocks == 77
    assert _config(["--host-blocks", "99"]).sizes.num_host_blocks == 99
    assert default.kv_format == "bf16"
    assert _config(["--config", "tiny576", "--kv-format", "fp8_ds_mla"]).kv_format == "fp8_ds_mla"
    # a smaller fraction gives a smaller pool (down to what a lone request needs)
    assert (_config(["--gpu-pool-fraction", "1"]).sizes.num_gpu_blocks
            > _config(["--gpu-pool-fraction", "0.4"]).sizes.num_gpu_blocks)


def test_index_group_size_reaches_the_model_config():
    args = decode.build_parser().parse_args(["--index-group-size", "2"])
    assert decode.model_config(args).index_group_size == 2
    assert decode.model_config(decode.build_parser().parse_args([])).index_group_size == 1


def test_speculation_flags_reach_the_model_and_engine_configs():
    args = decode.build_parser().parse_args(["--speculative-tokens", "2"])
    assert decode.model_config(args).mtp_layers == 1  # MTP drafts: the model gets the module
    ec = _config(["--speculative-tokens", "2"])
    assert ec.num_speculative_tokens == 2 and ec.speculative.draft is None
    assert ec.sizes.hot_size == 2 * 3 * models.CONFIGS["tiny"].top_k
    args = decode.build_parser().parse_args(["--speculative-tokens", "1",
                                             "--acceptance-rate", "0.7"])
    assert decode.model_config(args).mtp_layers == 0
    assert _config(["--speculative-tokens", "1", "--acceptance-rate", "0.7"]
                   ).speculative.draft.acceptance_rate == 0.7
    # --check's baseline speculates alike (same drafts, same batch rows: same arithmetic)
    assert decode.engine_config(args, decode.model_config(args), all_resident=True
                                ).num_speculative_tokens == 1


def test_prefill_chunk_size_reaches_the_served_engine_only():
    assert _config([]).prefill.chunk_size is None
    argv = ["--prefill-chunk-size", "12"]
    assert _config(argv).prefill.chunk_size == 12
    assert _config(argv, all_resident=True).prefill.chunk_size == 12
    args = decode.build_parser().parse_args(argv)
    # --check's all-resident reference prefills in one shot
    assert decode.engine_config(args, decode.model_config(args), all_resident=True,
                                reference=True).prefill.chunk_size is None
    # ... unless --check-chunked asks for the same chunks (which needs --check)
    args = decode.build_parser().parse_args([*argv, "--check", "--check-chunked"])
    assert decode.engine_config(args, decode.model_config(args), all_resident=True,
                                reference=True).prefill.chunk_size == 12


def test_chunked_prefill_example_check_passes(capsys):
    rc = decode.main(["--prefill-chunk-size", "5", "--check", "--requests", "3",
                      "--prompt-len", "14", "--gen-len", "6", "--max-model-len", "24",
                      "--prefill-bucket", "5", "--no-warmup", "--no-compile-cache"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "greedy tokens identical to all-resident: True" in text


def test_no_compile_cache_reaches_the_engine_config():
    assert getattr(_config([]), "compilation_cache", True) is True
    ec = _config(["--no-compile-cache"])
    assert getattr(ec, "compilation_cache", False) is False
    has_field = "compilation_cache" in {f.name for f in dataclasses.fields(EngineConfig)}
    args = decode.build_parser().parse_args(["--no-compile-cache"])
    assert decode.compile_cache_kwargs(args) == ({"compilation_cache": False} if has_field
                                                 else {})


# ------------------------------------------------------------------ engine refusals


class _RefusingEngine:
    """Stands in for Engine: refuses at construction or at add_request, records close()."""

    closed = 0
    refuse_at = "init"

    def __init__(self, model, ec):
        if self.refuse_at == "init":
            raise ValueError("Coordinator.num_gpu_blocks must be >= 9,\n got 3")
        self.model_config = models.CONFIGS["tiny"]

    def add_request(self, *args, **kwargs):
        raise CapacityError("the device pool cannot hold a 64-token prompt: needs 20 blocks")

    def close(self):
        type(self).closed += 1


@pytest.mark.parametrize("refuse_at, flag", [("init", "--gpu-blocks"),
                                             ("add_request", "--gpu-blocks")])
def test_engine_refusal_is_one_line_naming_the_flag(refuse_at, flag, monkeypatch, capsys):
    monkeypatch.setattr(models, "init_model", lambda *a, **k: object())
    monkeypatch.setattr(_RefusingEngine, "refuse_at", refuse_at)
    monkeypatch.setattr(_RefusingEngine, "closed", 0)
    monkeypatch.setattr(decode, "Engine", _RefusingEngine)
    line = refused([], capsys)
    assert "the engine refused this configuration" in line and flag in line
    # an engine that refused a request is closed (its pools are not leaked)
    assert _RefusingEngine.closed == (1 if refuse_at == "add_request" else 0)


def test_engine_refusal_prints_no_traceback():
    """The real engine refuses a host pool too small for the prompts (EngineConfig accepts
    two blocks, add_request raises CapacityError): one line, exit 2, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "decode.py"),
                           "--host-blocks", "2"], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"{PROG}: error: the engine refused"), proc.stderr
    assert "--host-blocks" in lines[-1]
    assert proc.stdout == ""


# ------------------------------------------------------------------ --check's comparison


@dataclasses.dataclass
class _Done:
    generated: list
    finish_reason: str = "length"


def test_check_says_which_tokens_it_compared():
    a = {0: _Done([1, 2, 3]), 1: _Done([4, 5])}
    line, same = decode.compare_tokens(a, dict(a), temperature=0.0, seed=7)
    assert same and line == "greedy tokens identical to all-resident: True"
    line, same = decode.compare_tokens(a, dict(a), temperature=0.8, seed=7)
    assert same and line.startswith("sampled tokens under seed 7")
    assert line.endswith("identical to all-resident: True")


@pytest.mark.parametrize("other", [
    {0: _Done([1, 2, 3]), 1: _Done([4, 6])},                         # one token differs
    {0: _Done([1, 2, 3])},                                            # a request missing
    {0: _Done([1, 2, 3]), 1: _Done([4, 5]), 2: _Done([])},            # an extra request
    {0: _Done([1, 2, 3]), 1: _Done([4, 5], "error")},                 # finished differently
])
def test_check_fails_on_any_difference(other):
    a = {0: _Done([1, 2, 3]), 1: _Done([4, 5])}
    line, same = decode.compare_tokens(a, other, temperature=0.8, seed=3)
    assert not same and line.endswith(": False")


def test_argument_types_directly():
    assert decode.positive_int("3") == 3
    assert decode.pool_fraction("1") == 1.0
    assert decode.non_negative_float("0") == 0.0
    assert decode.seed_int(str(2**32 - 1)) == 2**32 - 1
    for fn, text in [(decode.positive_int, "0"), (decode.pool_fraction, "0"),
                     (decode.non_negative_float, "-0.5"), (decode.seed_int, "-1")]:
        with pytest.raises(argparse.ArgumentTypeError):
            fn(text)


def test_json_record_of_a_checked_run_feeds_the_startup_benchmark(tmp_path, capsys):
    """--json writes each mode's summary and --check's verdict; bench/startup.py reads its
    figures from it (warm-up, compile time while serving, steady step time per mode)."""
    import json

    from bench import startup
    path = tmp_path / "run.json"
    argv = [*startup.SMOKE_EXAMPLE, "--no-compile-cache", "--json", str(path)]
    assert decode.main(argv) == 0
    capsys.readouterr()
    record = json.loads(path.read_text())
    assert record["tokens_identical"] is True
    assert [s["mode"] for s in record["summaries"]] == ["hisparse", "all-resident"]
    hs, ar = record["tokens"]
    assert hs == ar and len(hs) == record["args"]["requests"]
    assert all(len(t) == record["args"]["gen_len"] for t in hs.values())
    figures = startup.start_figures(record, wall=1.5)
    assert figures["process_wall_s"] == 1.5 and figures["tokens_identical"] is True
    for mode in ("hisparse", "all-resident"):
        f = figures["modes"][mode]
        assert f["warmup_s"] > 0 and f["decode_step_ms"] > 0
        assert f["compile_while_serving_s"] == 0.0  # the warm-up reached every bucket


# ------------------------------------------------------------------ --model, --prompt, --prompt-ids


@pytest.fixture
def no_load(monkeypatch, no_work):
    """Neither a random model nor a checkpoint may be built: the flags had to be refused."""
    def boom(*args, **kwargs):
        pytest.fail("a bad argument reached models.from_pretrained (work ran before the check)")
    monkeypatch.setattr(models, "from_pretrained", boom, raising=False)


def _checkpoint(folder, config=None, tokenizer=False):
    """A checkpoint folder the flag checks accept (config.json, one tiny safetensors file);
    its weights are never read here."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "deepseek_v32"}))
    save_safetensors(folder / "model.safetensors", {"w": np.zeros(2, np.float32)})
    if tokenizer:
        tk = pytest.importorskip("tokenizers")
        vocab = {"[UNK]": 0, "<eos>": 1, "<bos>": 2, "hello": 3, "world": 4}
        tok = tk.Tokenizer(tk.models.WordLevel(vocab, unk_token="[UNK]"))
        tok.pre_tokenizer = tk.pre_tokenizers.Whitespace()
        tok.decoder = tk.decoders.WordPiece()
        tok.add_special_tokens(["<eos>", "<bos>"])
        tok.post_processor = tk.processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", 2)])
        tok.save(str(folder / "tokenizer.json"))
    return str(folder)


@pytest.fixture
def tiny_checkpoint_spec(monkeypatch):
    """--model's facts (checkpoint_spec, read from config.json) stand in as the tiny model's,
    so the prompt rules run without a real checkpoint's config."""
    spec = models.model_spec(models.get_config("tiny"))
    monkeypatch.setattr(decode, "checkpoint_spec", lambda args: spec)
    return spec


MODEL_REFUSALS = [
    (lambda d: ["--model", str(d / "nowhere")], ["--model", "nowhere", "does not exist"]),
    (lambda d: ["--model", str(d)], ["--model", "has no config.json"]),
    (lambda d: ["--dtype", "bfloat16"], ["--dtype needs --model"]),
    (lambda d: ["--prompt", "hello"], ["--prompt needs --model"]),
    (lambda d: ["--model", _checkpoint(d / "c"), "--config", "tiny"],
     ["--model and --config exclude each other"]),
    (lambda d: ["--model", _checkpoint(d / "c"), "--top-k", "4"], ["--top-k", "--model"]),
    (lambda d: ["--model", _checkpoint(d / "c"), "--index-group-size", "1"],
     ["--index-group-size", "--model"]),
    (lambda d: ["--model", _checkpoint(d / "c"), "--prompt", "hello"],
     ["--prompt needs a tokenizer", "no tokenizer.json"]),
    (lambda d: ["--model", _checkpoint(d / "c"), "--prompt", "a", "--prompt-ids", "1"],
     ["--prompt and --prompt-ids exclude each other"]),
    (lambda d: ["--prompt-ids", "1,2", "--requests", "3"], ["--requests sizes random prompts"]),
    (lambda d: ["--prompt-ids", "1,2", "--prompt-len", "3"], ["--prompt-len sizes random"]),
    (lambda d: ["--prompt-ids", "1,600"], ["--prompt-ids '1,600'", "token id 600",
                                           "vocab size 512"]),
    (lambda d: ["--prompt-ids", ",".join(["1"] * 100)], ["--prompt-ids", "100 tokens",
                                                         "--gen-len 48", "--max-model-len 128"]),
]


@pytest.mark.parametrize("argv, names", MODEL_REFUSALS, ids=[n[0] for _, n in MODEL_REFUSALS])
def test_model_and_prompt_flags_are_checked_before_any_work(argv, names, tmp_path, capsys,
                                                             no_load):
    line = refused(argv(tmp_path), capsys)
    for name in names:
        assert name in line


def test_model_folder_without_weights_is_refused(tmp_path, capsys, no_load):
    (tmp_path / "config.json").write_text("{}")
    line = refused(["--model", str(tmp_path)], capsys)
    assert "--model" in line and "neither model.safetensors nor" in line


def test_model_config_refused_names_model(tmp_path, capsys, no_load):
    """A config.json the model's config refuses (here an unsupported model_type) stops at the
    flag checks with one line naming --model."""
    folder = _checkpoint(tmp_path / "c", {"model_type": "llama"})
    line = refused(["--model", folder], capsys)
    assert line.startswith(f"{PROG}: error: --model {folder}: ")


def test_bad_prompt_ids_are_refused_at_parsing(capsys, no_load):
    for value in ("1,x", "", "1,,2", "-1", "1.5"):
        line = refused(["--prompt-ids", value], capsys)
        assert "argument --prompt-ids: must be comma-separated token ids" in line


def test_given_prompts_set_requests_and_prompt_len(no_load):
    p = decode.build_parser()
    args = p.parse_args(["--prompt-ids", "1,2,3", "--prompt-ids", " 4 ,5"])
    decode.check_args(p, args)
    assert args.prompt_ids == [[1, 2, 3], [4, 5]]
    assert (args.requests, args.prompt_len) == (2, 3)
    assert decode.request_prompts(p, args) == [[1, 2, 3], [4, 5]]


def test_given_flags_are_told_apart_from_defaults():
    p = decode.build_parser()
    assert p.parse_args([]).given == ()
    args = p.parse_args(["--config", "tiny", "--requests", "6", "--prompt-len", "64"])
    assert args.given == ("config", "prompt_len", "requests")
    assert (args.config, args.requests, args.prompt_len) == ("tiny", 6, 64)
    assert decode.token_ids("7, 8,9") == [7, 8, 9]
    with pytest.raises(argparse.ArgumentTypeError):
        decode.token_ids("7;8")


def test_text_prompts_are_encoded_by_the_tokenizer(tmp_path, no_load, tiny_checkpoint_spec):
    folder = _checkpoint(tmp_path / "c", tokenizer=True)
    p = decode.build_parser()
    args = p.parse_args(["--model", folder, "--prompt", "hello world", "--prompt", "world"])
    decode.check_args(p, args)
    assert decode.request_prompts(p, args) == [[2, 3, 4], [2, 4]]
    assert (args.requests, args.prompt_len) == (2, 3)
    assert decode.model_config(args) is tiny_checkpoint_spec


def test_model_run_decodes_text_prompts(tmp_path, monkeypatch, capsys, tiny_checkpoint_spec):
    """The --model path end to end, with the tiny random model standing in for the checkpoint
    (from_pretrained) and its spec for the config's: the tokenizer encodes the prompts, the
    engine decodes them, and each request's output is printed decoded."""
    folder = _checkpoint(tmp_path / "c", {"model_type": "deepseek_v32", "eos_token_id": 1},
                         tokenizer=True)
    loaded = []

    def fake_from_pretrained(path, *, dtype=None):
        loaded.append((path, dtype))
        return models.init_model("tiny")

    monkeypatch.setattr(models, "from_pretrained", fake_from_pretrained, raising=False)
    rc = decode.main(["--model", folder, "--dtype", "float32", "--prompt", "hello world",
                      "--prompt", "world hello world", "--gen-len", "4", "--max-model-len", "16",
                      "--all-resident", "--no-warmup", "--no-compile-cache"])
    assert rc == 0
    assert loaded == [(folder, "float32")]
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("--- request ")]
    assert len(heads) == 2 and heads[0].startswith("--- request 0 (")
