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


def test_e2e_benchmark_compares_kv_row_formats(tmp_path):
    from bench import e2e_decode

    out = tmp_path / "e2e.json"
    rc = e2e_decode.main([
        "--config", "tiny576", "--context", "256", "--gen-budget", "64", "--block-size", "16",
        "--concurrency", "6", "--modes", "hisparse,all-resident", "--turnover-sweep", "",
        "--kv-format", "bf16,fp8_ds_mla", "--warmup-steps", "2", "--measure-steps", "4",
        "--rounds", "2", "--output", str(out), "--no-plot"])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["config"]["kv_formats"] == ["bf16", "fp8_ds_mla"]
    runs = {(r["kv_format"], r["mode"]): r for r in record["results"]}
    assert set(runs) == {(f, m) for f in ("bf16", "fp8_ds_mla")
                         for m in ("hisparse", "all-resident")}
    for (fmt, _), r in runs.items():
        assert "skipped" not in r, r
        assert r["row_bytes"] == (656 if fmt == "fp8_ds_mla" else 1152)
        assert r["bytes_h2d_per_step"] == pytest.approx(r["rows_h2d_per_step"] * r["row_bytes"])
    hs8, hs16 = runs[("fp8_ds_mla", "hisparse")], runs[("bf16", "hisparse")]
    assert hs8["rows_h2d_per_step"] > 0 and hs16["rows_h2d_per_step"] > 0
    assert hs8["host_pool_bytes_per_request"] * 1152 == hs16["host_pool_bytes_per_request"] * 656
    pools = record["config"]["host_pool_gib_by_kv_format"]
    assert pools["fp8_ds_mla"] / pools["bf16"] == pytest.approx(656 / 1152)
    ratios = record["ratios"]
    assert ratios["fp8_over_bf16"]["hisparse_tokens_per_s"]["6"] == pytest.approx(
        hs8["decode_tokens_per_s"] / hs16["decode_tokens_per_s"])
    assert ratios["fp8_over_bf16"]["hisparse_bytes_h2d_per_step"]["6"] == pytest.approx(
        hs8["bytes_h2d_per_step"] / hs16["bytes_h2d_per_step"])
    fp8 = ratios["by_kv_format"]["fp8_ds_mla"]["hisparse_over_all_resident"]["6"]
    assert fp8 == pytest.approx(hs8["decode_tokens_per_s"]
                                / runs[("fp8_ds_mla", "all-resident")]["decode_tokens_per_s"])
    assert ratios["hisparse_over_all_resident"] == ratios["by_kv_format"]["bf16"][
        "hisparse_over_all_resident"]
    print(f"\nrows/step bf16 {hs16['rows_h2d_per_step']:.1f} fp8 {hs8['rows_h2d_per_step']:.1f}")


def test_e2e_benchmark_compares_attention_backends(tmp_path, capsys):
    # Pairs of (kv format, attention backend): every format on the default backend and
    # fp8_ds_mla rows on "reference" too (off a GPU the default is the reference as well).
    from bench import e2e_decode

    out = tmp_path / "e2e.json"
    rc = e2e_decode.main([
        "--config", "tiny576", "--context", "256", "--gen-budget", "64", "--block-size", "16",
        "--concurrency", "6", "--modes", "hisparse", "--turnover-sweep", "",
        "--kv-format", "bf16,fp8_ds_mla", "--attention-backend", "default,fp8_ds_mla:reference",
        "--warmup-steps", "1", "--measure-steps", "2", "--output", str(out), "--no-plot"])
    assert rc == 0
    record = json.loads(out.read_text())
    variants = ["bf16:default", "fp8_ds_mla:default", "fp8_ds_mla:reference"]
    assert record["config"]["variants"] == variants
    assert record["config"]["attention_backends"] == ["default", "reference"]
    assert [e2e_decode.variant_of(r) for r in record["results"]] == variants
    runs = {e2e_decode.variant_of(r): r for r in record["results"]}
    for r in runs.values():
        assert r["mode"] == "hisparse" and "skipped" not in r, r
        assert r["measured_steps"] == 2 and r["decode_tokens_per_s"] > 0
    ratios = record["ratios"]
    over = ratios["over_first_variant"]
    assert over["base"] == "bf16:default"
    assert set(over["tokens_per_s"]) == set(variants[1:])
    base = runs["bf16:default"]["decode_tokens_per_s"]
    for v in variants[1:]:
        assert over["tokens_per_s"][v]["hisparse"]["6"] == pytest.approx(
            runs[v]["decode_tokens_per_s"] / base)
    # fp8 / bf16 compares the formats on one backend: the default, the only one with both.
    assert ratios["fp8_over_bf16"]["attention_backend"] == "default"
    assert ratios["fp8_over_bf16"]["hisparse_tokens_per_s"]["6"] == pytest.approx(
        runs["fp8_ds_mla:default"]["decode_tokens_per_s"] / base)
    assert "fp8_over_bf16_by_attention_backend" not in ratios
    assert set(ratios["by_variant"]) == set(variants)

    # Bad flags fail before any run: an unknown name (argparse), a format the run does not
    # list, and a backend the registry refuses for these inputs (the Mosaic GPU kernel's bf16
    # rows need a width that is a multiple of 64; tiny's rows are 64 + 32 wide).
    capsys.readouterr()
    with pytest.raises(SystemExit):
        e2e_decode.main(["--attention-backend", "triton,cuda", "--no-plot"])
    err = capsys.readouterr().err
    assert "--attention-backend" in err and "got 'cuda'" in err and "mosaic_gpu" in err
    with pytest.raises(SystemExit, match="names --kv-format fp8_ds_mla, which --kv-format bf16"):
        e2e_decode.main(["--attention-backend", "fp8_ds_mla:reference", "--no-plot"])
    refused = tmp_path / "refused.json"
    with pytest.raises(SystemExit, match="mosaic_gpu.*cannot run on this platform"):
        e2e_decode.main(["--config", "tiny", "--context", "256", "--gen-budget", "64",
                         "--block-size", "16", "--concurrency", "6", "--modes", "hisparse",
                         "--attention-backend", "reference,mosaic_gpu",
                         "--output", str(refused), "--no-plot"])
    assert not refused.exists()


def test_e2e_benchmark_with_the_models_indexer_and_more_layers(tmp_path):
    from bench import e2e_decode

    out = tmp_path / "e2e.json"
    rc = e2e_decode.main([
        "--config", "tiny", "--num-layers", "4", "--index-group-size", "2", "--indexer",
        "--context", "256",
        "--gen-budget", "64", "--block-size", "16", "--concurrency", "6",
        "--modes", "hisparse,all-resident", "--warmup-steps", "2", "--measure-steps", "4",
        "--rounds", "2", "--output", str(out), "--no-plot"])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["config"]["num_layers"] == 4 and record["config"]["group_layers"] == [2, 2]
    assert record["config"]["host_pool_layout"] == "packed"
    assert record["config"]["topk_source"].startswith("the model's indexer")
    runs = {r["mode"]: r for r in record["results"]}
    assert set(runs) == {"hisparse", "all-resident"}  # no turnover sweep with the indexer
    hs = runs["hisparse"]
    assert "skipped" not in hs and hs["decode_tokens_per_s"] > 0
    # The indexer's picks over 256 random keys move: rows come from host.
    assert hs["rows_h2d_per_step"] > 0 and hs["hit_rate"] is not None
    with pytest.raises(SystemExit, match="exclude each other"):
        e2e_decode.main(["--indexer", "--trace", "x.npz", "--no-plot"])
    with pytest.raises(SystemExit, match="--num-layers must be >= 1"):
        e2e_decode.main(["--num-layers", "0", "--no-plot"])
    with pytest.raises(SystemExit, match="--index-group-size must be >= 1"):
        e2e_decode.main(["--index-group-size", "0", "--no-plot"])
    with pytest.raises(SystemExit, match="num_layers=4 must be a multiple of index_group_size=3"):
        e2e_decode.main(["--config", "tiny", "--num-layers", "4", "--index-group-size", "3",
                         "--no-plot"])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_e2e_benchmark_counts_every_token_it_times(tmp_path, async_scheduling):
    # Each measured step emits one token per running request; with async scheduling a block's
    # last step is collected (drained) inside the window, so the count is the same.
    # The sizes are the first test's (gen budget 128, at most 6 requests: the same block
    # budget), so the synchronous engines' programs are that test's, read back from the
    # suite's compilation cache; the steps here need far less than either budget.
    from bench import e2e_decode

    out = tmp_path / "e2e.json"
    rc = e2e_decode.main([
        "--config", "tiny", "--context", "256", "--gen-budget", "128", "--block-size", "16",
        "--concurrency", "6", "--modes", "hisparse,all-resident", "--turnover-sweep", "",
        "--warmup-steps", "2", "--measure-steps", "8", "--rounds", "2", "--output", str(out),
        "--no-plot", *(["--async-scheduling"] if async_scheduling else [])])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["config"]["async_scheduling"] is async_scheduling
    for r in record["results"]:
        assert r["async_scheduling"] is async_scheduling
        assert r["measured_steps"] == 8, r
        assert r["measured_tokens"] == 8 * r["running_max"], r
        # Each of the 2 blocks of an async engine ends with the harness's drain, timed apart
        # from the step latencies (it counts in tokens/s); a synchronous engine never drains.
        assert len(r["block_end_drains_ms"]) == (2 if async_scheduling else 0), r
        assert all(d >= 0 for d in r["block_end_drains_ms"])


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
