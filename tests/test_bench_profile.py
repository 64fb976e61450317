"""The step profiler's trace arithmetic (synthetic traces) and a tiny CPU run of it."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st


def _meta(pid, tid=None, process=None, thread=None):
    if process is not None:
        return {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": process}}
    return {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}}


def _x(pid, tid, name, ts, dur):
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 100), st.integers(0, 30)), max_size=12))
def test_union_length_counts_each_covered_instant_once(pairs):
    from bench.profile_step import union_length

    intervals = [(s, s + d) for s, d in pairs]
    covered = {t for s, e in intervals for t in range(s, e)}  # unit cells [t, t + 1)
    assert union_length(intervals) == len(covered)


def test_device_summary_keeps_gpu_streams_and_splits_categories():
    from bench.profile_step import device_events, summarise_device

    trace = {"traceEvents": [
        _meta(1, process="/device:GPU:0"), _meta(2, process="/host:CPU"),
        _meta(1, 10, thread="Stream #13(compute)"), _meta(1, 11, thread="Stream #14(copy)"),
        _meta(1, 12, thread="XLA Ops"),
        _x(1, 10, "sparse_mla_decode_kernel", 0, 100),
        _x(1, 10, "resolve_residency", 100, 20),
        _x(1, 11, "MemcpyH2D", 50, 100),           # overlaps the attention on another stream
        _x(1, 10, "nvjet_tst_gemm", 200, 40),
        _x(1, 10, "loop_add_fusion", 300, 10),
        _x(1, 12, "sparse_mla_decode_kernel", 0, 100),  # derived line: not counted again
        _x(2, 99, "PjitFunction(step)", 0, 500),         # host event
    ]}
    events = device_events(trace)
    assert sorted(e["name"] for e in events) == sorted(
        ["sparse_mla_decode_kernel", "resolve_residency", "MemcpyH2D", "nvjet_tst_gemm",
         "loop_add_fusion"])
    s = summarise_device(events, num_steps=2)
    assert s["busy_us_per_step"] == pytest.approx((150 + 40 + 10) / 2)
    assert s["span_us_per_step"] == pytest.approx(310 / 2)
    cats = s["kernel_us_per_step_by_category"]
    assert cats["attention (sparse MLA)"] == pytest.approx(50)
    assert cats["resolve residency"] == pytest.approx(10)
    assert cats["memcpy host -> device"] == pytest.approx(50)
    assert cats["GEMM"] == pytest.approx(20)
    assert cats["other XLA fusions"] == pytest.approx(5)
    assert s["top_kernels"][0]["name"] in ("sparse_mla_decode_kernel", "MemcpyH2D")


def test_profile_step_runs_on_cpu_and_times_every_phase(tmp_path):
    from bench import profile_step

    out = tmp_path / "profile.json"
    rc = profile_step.main([
        "--config", "tiny", "--context", "256", "--gen-budget", "64", "--block-size", "16",
        "--concurrency", "6", "--budget-concurrency", "6", "--warmup-steps", "1",
        "--steps", "3", "--profile-steps", "1", "--trace-dir", str(tmp_path / "trace"),
        "--floors", "--floor-reps", "1", "--output", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    host = record["host"]
    assert record["running"] == 6 and host["timed_steps"] == 3
    assert set(host["phases_ms"]) == {label for _, _, label in profile_step.PHASES}
    # The phases are parts of the step: their sum cannot exceed it.
    total = sum(v["mean"] for v in host["phases_ms"].values())
    assert 0 < total <= host["step_ms"]["mean"] + 1e-6
    assert host["phases_ms"]["decode inputs + jitted dispatch"]["mean"] > 0
    # One record per timed step, whose phases fit inside its wall time.
    assert len(host["per_step"]) == 3
    for rec in host["per_step"]:
        phases = sum(rec[method] for _, method, _ in profile_step.PHASES)
        assert 0 < phases <= rec["step_ms"] + 1e-6 and rec["running"] == 6
    assert host["tail"]["step_ms_max"] == pytest.approx(max(s["step_ms"] for s in
                                                            host["per_step"]))
    iso = record["isolated"]
    assert iso["attention_shape"]["N"] == 6 and iso["attention_us_per_layer"] > 0
    assert (tmp_path / "trace").exists() and out.with_suffix(".md").exists()


def _timer_with(steps):
    from bench.profile_step import PHASES, PhaseTimer

    timer = PhaseTimer.__new__(PhaseTimer)
    base = {method: 0.5 for _, method, _ in PHASES}
    timer.per_step = [{**base, "step_ms": ms, "gc_ms": gc_ms, "gc_gen0": 0, "gc_gen1": 0,
                       "gc_gen2": int(gc_ms > 0), "drains": 0, "rows_from_host": 10,
                       "running": 4, **extra}
                      for ms, gc_ms, extra in steps]
    return timer


def test_tail_names_the_slow_steps_and_the_phase_that_grew():
    steps = [(4.0, 0.0, {})] * 18 + [(9.0, 0.0, {"wait": 5.5}), (7.0, 2.5, {})]
    tail = _timer_with(steps).tail(factor=1.5)
    assert [s["index"] for s in tail["slow_steps"]] == [18, 19]
    assert tail["slow_steps"][0]["phase_excess_ms"] == {"wait": pytest.approx(5.0)}
    assert tail["slow_steps"][1]["phase_excess_ms"] == {}
    assert tail["slow_steps"][1]["gc_ms"] == pytest.approx(2.5)
    assert tail["gc_gen2_collections"] == 1 and tail["step_ms_max"] == 9.0
    # A step at exactly 1.5 x the median is not slow.
    assert _timer_with([(4.0, 0.0, {})] * 3 + [(6.0, 0.0, {})]).tail()["slow_steps"] == []


def test_floors_take_the_lower_of_in_step_and_alone_and_compare_the_p50():
    from bench.profile_step import floors_table

    result = {"host": {"step_ms": {"p50": 6.0}},
              "device": {"kernel_us_per_step_by_category": {
                  "attention (sparse MLA)": 1600.0, "host -> device gather": 1900.0,
                  "GEMM": 1500.0}},
              "isolated": {"attention_us_per_step": 1700.0, "gather_us_per_step": 1800.0}}
    f = floors_table(result)
    assert f["parts"]["attention (sparse MLA)"]["floor_us"] == 1600.0   # in-step lower
    assert f["parts"]["host -> device gather"]["floor_us"] == 1800.0    # alone lower
    assert f["parts"]["GEMM"]["alone_us"] is None and f["parts"]["GEMM"]["floor_us"] == 1500.0
    assert f["sum_us"] == 4900.0
    assert f["step_p50_over_floors"] == pytest.approx(6000.0 / 4900.0)
    assert floors_table({"host": {"step_ms": {"p50": 1.0}}, "device": {"events": 0}}) is None
