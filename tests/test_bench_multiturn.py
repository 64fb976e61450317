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
        "--modes", ",".join(multiturn.MODES), "--output", str(out), "--no-plot", "--no-warmup"])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["config"]["prefill"].startswith("real")
    assert record["config"]["all_resident_seats"] == N  # the default budget holds them all
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
            if "-reuse" not in mode or t == 0:
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
                           "throughput_reuse_over_all-resident",
                           "throughput_reuse_over_all-resident-reuse"}
    for mode in ("hisparse", "all-resident-reuse", "all-resident"):
        assert ratios[f"tokens_identical_to_{mode}"], mode
    # Asynchronous scheduling against the same features synchronous: the same tokens.
    assert ratios["tokens_identical_async_sync"]
    assert ratios["throughput_async_over_sync"] == pytest.approx(
        runs["hisparse-reuse-async"]["processed_tokens_per_s"]
        / runs["hisparse-reuse"]["processed_tokens_per_s"])
    reuse = runs["hisparse-reuse"]
    assert ratios["throughput_reuse_over_hisparse"] == pytest.approx(
        reuse["processed_tokens_per_s"] / runs["hisparse"]["processed_tokens_per_s"])


def test_multiturn_benchmark_checks_its_flags():
    from bench import multiturn

    with pytest.raises(SystemExit, match="--user-tokens must be >= 1"):
        multiturn.main(["--user-tokens", "0"])
    with pytest.raises(SystemExit):
        multiturn.main(["--modes", "hisparse,bogus"])


def test_all_resident_seats_what_the_budget_holds(tmp_path):
    # A budget of 2 full conversations (+ the null block) for 3: all-resident seats 2, the
    # third waits. Turns in rounds defeat the seats' LRU: turn 1's first prompt (conversation
    # 0, kept nowhere) takes the row kept longest ago (conversation 1's), the second the other
    # one, so nothing is reused; tokens equal those of the mode without reuse.
    from bench import multiturn

    out = tmp_path / "mt.json"
    pages = -(-(FIRST + 2 * (USER + GEN) + B) // B)
    rc = multiturn.main([
        "--config", "tiny", "--conversations", str(N), "--turns", "2",
        "--first-prompt", str(FIRST), "--user-tokens", str(USER), "--gen-tokens", str(GEN),
        "--block-size", str(B), "--prefill-chunk-size", "32", "--ttft-from-turn", "1",
        "--gpu-blocks", str(2 * pages + 1), "--modes", "all-resident-reuse,all-resident",
        "--output", str(out), "--no-plot", "--no-warmup"])
    assert rc == 0
    record = json.loads(out.read_text())
    assert record["config"]["all_resident_seats"] == 2
    runs = {r["mode"]: r for r in record["results"]}
    assert {r["seats"] for r in runs.values()} == {2}
    assert runs["all-resident-reuse"]["tokens"] == runs["all-resident"]["tokens"]
    assert runs["all-resident-reuse"]["turns"][1]["prompt_tokens_reused"] == 0


def test_a_budget_without_room_for_one_conversation_is_refused():
    from bench import multiturn

    with pytest.raises(SystemExit, match="mode all-resident-reuse: the GPU KV budget of 5 "
                                         "blocks holds no full conversation"):
        multiturn.main(["--config", "tiny", "--gpu-blocks", "5"])
