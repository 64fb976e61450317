"""bench/xla_schedule.py (reading a compiled program's schedule) and bench/stream_overlap.py
(its CPU smoke run)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from bench import stream_overlap
from bench.xla_schedule import entry_schedule, main

_START = ('%call-start = ((bf16[8,4]{1,0:S(5)}), bf16[2,4]{1,0}) async-start(%a), '
          'calls=%async_computation, frontend_attributes={_xla_stream_annotation="1"}')
_GEMM = ('%custom-call.3 = (f32[16,16]{1,0}, s8[64]{0}) custom-call(%b, %b), '
         'custom_call_target="__cublas$lt$matmul"')
_DONE = ('%call-done = bf16[2,4]{1,0} async-done(%call-start), '
         'frontend_attributes={_xla_stream_annotation="1"}')
_HLO = f"""HloModule jit_step, is_scheduled=true

%async_computation (p: bf16[8,4]) -> bf16[2,4] {{
  %p = bf16[8,4]{{1,0}} parameter(0)
  ROOT %s = bf16[2,4]{{1,0}} slice(%p), slice={{[0:2], [0:4]}}
}}

ENTRY %main (a: bf16[8,4], b: f32[16,16]) -> (bf16[2,4], f32[16,16]) {{
  %a = bf16[8,4]{{1,0:S(5)}} parameter(0)
  %b = f32[16,16]{{1,0}} parameter(1)
  {_START}
  {_GEMM}
  %gte = f32[16,16]{{1,0}} get-tuple-element(%custom-call.3), index=0
  {_DONE}
  ROOT %t = (bf16[2,4]{{1,0}}, f32[16,16]{{1,0}}) tuple(%call-done, %gte)
}}
"""


def test_entry_schedule_lists_the_work_in_order_with_streams_and_targets():
    assert entry_schedule(_HLO) == [
        "async-start call-start stream=1",
        "custom-call custom-call.3 __cublas$lt$matmul",
        "async-done call-done stream=1",
    ]


def test_the_schedule_of_a_dump_directory(tmp_path, capsys):
    (tmp_path / "module_0001.jit_step.sm_9.0a_gpu_after_optimizations.txt").write_text(_HLO)
    (tmp_path / "module_0002.jit_other.sm_9.0a_gpu_after_optimizations.txt").write_text(_HLO)
    out = tmp_path / "schedule.txt"
    main([str(tmp_path), "--module", "jit_step", "--output", str(out)])
    text = out.read_text()
    assert "module_0001.jit_step" in text and "jit_other" not in text
    assert "async-start call-start stream=1" in text


def test_stream_overlap_runs_on_the_cpu(tmp_path):
    # Off the GPU the stream is ignored: no asynchronous call, and the copies land all the
    # same (the program's cache equals the main-stream program's).
    r = stream_overlap.case(n=3, misses=4, work=1, dim=32, reps=1, programs_list=(None, 2))
    assert [(s["copy_programs"], s["early_async_start"]) for s in r["stream"]] == [
        (None, False), (None, True), (2, False), (2, True)]
    for s in r["stream"]:
        assert s["async_call"] is False and s["kernels_between_start_and_done"] == 0
        assert s["stream_wall_ms"] > 0 and s["copies_only_wall_ms"] > 0
    assert r["staging_mib"] == 3 * 4 * 576 * 2 / 2**20
    assert r["main_wall_ms"] > 0 and r["work_only_wall_ms"] > 0
    out = tmp_path / "so.json"
    stream_overlap.main(["--n", "2", "--misses", "2", "--work", "1", "--dim", "16",
                         "--reps", "1", "--programs", "grid,1", "--output", str(out),
                         "--dump", str(tmp_path / "hlo")])
    assert [r["n"] for r in json.loads(out.read_text())["results"]] == [2]
    assert sorted(f.name for f in (tmp_path / "hlo").iterdir()) == [
        "stream_overlap-n2-p1-early.txt", "stream_overlap-n2-p1.txt",
        "stream_overlap-n2-pgrid-early.txt", "stream_overlap-n2-pgrid.txt"]


def test_the_stream_program_lands_what_the_main_stream_program_lands():
    outs = []
    for stream in (True, False):
        fn = stream_overlap._program(stream, work=1, programs=None if stream else 1)
        pinned = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
        pool = jax.device_put(jnp.arange(64 * 576, dtype=jnp.float32).reshape(64, 576)
                              .astype(jnp.bfloat16), pinned)
        src = jnp.asarray([[5, 9], [63, 0]], jnp.int32)
        dst = jnp.asarray([[1, 2], [70, 3]], jnp.int32)
        eye = jnp.eye(8, dtype=jnp.bfloat16)
        args = (pool, jnp.zeros((2, 64, 576), jnp.bfloat16), src, dst,
                jnp.asarray([2, 1], jnp.int32), eye, eye)
        outs.append(fn(*args))
    (cache_s, x_s), (cache_m, x_m) = outs
    np.testing.assert_array_equal(np.asarray(cache_s), np.asarray(cache_m))
    np.testing.assert_array_equal(np.asarray(x_s), np.asarray(x_m))
    flat, pool = np.asarray(cache_s).reshape(-1, 576), np.asarray(args[0])
    assert (flat[1] == pool[5]).all() and (flat[70] == pool[63]).all()
    assert not flat[3].any()  # past row 1's count: not copied
