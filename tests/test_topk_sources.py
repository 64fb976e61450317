"""External top-k sources: the drift model's exact turnover and the trace file format."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hisparse_jax.topk_sources import DriftTopK, TraceTopK, record, save_trace


@given(turnover=st.sampled_from([0.0, 0.02, 0.05, 0.25, 1.0]),
       top_k=st.sampled_from([1, 8, 16, 33]),
       contexts=st.lists(st.integers(1, 300), min_size=1, max_size=3),
       num_groups=st.integers(1, 2))
def test_drift_sets_are_distinct_in_context_and_turn_over_exactly(turnover, top_k, contexts,
                                                                   num_groups):
    steps = 4
    t = record(DriftTopK(turnover, seed=3), contexts=contexts, steps=steps,
               num_groups=num_groups, top_k=top_k)
    assert t.shape == (len(contexts), steps, num_groups, top_k) and t.dtype == np.int32
    shift = int(round(turnover * top_k))
    for r, ctx in enumerate(contexts):
        for s in range(steps):
            for g in range(num_groups):
                row = t[r, s, g]
                valid = row[row >= 0]
                assert len(valid) == min(ctx, top_k)  # -1 only where the prompt is short
                assert (row[:len(valid)] >= 0).all()
                assert len(set(valid.tolist())) == len(valid)
                assert valid.max() < ctx
                if s and ctx >= top_k + shift:
                    prev = set(t[r, s - 1, g].tolist())
                    assert len(prev - set(row.tolist())) == shift  # exact set turnover


def test_drift_is_deterministic_per_request_and_differs_between_requests():
    a = record(DriftTopK(0.1, seed=1), contexts=[500, 500], steps=2, num_groups=1, top_k=64)
    b = record(DriftTopK(0.1, seed=1), contexts=[500, 500], steps=2, num_groups=1, top_k=64)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a[0], a[1])
    with pytest.raises(ValueError, match="turnover"):
        DriftTopK(1.5)


def test_trace_round_trip_and_validation(tmp_path):
    t = record(DriftTopK(0.25), contexts=[40, 7], steps=3, num_groups=2, top_k=16)
    path = tmp_path / "trace.npz"
    save_trace(path, t, description="drift 25%")
    src = TraceTopK.load(path)
    np.testing.assert_array_equal(src.topk, t)
    assert src.description == "drift 25%" and (src.num_groups, src.top_k) == (2, 16)
    # Replaying reproduces the recorded steps (and wraps around after the last one).
    again = record(src, contexts=[40, 7], steps=4, num_groups=2, top_k=16)
    np.testing.assert_array_equal(again[:, :3], t)
    np.testing.assert_array_equal(again[:, 3], t[:, 0])
    # A one-group trace serves every group.
    shared = TraceTopK(t[:, :, 0])
    assert shared.num_groups == 1
    with pytest.raises(ValueError, match="top_k"):
        shared.init_state(max_seats=2, max_model_len=64, num_groups=2, top_k=8)
    with pytest.raises(ValueError, match="index groups"):
        src.init_state(max_seats=2, max_model_len=64, num_groups=3, top_k=16)
    bad = t.copy()
    bad[0, 1, 0, 1] = bad[0, 1, 0, 0]
    with pytest.raises(ValueError, match="repeats"):
        TraceTopK(bad)
    with pytest.raises(ValueError, match="shape"):
        TraceTopK(np.zeros((3, 4), np.int32))
    with pytest.raises(ValueError, match=">= 0 or -1"):
        TraceTopK(np.full((1, 1, 2), -3))
    np.savez(tmp_path / "empty.npz", other=np.zeros(3))
    with pytest.raises(ValueError, match="no 'topk'"):
        TraceTopK.load(tmp_path / "empty.npz")
