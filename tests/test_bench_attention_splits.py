"""bench/attention_splits.py on tiny CPU shapes (the kernel in interpret mode): every split
count that divides the K steps is timed beside the default rule, each checked against the
reference; bad arguments are refused by name."""

from __future__ import annotations

import json

import pytest

from tests.bench_runs import refusal, run_small_many

DEFAULT_RULE = ("--ns", "1,3", "--heads", "16")
XLA_COMBINE = ("--ns", "2", "--heads", "16", "--splits", "1,2", "--xla-combine")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Both tests' command lines in one subprocess (one python and jax start-up, not two):
    {name: (the run, its output file)}."""
    tmp = tmp_path_factory.mktemp("attention_splits")
    lines = {"default_rule": (*DEFAULT_RULE, "--output", str(tmp / "default_rule.json")),
             "xla_combine": (*XLA_COMBINE, "--output", str(tmp / "xla_combine.json"))}
    done = run_small_many("bench.attention_splits", lines.values())
    return {name: (done[args], tmp / f"{name}.json") for name, args in lines.items()}


def test_every_split_count_is_timed_beside_the_default_and_checked(runs):
    proc, out = runs["default_rule"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    counts = record["split_counts"]
    steps = record["top_k"] // record["block_k"]
    assert counts == [s for s in range(1, steps + 1) if steps % s == 0] and len(counts) > 1
    assert record["timed_splits"] == [s for s in counts if s >= min(4, counts[-1])]
    for n in (1, 3):
        figs = [f for f in record["figures"] if f["n"] == n]
        assert sum(f["default_rule"] for f in figs) == 1
        assert figs[0]["default_rule"] and figs[0]["ratio_to_default"] == 1.0
        assert sorted({f["splits"] for f in figs}) == sorted(
            {figs[0]["splits"], *record["timed_splits"]})
        for f in figs:
            assert f["rel_err"] < 2e-2, f
            assert f["wall_us_per_call"] > 0
            assert f["device_us_per_call"] is None         # no GPU trace on the CPU
            assert f["selected_bytes"] == n * record["top_k"] * 1152


def test_xla_combine_times_each_setting_both_ways(runs):
    proc, out = runs["xla_combine"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    figs = json.loads(out.read_text())["figures"]
    default = figs[0]["splits"]
    assert figs[0]["default_rule"] and figs[0]["combine"] == "fused kernel"
    # The default rule's split count both ways, every other timed count both ways.
    settings = sorted((f["splits"], f["combine"], f["default_rule"]) for f in figs)
    want = sorted([(default, "fused kernel", True), (default, "XLA fusions", True)]
                  + [(s, c, False) for s in (1, 2) if s != default
                     for c in ("fused kernel", "XLA fusions")])
    assert settings == want
    assert all(f["rel_err"] < 2e-2 for f in figs)


def test_bad_arguments_are_refused_by_name(monkeypatch, capsys):
    for args, says in ((("--ns", "0"), "--ns"), (("--heads", "x"), "--heads"),
                       (("--inner", "0"), "--inner"), (("--splits", "3"), "--splits")):
        said = refusal("bench.attention_splits", *args, monkeypatch=monkeypatch, capsys=capsys)
        assert says in said, (args, said[-500:])
