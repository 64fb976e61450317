"""bench/ncu_kernels.py (the launches the suite's `ncu` step profiles) on the benchmarks' small
CPU shapes, kernels interpreted: each op runs its three calls; bad arguments are refused by
name."""

from __future__ import annotations

import pytest

from tests.bench_runs import refusal, run_small_many

RUNS = [("attention", "--n", "2", "--h", "16"),
        ("attention", "--n", "1", "--h", "16", "--tuning", "bk32_s3"),
        ("attention", "--n", "1", "--h", "16", "--splits", "2"),
        ("attention", "--n", "2", "--h", "16", "--kv-format", "fp8_ds_mla"),
        ("resolve", "--n", "2"),
        ("resolve", "--n", "2", "--rule", "map"),
        ("gather", "--rows", "256"),
        ("gather", "--rows", "512", "--plan", "step", "--pool-gib", "0.01")]
TOO_MANY_ROWS = ("gather", "--rows", "100000")


@pytest.fixture(scope="module")
def runs() -> dict:
    # Every command line below in one subprocess (the sizes come from the environment's small
    # shapes, read when the benchmark modules load): one python and jax start-up, not nine.
    return run_small_many("bench.ncu_kernels", [*RUNS, TOO_MANY_ROWS])


@pytest.mark.parametrize("args", RUNS)
def test_each_op_runs_its_three_calls(args, runs):
    proc = runs[args]
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"{args[0]}: last call" in proc.stdout


@pytest.mark.parametrize("args, says", [(("attention", "--n", "0"), "--n"),
                                        (("gather", "--pool-gib", "-1"), "--pool-gib"),
                                        (("attention", "--tuning", "bk7"), "--tuning"),
                                        (("resolve", "--tuning", "w3"), "--tuning"),
                                        (("resolve", "--splits", "2"), "--splits"),
                                        (("attention", "--rule", "map"), "--rule"),
                                        (("gather", "--kv-format", "fp8_ds_mla"),
                                         "--kv-format"),
                                        (("attention", "--splits", "-1"), "--splits")])
def test_bad_arguments_are_refused_by_name(args, says, monkeypatch, capsys):
    assert says in refusal("bench.ncu_kernels", *args, monkeypatch=monkeypatch, capsys=capsys)


def test_more_rows_than_the_pool_holds_are_refused(runs):
    # Checked against the pool the op sizes from the environment's small shapes: a subprocess.
    proc = runs[TOO_MANY_ROWS]
    assert proc.returncode != 0
    assert "--rows" in proc.stderr


def test_sweep_candidates_keep_the_named_variants_and_the_baselines():
    from bench import ncu_kernels
    from bench.ops.sparse_mla_decode import mosaic_row_variants

    if not mosaic_row_variants():
        pytest.skip("this jax has no Mosaic GPU Pallas: no row-copy variants")
    plan = ncu_kernels._sweep_plan("row_noprefetch")
    assert {(fmt, name) for fmt, name, _, _ in plan} == {
        ("fp8_ds_mla", "triton"), ("fp8_ds_mla", "row_noprefetch"),
        ("bf16", "triton"), ("bf16", "row_noprefetch")}
    assert len(ncu_kernels._sweep_plan("")) > len(plan)
    with pytest.raises(ValueError, match="--candidates.*row_nope"):
        ncu_kernels._sweep_plan("row,row_nope")
