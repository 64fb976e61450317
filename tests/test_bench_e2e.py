"""The end-to-end benchmark's plumbing on a tiny CPU run (figures come from the GPU run)."""

from __future__ import annotations

import json

import pytest


def test_e2e_benchmark_runs_every_mode_and_writes_its_record(tmp_path):
    from bench import e2e_decode

    out = tmp_path / "e2e.json"
    rc = e2e_decode.main([
        "--config", "tiny", "--context", "256", "--gen-budget", "128", "--block-size", "16",
        "--concurrency", "1,6", "--turnover-sweep", "0.25", "--warmup-steps", "2",
        "--measure-steps", "4", "--rounds", "2", "--output", str(out), "--no-plot"])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["config"]["prefill"].startswith("synthetic")
    runs = {(r["mode"], r["concurrency"], r["turnover"]): r for r in record["results"]}
    assert set(runs) == {(m, c, 0.05) for m in e2e_decode.MODES for c in (1, 6)} | {
        ("naive-offload", 6, 0.25), ("hisparse", 6, 0.25)}
    cap = record["config"]["all_resident_cap"]
    for (mode, c, _), r in runs.items():
        assert "skipped" not in r, r
        assert r["measured_steps"] == 4 and r["decode_tokens_per_s"] > 0
        assert r["running_min"] == r["running_max"] == (min(c, cap) if mode == "all-resident"
                                                        else c)
    # At 6 requests the pool is under pressure: HiSparse reads through hot regions and
    # reuses rows across steps; naive offload copies every selected row every step.
    hs, nv = runs[("hisparse", 6, 0.05)], runs[("naive-offload", 6, 0.05)]
    assert hs["hit_rate"] > 0.5 and nv["hit_rate"] == 0.0
    assert nv["rows_h2d_per_step"] > hs["rows_h2d_per_step"] > 0
    assert runs[("hisparse", 6, 0.25)]["rows_h2d_per_step"] > hs["rows_h2d_per_step"]
    assert set(record["ratios"]["hisparse_over_all_resident"]) == {"1", "6"}
    ratio = runs[("hisparse", 1, 0.05)]["decode_tokens_per_s"] / runs[
        ("all-resident", 1, 0.05)]["decode_tokens_per_s"]
    assert record["ratios"]["hisparse_over_all_resident"]["1"] == pytest.approx(ratio)


def test_e2e_plot_draws_both_panels(tmp_path):
    pytest.importorskip("matplotlib")  # the optional `bench` extra
    from bench import e2e_decode

    def row(mode, c, tv, tps):
        return {"mode": mode, "concurrency": c, "turnover": tv, "decode_tokens_per_s": tps,
                "itl_ms_p50": 1e3 * c / tps, "running_max": c}

    results = [row(m, c, 0.05, c * k) for m, k in (("all-resident", 90), ("hisparse", 100),
                                                    ("naive-offload", 50)) for c in (1, 8)]
    results += [row(m, 8, tv, 500) for m in ("hisparse", "naive-offload") for tv in (0.1, 0.25)]
    record = {"date": "2026-11-30", "machine": {"device": "cpu", "jax": "x"},
              "config": {"turnover": 0.05, "turnover_sweep_at": 8, "model": "tiny",
                         "context": 256, "gpu_blocks": 10, "all_resident_cap": 1},
              "results": results}
    src = tmp_path / "e2e.json"
    src.write_text(json.dumps(record))
    e2e_decode.plot(src, tmp_path / "e2e.png")
    assert (tmp_path / "e2e.png").stat().st_size > 10_000
