"""bench/gather_pool.py on tiny CPU shapes (the reference gather): every case runs and is
recorded against the first; bad arguments are refused by name."""

from __future__ import annotations

import json

import pytest

from tests.bench_runs import refusal, run_small


def _run(*args: str):
    return run_small("bench.gather_pool", *args)


def test_every_case_is_recorded(tmp_path):
    out = tmp_path / "gp.json"
    proc = _run("--rows", "100", "--reps", "2", "--sizes-gib", "0.002,0.003", "--output",
                str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    cases = [f["case"] for f in record["figures"]]
    assert cases == ["size", "size", "size-sorted", "width2304", "width4608",
                     "layers-2pools-one-launch", "layers-2pools-per-layer",
                     "layers-1pool-side-by-side", "layers-packed-pool"]
    for f in record["figures"]:
        assert f["rows"] == 100 and f["bytes"] == 100 * f["row_bytes"] * f["layers"]
        assert f["reps"] == 2 and len(f["chain_walls_us"]) == 3
    packed = record["figures"][-1]
    assert (packed["pools"], packed["layers"], packed["row_bytes"]) == (1, 2, 1152)
    assert record["figures"][0]["ratio_GBps_to_baseline"] == 1.0


@pytest.mark.parametrize("args, says", [(("--rows", "0"), "--rows"),
                                        (("--rows", "100000"), "--rows"),
                                        (("--reps", "0"), "--reps"),
                                        (("--cases", "size,tlb"), "--cases"),
                                        (("--sizes-gib", "a,b"), "--sizes-gib"),
                                        (("--sizes-gib", "0"), "--sizes-gib")])
def test_bad_arguments_are_refused_by_name(args, says, monkeypatch, capsys):
    assert says in refusal("bench.gather_pool", *args, monkeypatch=monkeypatch, capsys=capsys)
