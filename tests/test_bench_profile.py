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
        "--output", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    host = record["host"]
    assert record["running"] == 6 and host["timed_steps"] == 3
    assert set(host["phases_ms"]) == {label for _, _, label in profile_step.PHASES}
    # The phases are parts of the step: their sum cannot exceed it.
    total = sum(v["mean"] for v in host["phases_ms"].values())
    assert 0 < total <= host["step_ms"]["mean"] + 1e-6
    assert host["phases_ms"]["decode inputs + jitted dispatch"]["mean"] > 0
    assert (tmp_path / "trace").exists() and out.with_suffix(".md").exists()
