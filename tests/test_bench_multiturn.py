"""The multi-turn benchmark's plumbing on a tiny CPU run (figures come from the GPU run)."""

from __future__ import annotations

import json

import pytest

N, TURNS, FIRST, USER, GEN, B = 3, 3, 96, 24, 8, 8


def test_multiturn_benchmark_reuses_prefixes_and_writes_its_record(tmp_path):
    from bench import multiturn

    out = tmp_path / "mt.json"
    rc = multiturn.main([
        "--config", "tiny", "--conversations", str(N), "--turns", str(TURNS),
        "--first-prompt", str(FIRST), "--user-tokens", str(USER), "--gen-tokens", str(GEN),
        "--block-size", str(B), "--prefill-chunk-size", "32", "--ttft-from-turn", "1",
        "--output", str(out), "--no-plot", "--no-warmup"])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["config"]["prefill"].startswith("real")
    runs = {r["mode"]: r for r in record["results"]}
    assert set(runs) == set(multiturn.MODES)
    for mode, r in runs.items():
        assert "failed" not in r, r
        assert len(r["turns"]) == TURNS
        for t, turn in enumerate(r["turns"]):
            # Turn t's prompts: the first prompt, t earlier turns' user and generated tokens,
            # and this turn's user tokens.
            assert turn["prompt_tokens_submitted"] == N * (FIRST + t * (USER + GEN) + USER)
            assert turn["generated_tokens"] == N * GEN
            assert 0 < turn["ttft_s_p50"] <= turn["ttft_s_p95"] <= turn["wall_s"]
            if mode != "hisparse-reuse" or t == 0:
                assert turn["prompt_tokens_computed"] == turn["prompt_tokens_submitted"], (
                    mode, turn)
            else:
                # Only the new tokens (this turn's user tokens, the last turn's generated
                # ones, and at most the partly written page before them) are computed.
                assert turn["prompt_tokens_computed"] <= N * (USER + GEN + B), turn
                assert turn["prompt_tokens_reused"] == (turn["prompt_tokens_submitted"]
                                                        - turn["prompt_tokens_computed"])
    ratios = record["ratios"]
    assert set(ratios) >= {"ttft_p50_hisparse_over_reuse", "throughput_reuse_over_hisparse",
                           "throughput_reuse_over_all-resident"}
    reuse = runs["hisparse-reuse"]
    assert ratios["throughput_reuse_over_hisparse"] == pytest.approx(
        reuse["processed_tokens_per_s"] / runs["hisparse"]["processed_tokens_per_s"])


def test_multiturn_benchmark_checks_its_flags():
    from bench import multiturn

    with pytest.raises(SystemExit, match="--user-tokens must be >= 1"):
        multiturn.main(["--user-tokens", "0"])
    with pytest.raises(SystemExit):
        multiturn.main(["--modes", "hisparse,bogus"])
