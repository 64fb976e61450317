"""FlashMLA's sm90 sparse fp8 decode timed at our attention benchmark's shapes, in one call.

  python3 bench/flashmla_side_by_side.py --json OUT.json [--shapes 64x128,256x128,64x16]
      [--ours triton,row] [--budget-s 560]
  python3 bench/flashmla_side_by_side.py --check-bundle          # CPU: sources, includes
  python3 bench/flashmla_side_by_side.py --make-bundle FLASHMLA_TREE CUTLASS_TREE

The kernel is FlashMLA's (github.com/deepseek-ai/FlashMLA) sparse decode over DeepSeek-V3.2's
fp8 KV rows, the layout our fp8_ds_mla rows have: uint8[656] a row, 512 e4m3 latent bytes,
four float32 scales (one per 128 latent values: value = e4m3 * scale), 64 bf16 rope values;
FlashMLA reads them as a paged cache [num_blocks, page_block_size, 1, 656] with the row index
block * page_block_size + offset, which on a contiguous cache is the flat row number.

Its sources live in `.flashmla/` at the repository root (untracked; `--make-bundle` writes it
from a FlashMLA tree and the cutlass tree its submodule pins): the sm90 sparse fp8 decode
kernels (V3.2 layout, 64 and 128 query heads), the scheduling-metadata kernel, the split-K
combine kernel, kerutils, and the cutlass/cute headers they include. FlashMLA's own binding
(csrc/api) also pulls in its dense, prefill and sm100 kernels, so this script writes a small
binding of its own (`BINDING`, two torch custom ops) and builds with nvcc directly: every .cu
file compiled in parallel (one nvcc process each, `--jobs`), then linked into one shared
library loaded with torch.ops.load_library. No ninja, no setuptools; the per-file compile
seconds are recorded. The build directory is keyed by the sources and flags, so a second run
on a warm machine reuses it.

Per shape (N query rows, h_q heads, K = 2048 distinct random rows each out of a cache of
`--cache-rows` rows, 4 rotating input sets so that one call's rows are not the next call's L2
hits): the scheduling metadata is computed once (FlashMLA computes it on the first call and
reuses it), then each call runs the decode kernel and the combine kernel. Timed with CUDA
events (per call, median of `--iters`; and one event pair around all of them) and with
torch.profiler (device time of each kernel per call; `kernel_us` is the longest, the decode
kernel, as in `bench/ncu_kernels.py sweep`; `device_us` the sum). TFLOP/s = 2 N h_q K
(576 + 512) / time, our benchmarks' count. FlashMLA's sm90 kernel takes 64 or 128 heads only:
h_q = 16 runs with the query zero-padded to 64 heads (what a deployment does), and both the
useful (16-head) and the launched (64-head) rates are written.

Before timing, FlashMLA's output on small shapes is checked against a float32 reference
(dequantized rows, softmax attention; a row index of -1 is a hole), which also checks the byte
layout. `--ours NAMES`: afterwards, in a subprocess (jax must not share the process with
torch's allocator), our attention at the same shapes through `bench.ncu_kernels`' sweep
measurement (`_sweep_one`: correctness, wall, jax-profiler kernel and device time) for the
named candidates (`triton`, `row`, `row_noshare`, ...: the row-copy ones are
`bench.ops.sparse_mla_decode.mosaic_row_variants`), fp8_ds_mla rows.

A failing build writes the JSON with the compiler's error and exits 0, so that the suite call
goes on. The JSON is rewritten after every figure.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUNDLE = REPO / ".flashmla"
TOP_K, D_QK, D_V, ROW_BYTES = 2048, 576, 512, 656
NOPE, TILE = 512, 128                     # latent values; values per scale
SM_SCALE = 1.0 / 192.0 ** 0.5              # bench/ops/sparse_mla_decode.py's SM_SCALE
PAGE_BLOCK = 64
DEFAULT_CACHE_ROWS = 1 << 19               # bench/ops/sparse_mla_decode.py's POOL_ROWS

# The .cu files of the sm90 sparse fp8 decode path (relative to .flashmla/csrc), the only
# ones setup.py's list that it needs: V3.2 layout at 64 and 128 heads, the metadata kernel,
# the combine kernel. The MODEL1 layout, dense decode, prefill and sm100 files are left out.
SOURCES = (
    "sm90/decode/sparse_fp8/instantiations/v32_persistent_h128.cu",
    "sm90/decode/sparse_fp8/instantiations/v32_persistent_h64.cu",
    "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.cu",
    "smxx/decode/combine/combine.cu",
)
# setup.py's include_dirs, relative to .flashmla/
INCLUDE_DIRS = ("csrc", "csrc/kerutils/include", "csrc/sm90", "cutlass/include")
# setup.py's nvcc flags for sm90 (its sm100 target and --threads dropped), less --source-in-ptx
# (PTX text only) and --warn-on-double-precision-use, with the fp16 combine instantiation off
# (bf16 only here). ptxas' -v report (registers, spills) goes to each unit's build log.
NVCC_FLAGS = (
    "-O3", "-std=c++20", "-DNDEBUG", "-D_USE_MATH_DEFINES", "-Wno-deprecated-declarations",
    "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math",
    "--ptxas-options=-v,--register-usage-level=10,--warn-on-spills,--warn-on-local-memory-usage",
    "-lineinfo", "-DFLASH_MLA_DISABLE_FP16",
    "-gencode", "arch=compute_90a,code=sm_90a",
    "-Xcompiler", "-fPIC",
)

# Our binding: two torch custom ops over FlashMLA's kernels (the V3.2 fp8 layout only).
#   flashmla_bench.sched_meta(q, indices) -> (sched_meta int32 [parts, 8], num_splits [b+1])
#   flashmla_bench.sparse_decode(q, kv, indices, sched_meta, num_splits, sm_scale)
#       -> (out bf16 [b, s_q, h_q, 512], lse float32 [b, s_q, h_q])
# q bf16 [b, s_q, h_q, 576], h_q 64 or 128; kv uint8 [num_blocks, page_block_size, 1, 656]
# (rows contiguous); indices int32 [b, s_q, topk], topk a multiple of 64, -1 = no row.
BINDING = r"""
#include <algorithm>
#include <climits>
#include <tuple>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "params.h"
#include "sm90/decode/sparse_fp8/splitkv_mla.h"
#include "smxx/decode/combine/combine.h"
#include "smxx/decode/get_decoding_sched_meta/get_decoding_sched_meta.h"

namespace {

constexpr int kDqk = 576, kDv = 512, kRowBytes = 656, kTopkBlock = 64, kOverheadBlocks = 5;

int narrow(int64_t v, const char* what) {
  TORCH_CHECK(v >= 0 && v <= INT_MAX, what, " does not fit in int32: ", v);
  return static_cast<int>(v);
}

// Work parts of the split-K schedule: one per multiprocessor and 64-head group.
int sm_parts(const at::Tensor& q) {
  int dev = q.get_device(), sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  int groups = static_cast<int>(q.size(2)) / 64;
  return std::max(sms / static_cast<int>(q.size(1)) / groups, 1);
}

void check_q_indices(const at::Tensor& q, const at::Tensor& indices) {
  TORCH_CHECK(q.is_cuda() && q.dim() == 4 && q.scalar_type() == at::kBFloat16
              && q.stride(3) == 1, "q must be a CUDA bf16 [b, s_q, h_q, 576] tensor");
  TORCH_CHECK(q.size(3) == kDqk, "q's last dim must be 576, got ", q.size(3));
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "h_q must be 64 or 128, got ", q.size(2));
  TORCH_CHECK(indices.is_cuda() && indices.scalar_type() == at::kInt && indices.dim() == 3
              && indices.stride(2) == 1, "indices must be a CUDA int32 [b, s_q, topk] tensor");
  TORCH_CHECK(indices.size(0) == q.size(0) && indices.size(1) == q.size(1),
              "indices' [b, s_q] must be q's");
  TORCH_CHECK(indices.size(2) > 0 && indices.size(2) % kTopkBlock == 0,
              "topk must be a positive multiple of 64, got ", indices.size(2));
}

std::tuple<at::Tensor, at::Tensor> sched_meta(const at::Tensor& q, const at::Tensor& indices) {
  check_q_indices(q, indices);
  c10::cuda::CUDAGuard guard(q.device());
  int b = narrow(q.size(0), "b"), parts = sm_parts(q);
  auto iopts = q.options().dtype(at::kInt);
  at::Tensor meta = at::empty({parts, int64_t(sizeof(DecodingSchedMeta) / sizeof(int))}, iopts);
  at::Tensor splits = at::empty({b + 1}, iopts);
  GetDecodeSchedMetaParams p{};
  p.b = b;
  p.s_q = narrow(q.size(1), "s_q");
  p.block_size_n = kTopkBlock;
  p.fixed_overhead_num_blocks = kOverheadBlocks;
  p.topk = narrow(indices.size(2), "topk");
  p.extra_topk = 0;
  p.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(meta.data_ptr());
  p.num_splits_ptr = splits.data_ptr<int>();
  p.num_sm_parts = parts;
  p.stream = c10::cuda::getCurrentCUDAStream().stream();
  smxx::decode::run_get_decoding_sched_meta_kernel(p);
  return {meta, splits};
}

void check_kv_meta(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& meta,
                   const at::Tensor& splits) {
  TORCH_CHECK(kv.is_cuda() && kv.dim() == 4 && kv.size(2) == 1 && kv.size(3) == kRowBytes
              && kv.stride(3) == 1 && kv.stride(1) == kRowBytes
              && (kv.scalar_type() == at::kByte || kv.scalar_type() == at::kChar),
              "kv must be a CUDA uint8 [num_blocks, page_block_size, 1, 656] tensor with "
              "contiguous rows");
  TORCH_CHECK(meta.is_cuda() && meta.is_contiguous() && meta.scalar_type() == at::kInt
              && meta.dim() == 2 && meta.size(0) == sm_parts(q),
              "sched_meta must be sched_meta(q, indices)'s first result for this q");
  TORCH_CHECK(splits.is_cuda() && splits.is_contiguous() && splits.scalar_type() == at::kInt
              && splits.numel() == q.size(0) + 1, "num_splits must be int32 [b + 1]");
}

std::tuple<at::Tensor, at::Tensor> sparse_decode(
    const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indices,
    const at::Tensor& meta, const at::Tensor& splits, double sm_scale) {
  check_q_indices(q, indices);
  check_kv_meta(q, kv, meta, splits);
  c10::cuda::CUDAGuard guard(q.device());
  int b = narrow(q.size(0), "b"), s_q = narrow(q.size(1), "s_q");
  int h_q = narrow(q.size(2), "h_q"), parts = narrow(meta.size(0), "parts");
  auto fopts = q.options().dtype(at::kFloat);
  at::Tensor out = at::empty({b, s_q, h_q, kDv}, q.options());
  at::Tensor lse = at::empty({b, s_q, h_q}, fopts);
  at::Tensor lse_acc = at::empty({b + parts, s_q, h_q}, fopts);
  at::Tensor o_acc = at::empty({b + parts, s_q, h_q, kDv}, fopts);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  SparseAttnDecodeParams p{};
  p.b = b; p.s_q = s_q; p.h_q = h_q; p.h_kv = 1; p.d_qk = kDqk; p.d_v = kDv;
  p.sm_scale = static_cast<float>(sm_scale);
  p.sm_scale_div_log2 = static_cast<float>(sm_scale * 1.4426950408889634);
  p.num_blocks = narrow(kv.size(0), "num_blocks");
  p.page_block_size = narrow(kv.size(1), "page_block_size");
  p.topk = narrow(indices.size(2), "topk");
  p.model_type = ModelType::V32;
  p.q = reinterpret_cast<cutlass::bfloat16_t*>(q.data_ptr());
  p.kv = reinterpret_cast<cutlass::bfloat16_t*>(kv.data_ptr());
  p.indices = indices.data_ptr<int>();
  p.lse = lse.data_ptr<float>();
  p.out = reinterpret_cast<cutlass::bfloat16_t*>(out.data_ptr());
  p.stride_q_b = narrow(q.stride(0), "q stride");
  p.stride_q_s_q = narrow(q.stride(1), "q stride");
  p.stride_q_h_q = narrow(q.stride(2), "q stride");
  p.stride_kv_block = narrow(kv.stride(0), "kv stride");
  p.stride_kv_row = narrow(kv.stride(1), "kv stride");
  p.stride_indices_b = narrow(indices.stride(0), "indices stride");
  p.stride_indices_s_q = narrow(indices.stride(1), "indices stride");
  p.stride_lse_b = narrow(lse.stride(0), "lse stride");
  p.stride_lse_s_q = narrow(lse.stride(1), "lse stride");
  p.stride_o_b = narrow(out.stride(0), "out stride");
  p.stride_o_s_q = narrow(out.stride(1), "out stride");
  p.stride_o_h_q = narrow(out.stride(2), "out stride");
  p.stream = stream;
  p.lse_accum = lse_acc.data_ptr<float>();
  p.o_accum = o_acc.data_ptr<float>();
  p.stride_lse_accum_split = narrow(lse_acc.stride(0), "lse_accum stride");
  p.stride_lse_accum_s_q = narrow(lse_acc.stride(1), "lse_accum stride");
  p.stride_o_accum_split = narrow(o_acc.stride(0), "o_accum stride");
  p.stride_o_accum_s_q = narrow(o_acc.stride(1), "o_accum stride");
  p.stride_o_accum_h_q = narrow(o_acc.stride(2), "o_accum stride");
  p.tile_scheduler_metadata_ptr = reinterpret_cast<DecodingSchedMeta*>(meta.data_ptr());
  p.num_splits_ptr = splits.data_ptr<int>();
  p.num_sm_parts = parts;
  if (h_q == 128) {
    sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 128>(p);
  } else {
    sm90::decode::sparse_fp8::run_flash_splitkv_mla_fp8_sparse_kernel<ModelType::V32, 64>(p);
  }

  CombineParams c{};
  c.b = b; c.s_q = s_q; c.h_q = h_q; c.d_v = kDv;
  c.lse = p.lse; c.out = p.out;
  c.stride_lse_b = p.stride_lse_b; c.stride_lse_s_q = p.stride_lse_s_q;
  c.stride_o_b = p.stride_o_b; c.stride_o_s_q = p.stride_o_s_q; c.stride_o_h_q = p.stride_o_h_q;
  c.lse_accum = p.lse_accum; c.o_accum = p.o_accum;
  c.stride_lse_accum_split = p.stride_lse_accum_split;
  c.stride_lse_accum_s_q = p.stride_lse_accum_s_q;
  c.stride_o_accum_split = p.stride_o_accum_split;
  c.stride_o_accum_s_q = p.stride_o_accum_s_q;
  c.stride_o_accum_h_q = p.stride_o_accum_h_q;
  c.tile_scheduler_metadata_ptr = p.tile_scheduler_metadata_ptr;
  c.num_splits_ptr = p.num_splits_ptr;
  c.num_sm_parts = parts;
  c.attn_sink = nullptr;
  c.stream = stream;
  smxx::decode::run_flash_mla_combine_kernel<cutlass::bfloat16_t>(c);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(flashmla_bench, m) {
  m.def("sched_meta(Tensor q, Tensor indices) -> (Tensor, Tensor)");
  m.def("sparse_decode(Tensor q, Tensor kv, Tensor indices, Tensor sched_meta, "
        "Tensor num_splits, float sm_scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(flashmla_bench, CUDA, m) {
  m.impl("sched_meta", &sched_meta);
  m.impl("sparse_decode", &sparse_decode);
}
"""
BINDING_NAME = "flashmla_bench_binding.cu"     # compiled with the same flags (C++20, as
                                               # FlashMLA compiles its binding)


# --- the bundle: which files, which includes --------------------------------------------------

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.M)
_BLOCK_COMMENT = re.compile(r"/\*.*?\*/", re.S)
_LINE_COMMENT = re.compile(r"//[^\n]*")
# Headers of the toolchain and of torch, never in the bundle.
_SYSTEM_FIRST = {"torch", "ATen", "c10", "pybind11", "cuda", "crt", "nv", "cub", "thrust",
                 "cuda_runtime.h", "cuda_runtime_api.h", "cuda.h", "cuda_fp8.h", "cuda_bf16.h",
                 "cuda_fp16.h", "cuda_fp4.h", "cuda_fp6.h", "math_constants.h",
                 "cooperative_groups.h", "mma.h", "vector_types.h", "device_launch_parameters.h",
                 "nvrtc.h", "cudaTypedefs.h", "sm_61_intrinsics.h", "cuda_pipeline.h",
                 "cuda_awbarrier.h", "cuda_pipeline_primitives.h", "cublas_v2.h", "cufft.h",
                 "curand_kernel.h", "nvToolsExt.h", "nvtx3", "cooperative_groups",
                 "cuda_device_runtime_api.h", "texture_types.h", "driver_types.h",
                 "cuda_texture_types.h", "surface_types.h", "host_defines.h", "cuComplex.h",
                 "intrin.h", "immintrin.h", "x86intrin.h", "cpuid.h"}


def _is_system(name: str) -> bool:
    first = name.split("/")[0]
    if first in _SYSTEM_FIRST:
        return True
    # C and C++ standard headers: no extension (<vector>), or the C ones (<stdint.h>, ...).
    return ("/" not in name and "." not in name) or name in {
        "stdint.h", "stdio.h", "stdlib.h", "string.h", "assert.h", "math.h", "limits.h",
        "float.h", "stddef.h", "stdarg.h", "cassert", "unistd.h", "dlfcn.h", "malloc.h",
        "time.h", "errno.h", "inttypes.h", "sys/time.h", "cxxabi.h", "execinfo.h"}


def resolve_includes(roots: list[Path], dirs: list[Path]) -> tuple[set[Path], dict[str, list]]:
    """Every file reachable from `roots` by #include through `dirs` (quoted includes first
    relative to the including file), reading every #include whatever #if guards it (a
    superset of what any one build reads). Returns (files reached, {include name: the files
    that include it} for names found nowhere in `dirs`)."""
    seen: set[Path] = set()
    missing: dict[str, list] = {}
    todo = [p.resolve() for p in roots]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        text = _LINE_COMMENT.sub("", _BLOCK_COMMENT.sub("", path.read_text(errors="replace")))
        for kind, name in _INCLUDE.findall(text):
            places = ([path.parent] if kind == '"' else []) + list(dirs)
            hit = next((d / name for d in places if (d / name).is_file()), None)
            if hit is None:
                missing.setdefault(name, []).append(str(path))
            else:
                todo.append(hit.resolve())
    return seen, missing


def check_bundle(bundle: Path, binding: Path | None = None) -> dict:
    """The bundle's sources exist and every include they reach resolves, in the bundle or
    among the toolchain's and torch's headers (`_is_system`). Returns a summary whose
    `problems` is empty when so."""
    problems = [f"missing source {s}" for s in SOURCES if not (bundle / "csrc" / s).is_file()]
    problems += [f"missing include dir {d}" for d in INCLUDE_DIRS if not (bundle / d).is_dir()]
    if problems:
        return {"problems": problems}
    roots = [bundle / "csrc" / s for s in SOURCES] + ([binding] if binding else [])
    files, missing = resolve_includes(roots, [bundle / d for d in INCLUDE_DIRS])
    unresolved = {n: sorted(set(w))[:3] for n, w in missing.items() if not _is_system(n)}
    problems += [f"unresolved include <{n}> (from {', '.join(w)})" for n, w in unresolved.items()]
    return {"problems": problems, "files_reached": len(files),
            "system_includes": sorted(n for n in missing if _is_system(n))}


def make_bundle(flashmla: Path, cutlass: Path, bundle: Path) -> dict:
    """Writes `bundle` from a FlashMLA tree and a cutlass tree: the files the decode sources
    and the binding reach by #include, nothing else, plus both licenses."""
    src_dirs = [flashmla / "csrc", flashmla / "csrc/kerutils/include", flashmla / "csrc/sm90",
                cutlass / "include"]
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / "flashmla_bench_binding_probe.cu"
    tmp.write_text(BINDING)
    files, _ = resolve_includes([flashmla / "csrc" / s for s in SOURCES] + [tmp], src_dirs)
    files.discard(tmp.resolve())
    if bundle.exists():
        shutil.rmtree(bundle)
    for f in sorted(files):
        for base, dest in ((cutlass / "include", "cutlass/include"), (flashmla / "csrc", "csrc")):
            if f.is_relative_to(base.resolve()):
                target = bundle / dest / f.relative_to(base.resolve())
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)
                break
    shutil.copy2(flashmla / "LICENSE", bundle / "LICENSE.FlashMLA")
    shutil.copy2(cutlass / "LICENSE.txt", bundle / "LICENSE.cutlass")
    return {"files": len(files)}


# --- the build ------------------------------------------------------------------------------

class BuildError(RuntimeError):
    pass


def _run(cmd: list[str], timeout: float | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def toolchain() -> dict:
    """nvcc (CUDA_HOME's, else PATH's), its version, the host compiler's, torch's."""
    import torch
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME or os.environ.get("CUDA_HOME") or ""
    nvcc = str(Path(home) / "bin" / "nvcc") if home else ""
    if not Path(nvcc).is_file():
        nvcc = shutil.which("nvcc") or "nvcc"
    info = {"nvcc": nvcc, "cuda_home": home, "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "cxx11_abi": int(bool(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True)))}
    try:
        info["nvcc_version"] = _run([nvcc, "--version"], 60).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        info["nvcc_version"] = f"unavailable: {e}"
    try:
        info["host_cxx"] = _run(["c++", "--version"], 60).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        info["host_cxx"] = f"unavailable: {e}"
    return info


def _compile(nvcc: str, src: Path, obj: Path, flags: list[str]) -> tuple[str, float, str]:
    """One nvcc -c; an object already built in this (keyed) directory is kept."""
    log_path = obj.parent / (obj.name + ".log")
    if obj.is_file():
        return src.name, 0.0, log_path.read_text() if log_path.is_file() else ""
    t0 = time.time()
    partial = obj.parent / (obj.name + ".partial")
    cmd = [nvcc, *flags, "-c", str(src), "-o", str(partial)]
    r = _run(cmd)
    log = f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    log_path.write_text(log)
    if r.returncode != 0:
        raise BuildError(f"nvcc failed on {src.name} (exit {r.returncode}):\n"
                         + (r.stderr or r.stdout)[-6000:])
    partial.rename(obj)
    return src.name, time.time() - t0, log


def build(bundle: Path, build_root: Path, jobs: int, tc: dict) -> dict:
    """Compiles SOURCES and the binding (one nvcc each, `jobs` at a time), links them into a
    shared library and loads it into torch.ops.flashmla_bench. Returns timings and flags;
    raises BuildError with the compiler's message."""
    import torch
    from torch.utils import cpp_extension

    nvcc = tc["nvcc"]
    torch_inc = cpp_extension.include_paths()
    flags = [*NVCC_FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={tc['cxx11_abi']}",
             *(f"-I{bundle / d}" for d in INCLUDE_DIRS)]
    key = hashlib.sha256(json.dumps([flags, torch_inc, tc["nvcc_version"], BINDING]
                                    + [(bundle / "csrc" / s).read_text() for s in SOURCES])
                         .encode()).hexdigest()[:16]
    out = build_root / key
    lib = out / "libflashmla_bench.so"
    info = {"build_dir": str(out), "nvcc_flags": flags, "sources": list(SOURCES),
            "binding": BINDING_NAME, "jobs": jobs}
    t0 = time.time()
    if not lib.is_file():
        out.mkdir(parents=True, exist_ok=True)
        (out / BINDING_NAME).write_text(BINDING)
        bflags = flags + [f"-I{p}" for p in torch_inc]
        units = [(bundle / "csrc" / s, out / (Path(s).stem + ".o"), flags) for s in SOURCES]
        units.append((out / BINDING_NAME, out / "binding.o", bflags))
        per_file = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            futs = [pool.submit(_compile, nvcc, s, o, f) for s, o, f in units]
            for fut in concurrent.futures.as_completed(futs):
                name, secs, log = fut.result()          # a BuildError propagates
                per_file[name] = round(secs, 1)
                regs = [ln.strip() for ln in log.splitlines() if "registers" in ln]
                print(f"[build] {name}: {secs:.0f} s" + (f"; {regs[-1]}" if regs else ""),
                      flush=True)
        torch_lib = Path(torch.__file__).parent / "lib"
        link = [nvcc, "-shared", "--cudart", "shared", "-o", str(lib),
                *(str(o) for _, o, _ in units), f"-L{torch_lib}",
                "-lc10", "-lc10_cuda", "-ltorch_cpu", "-ltorch_cuda", "-ltorch",
                "-Xlinker", f"-rpath={torch_lib}"]
        r = _run(link)
        if r.returncode != 0:
            raise BuildError(f"link failed (exit {r.returncode}):\n"
                             + (r.stderr or r.stdout)[-6000:])
        info["per_file_s"] = per_file
        info["reused"] = False
    else:
        info["reused"] = True
    info["compile_and_link_s"] = round(time.time() - t0, 1)
    torch.ops.load_library(str(lib))
    return info


# --- inputs and the reference ---------------------------------------------------------------

def make_rows(n_rows: int, seed: int, device):
    """n_rows random fp8 rows, uint8 [n_rows, 656] (the module docstring's layout), from
    standard normal values. The scales are powers of two (amax / 448 rounded up, as FlashMLA's
    tests/quant.py makes them), so the kernel's bf16 copy of a scale and its bf16 dequantized
    values are exact and the float32 reference sees the same numbers."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    rows = torch.empty(n_rows, ROW_BYTES, dtype=torch.uint8, device=device)
    for s in range(0, n_rows, 1 << 16):
        e = min(n_rows, s + (1 << 16))
        x = torch.randn(e - s, D_QK, generator=gen, device=device)
        lat = x[:, :NOPE].reshape(-1, NOPE // TILE, TILE)
        scale = torch.exp2(torch.ceil(torch.log2(lat.abs().amax(-1).clamp_min(1e-4) / 448.0)))
        e4m3 = (lat / scale[..., None]).to(torch.float8_e4m3fn).reshape(-1, NOPE)
        rows[s:e, :NOPE] = e4m3.view(torch.uint8)
        rows[s:e, NOPE:NOPE + 16] = scale.contiguous().view(torch.uint8)
        rows[s:e, NOPE + 16:] = x[:, NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return rows


def dequantize(rows):
    """uint8 [m, 656] -> float32 [m, 576]: latent i = e4m3[i] * scale[i // 128], then rope."""
    import torch

    lat = rows[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[:, NOPE:NOPE + 16].contiguous().view(torch.float32)
    lat = (lat.reshape(-1, NOPE // TILE, TILE) * scale[..., None]).reshape(-1, NOPE)
    rope = rows[:, NOPE + 16:].contiguous().view(torch.bfloat16).float()
    return torch.cat([lat, rope], dim=1)


def reference(q, rows, idx, sm_scale: float):
    """Sparse attention in float32: q bf16 [n, h, 576], rows uint8 [R, 656], idx int32 [n, K]
    (-1: no row). Returns out [n, h, 512] (0 where a query row has no row) and lse [n, h]
    (natural log; +inf where none, FlashMLA's convention)."""
    import torch

    kv = dequantize(rows)
    valid = idx >= 0
    k = kv[idx.clamp_min(0).long()]                              # [n, K, 576]
    s = torch.einsum("nhd,nkd->nhk", q.float(), k) * sm_scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    out = torch.einsum("nhk,nkd->nhd", p, k[..., :D_V])
    return out, torch.where(torch.isinf(lse), float("inf"), lse)


def distinct_indices(n: int, cache_rows: int, k: int, holes: float, seed: int, device):
    """int32 [n, k]: k distinct random rows of [0, cache_rows) per query row, in random order;
    a `holes` fraction of entries set to -1."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    idx = torch.empty(n, k, dtype=torch.int32, device=device)
    for i in range(0, n, 64):
        r = torch.rand(min(64, n - i), cache_rows, generator=gen, device=device)
        idx[i:i + 64] = r.topk(k, dim=1).indices.int()
    if holes > 0:
        idx[torch.rand(n, k, generator=gen, device=device) < holes] = -1
    return idx


def launched_heads(h: int) -> int:
    """FlashMLA's sm90 kernel runs 64 or 128 heads: fewer are zero-padded up."""
    if h > 128:
        raise SystemExit(f"--shapes: h_q must be at most 128 (FlashMLA's sm90 kernel), got {h}")
    return 64 if h <= 64 else 128


def padded_q(n: int, h: int, seed: int, device):
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.zeros(n, 1, launched_heads(h), D_QK, dtype=torch.bfloat16, device=device)
    q[:, :, :h] = torch.randn(n, 1, h, D_QK, generator=gen, device=device).to(torch.bfloat16)
    return q


def decode(q, kv, idx):
    """FlashMLA's decode at q [n, 1, h, 576], idx [n, K]: (out [n, h, 512], lse [n, h])."""
    import torch

    ops = torch.ops.flashmla_bench
    meta, splits = ops.sched_meta(q, idx[:, None, :])
    out, lse = ops.sparse_decode(q, kv, idx[:, None, :], meta, splits, SM_SCALE)
    return out[:, 0], lse[:, 0]


def check(kv_rows, device) -> list[dict]:
    """FlashMLA against `reference` at small shapes: all rows valid (the byte layout), and with
    holes and one query row of no rows (the -1 convention)."""
    import torch

    small = kv_rows[: 1 << 14]
    kv = small.view(-1, PAGE_BLOCK, 1, ROW_BYTES)
    results = []
    for n, h, holes in ((4, 128, 0.0), (4, 64, 0.0), (3, 16, 0.0), (4, 128, 0.05)):
        q = padded_q(n, h, 100 + n + h, device)
        idx = distinct_indices(n, small.shape[0], TOP_K, holes, 7, device)
        if holes:
            idx[0] = -1
        out, lse = decode(q, kv, idx)
        ref_out, ref_lse = reference(q[:, 0, :h], small, idx, SM_SCALE)
        out, lse = out[:, :h].float(), lse[:, :h]
        fin = torch.isfinite(ref_lse)
        entry = {"n": n, "h_q": h, "h_q_launched": launched_heads(h), "holes": holes,
                 "max_abs_err_out": float((out - ref_out).abs().max()),
                 "rel_err_out": float((out - ref_out).norm() / ref_out.norm().clamp_min(1e-30)),
                 "max_abs_err_lse": float((lse[fin] - ref_lse[fin]).abs().max()),
                 "lse_finite_match": bool(torch.equal(torch.isfinite(lse), fin)),
                 "nan": bool(torch.isnan(out).any())}
        entry["correct"] = (entry["rel_err_out"] < 2e-2 and entry["max_abs_err_lse"] < 5e-2
                            and entry["lse_finite_match"] and not entry["nan"])
        results.append(entry)
        print(f"[check] N={n} h={h} holes={holes}: rel_err_out={entry['rel_err_out']:.2e} "
              f"max_abs_err_out={entry['max_abs_err_out']:.2e} "
              f"lse_err={entry['max_abs_err_lse']:.2e} correct={entry['correct']}", flush=True)
    return results


# --- timing ---------------------------------------------------------------------------------

def flops(n: int, h: int) -> float:
    return 2.0 * n * h * TOP_K * (D_QK + D_V)


def _profile_kernels(call, reps: int) -> list[dict]:
    """Device time of every kernel per call over `reps` calls (torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(reps):
            call(i)
        torch.cuda.synchronize()
    kernels = []
    for evt in prof.key_averages():
        if not str(getattr(evt, "device_type", "")).endswith("CUDA"):
            continue
        total = getattr(evt, "self_device_time_total", None)
        if total is None:
            total = getattr(evt, "self_cuda_time_total", 0.0)
        if total > 0:
            kernels.append({"name": evt.key[:140], "us": total / reps,
                            "calls": evt.count / reps})
    return sorted(kernels, key=lambda k: -k["us"])


def _event_times(call, iters: int) -> dict:
    import statistics

    import torch

    per_call = []
    for i in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call(i)
        b.record()
        b.synchronize()
        per_call.append(a.elapsed_time(b) * 1e3)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for i in range(iters):
        call(i)
    b.record()
    b.synchronize()
    return {"events_us_median": statistics.median(per_call), "events_us_min": min(per_call),
            "events_us_back_to_back": a.elapsed_time(b) * 1e3 / iters}


def time_shape(n: int, h: int, kv_rows, args) -> dict:
    """One shape: 4 rotating input sets, the metadata once, then events and the profiler."""
    import torch

    device = kv_rows.device
    kv = kv_rows.view(-1, PAGE_BLOCK, 1, ROW_BYTES)
    sets = [(padded_q(n, h, 1000 * i + n + h, device),
             distinct_indices(n, kv_rows.shape[0], TOP_K, args.holes, 11 + i, device)[:, None])
            for i in range(4)]
    ops = torch.ops.flashmla_bench
    meta, splits = ops.sched_meta(*sets[0])

    def call(i):
        q, idx = sets[i % 4]
        return ops.sparse_decode(q, kv, idx, meta, splits, SM_SCALE)

    for i in range(args.warmup):
        call(i)
    torch.cuda.synchronize()
    entry = {"n": n, "h_q": h, "h_q_launched": launched_heads(h), "top_k": TOP_K,
             "cache_rows": int(kv_rows.shape[0]), "page_block_size": PAGE_BLOCK,
             "holes": args.holes, "num_sm_parts": int(meta.shape[0]), "flops": flops(n, h),
             "iters": args.iters, **_event_times(call, args.iters)}
    kernels = _profile_kernels(call, args.profile_reps)
    entry["kernels"] = kernels
    meta_kernels = _profile_kernels(lambda i: ops.sched_meta(*sets[0]), 5)
    entry["sched_meta_kernel_us"] = meta_kernels[0]["us"] if meta_kernels else None
    if kernels:
        entry["kernel_us"] = kernels[0]["us"]
        entry["device_us"] = sum(k["us"] for k in kernels)
        entry["tflops"] = flops(n, h) / (entry["kernel_us"] * 1e-6) / 1e12
        entry["tflops_device"] = flops(n, h) / (entry["device_us"] * 1e-6) / 1e12
        entry["tflops_launched_heads"] = (flops(n, launched_heads(h))
                                          / (entry["kernel_us"] * 1e-6) / 1e12)
        entry["rows_GBps"] = n * TOP_K * ROW_BYTES / entry["kernel_us"] / 1e3
    entry["tflops_events"] = flops(n, h) / (entry["events_us_median"] * 1e-6) / 1e12
    print(f"[flashmla] N={n:<3} h={h:<3} (launched {entry['h_q_launched']}) "
          f"kernel={entry.get('kernel_us') or 0:.1f}us {entry.get('tflops') or 0:.0f}TF/s "
          f"device={entry.get('device_us') or 0:.1f}us "
          f"events={entry['events_us_median']:.1f}us "
          f"(back-to-back {entry['events_us_back_to_back']:.1f}us)", flush=True)
    return entry


# --- our kernel at the same shapes (a subprocess: jax) ---------------------------------------

def ours_only(names: list[str], shapes: list[tuple[int, int]], path: str, budget_s: float) -> None:
    """Our attention over fp8_ds_mla rows, `bench.ncu_kernels`' sweep measurement, for the
    named candidates at `shapes`; JSON to `path` after every figure."""
    import jax
    import jax.numpy as jnp

    from bench import ncu_kernels
    from bench.ops import sparse_mla_decode as bench
    from pallas_kernels import kv_format as kvf

    t0 = time.time()
    plan = {name: (backend, cfg) for fmt, name, backend, cfg in ncu_kernels._sweep_plan()
            if fmt == kvf.FP8_DS_MLA}
    unknown = [n for n in names if n not in plan]
    if unknown:
        raise SystemExit(f"--ours: unknown candidates {unknown}; known: {sorted(plan)}")
    kv = jax.random.normal(jax.random.key(1), (bench.POOL_ROWS, bench.WIDTH), jnp.bfloat16)
    pools = {kvf.FP8_DS_MLA: jax.block_until_ready(jax.jit(kvf.quantize)(kv))}
    del kv
    payload = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
               "pool_rows": bench.POOL_ROWS, "results": []}
    ref_cache: dict = {}
    for n, h in shapes:
        for name in names:
            if time.time() - t0 > budget_s:
                payload["results"].append({"candidate": name, "n": n, "h_q": h,
                                           "skipped": "time budget"})
                continue
            backend, cfg = plan[name]
            try:
                e = ncu_kernels._sweep_one(kvf.FP8_DS_MLA, name, backend, cfg, n, h, pools,
                                           ref_cache)
            except Exception as ex:  # noqa: BLE001 - record and go on
                e = {"candidate": name, "n": n, "h_q": h,
                     "error": f"{type(ex).__name__}: {ex}"[:3000]}
            e["at_s"] = time.time() - t0
            payload["results"].append(e)
            Path(path).write_text(json.dumps(payload, indent=1, default=str))
            print(f"[ours] {name:>14} N={n:<3} h={h:<3} " + (
                e["error"][:200] if "error" in e else
                f"ok={e['correct']} kernel={e.get('kernel_us') or 0:.1f}us "
                f"{e.get('tflops') or 0:.0f}TF/s device={e.get('device_us') or 0:.1f}us "
                f"wall={e['wall_us']:.1f}us"), flush=True)
    Path(path).write_text(json.dumps(payload, indent=1, default=str))


def _run_ours(args, shapes: list[tuple[int, int]], payload: dict, save, t_start: float) -> None:
    left = args.budget_s - (time.time() - t_start)
    if left < 60:
        payload["ours"] = {"skipped": f"time budget ({left:.0f} s left)"}
        save()
        return
    path = Path(args.json).with_suffix(".ours.json")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--ours-only", args.ours,
           "--shapes", ",".join(f"{n}x{h}" for n, h in shapes), "--json", str(path),
           "--budget-s", str(int(left - 40))]
    print(f"[ours] {' '.join(cmd)}", flush=True)
    try:
        rc = subprocess.run(cmd, env=env, cwd=REPO, timeout=left).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    payload["ours"] = {"exit": rc, **(json.loads(path.read_text()) if path.is_file() else {})}
    save()


# --- main -----------------------------------------------------------------------------------

def _shapes(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(x) for x in s.split("x")) for s in text.split(",") if s]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 or s[1] > 128 for s in shapes):
        raise argparse.ArgumentTypeError(
            f"expected NxH[,NxH...] with N >= 1 and 1 <= H <= 128 (FlashMLA's sm90 kernel runs "
            f"64 or 128 heads; fewer are padded), got {text!r}")
    return shapes


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--json", default="", help="where to write the results (required to time)")
    p.add_argument("--shapes", type=_shapes, default="64x128,256x128,64x16",
                   help="N x h_q, comma-separated")
    p.add_argument("--cache-rows", type=int, default=DEFAULT_CACHE_ROWS,
                   help="rows in the fp8 cache (a multiple of 64; default 2^19, the op "
                        "benchmark's pool)")
    p.add_argument("--holes", type=float, default=0.0,
                   help="fraction of index entries set to -1 in the timed inputs")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--profile-reps", type=int, default=20)
    p.add_argument("--jobs", type=int, default=int(os.environ.get("MAX_JOBS", os.cpu_count() or 4)),
                   help="parallel nvcc processes (default: MAX_JOBS, else the CPU count)")
    p.add_argument("--bundle", default=str(BUNDLE), help="FlashMLA's sources (default: .flashmla/)")
    p.add_argument("--build-dir", default="/tmp/flashmla-bench-build")
    p.add_argument("--no-check", action="store_true", help="skip the reference check")
    p.add_argument("--ours", default="", help="our candidates to time after, e.g. triton,row")
    p.add_argument("--budget-s", type=float, default=560.0,
                   help="wall budget of the whole run; --ours gets what is left")
    p.add_argument("--check-bundle", action="store_true",
                   help="CPU only: the bundle's sources and includes, then exit")
    p.add_argument("--make-bundle", nargs=2, metavar=("FLASHMLA_TREE", "CUTLASS_TREE"),
                   help="write --bundle from these trees, then exit")
    p.add_argument("--ours-only", default="", help=argparse.SUPPRESS)
    return p


def _bundle_modes(args) -> bool:
    bundle = Path(args.bundle)
    if args.make_bundle:
        print(make_bundle(Path(args.make_bundle[0]), Path(args.make_bundle[1]), bundle))
    if args.make_bundle or args.check_bundle:
        probe = Path(os.environ.get("TMPDIR", "/tmp")) / BINDING_NAME
        probe.write_text(BINDING)
        summary = check_bundle(bundle, probe)
        print(json.dumps(summary, indent=1))
        if summary["problems"]:
            raise SystemExit(1)
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    shapes = args.shapes
    if _bundle_modes(args):
        return 0
    if not args.json:
        raise SystemExit("--json PATH is required to build and time")
    if args.ours_only:
        ours_only(args.ours_only.split(","), shapes, args.json, args.budget_s)
        return 0
    if args.cache_rows < TOP_K or args.cache_rows % PAGE_BLOCK:
        raise SystemExit(f"--cache-rows must be a multiple of {PAGE_BLOCK} and at least {TOP_K}")
    t_start = time.time()
    tc = toolchain()
    print(tc["nvcc_version"], flush=True)                  # first: the toolchain in the log
    print(f"torch {tc['torch']} cuda {tc['torch_cuda']}; host compiler {tc['host_cxx']}",
          flush=True)
    return _measure(args, shapes, tc, t_start)


def _gpu() -> dict:
    import torch

    try:
        props = torch.cuda.get_device_properties(0)
        return {"gpu": props.name, "sms": props.multi_processor_count,
                "capability": f"{props.major}.{props.minor}"}
    except (RuntimeError, AssertionError) as e:
        return {"gpu": f"unavailable: {e}"}


def _measure(args, shapes, tc: dict, t_start: float) -> int:

    payload = {"what": "FlashMLA sm90 sparse fp8 decode (V3.2 rows) at our attention shapes, "
                       "K = 2048: build, reference check, CUDA-event and profiler device time",
               "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
               "toolchain": tc, **_gpu(),
               "bundle_source": (Path(args.bundle) / "SOURCE").read_text().strip()
               if (Path(args.bundle) / "SOURCE").is_file() else None,
               "sm_scale": SM_SCALE, "build": {"ok": False}, "results": [], "complete": False}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)

    def save():
        Path(args.json).write_text(json.dumps(payload, indent=1, default=str))

    bundle = Path(args.bundle)
    summary = check_bundle(bundle)
    if summary["problems"]:
        payload["build"]["error"] = "bundle: " + "; ".join(summary["problems"])[:4000]
    else:
        try:
            payload["build"] = {"ok": True, **build(bundle, Path(args.build_dir), args.jobs, tc)}
            print(f"[build] done in {payload['build']['compile_and_link_s']} s", flush=True)
        except (BuildError, OSError, subprocess.SubprocessError, RuntimeError) as e:
            payload["build"]["error"] = f"{type(e).__name__}: {e}"[-8000:]
            payload["build"]["seconds_until_failure"] = round(time.time() - t_start, 1)
    save()
    if not payload["build"]["ok"]:
        print(f"[build] FAILED:\n{payload['build']['error'][-4000:]}", flush=True)
    else:
        _time_all(args, shapes, payload, save)
    if args.ours:
        _run_ours(args, shapes, payload, save, t_start)
    payload["complete"] = True
    payload["total_s"] = round(time.time() - t_start, 1)
    save()
    print(f"[flashmla] wrote {args.json} in {payload['total_s']} s", flush=True)
    return 0


def _time_all(args, shapes, payload: dict, save) -> None:
    import torch

    device = torch.device("cuda")
    kv_rows = make_rows(args.cache_rows, 1, device)
    if not args.no_check:
        try:
            payload["check"] = check(kv_rows, device)
        except Exception as e:  # noqa: BLE001 - record and go on to the timings
            payload["check"] = {"error": f"{type(e).__name__}: {e}"[:3000]}
            print(f"[check] FAILED: {payload['check']['error']}", flush=True)
        save()
    for n, h in shapes:
        try:
            payload["results"].append(time_shape(n, h, kv_rows, args))
        except Exception as e:  # noqa: BLE001 - record and go on
            payload["results"].append({"n": n, "h_q": h,
                                       "error": f"{type(e).__name__}: {e}"[:3000]})
            print(f"[flashmla] N={n} h={h} FAILED: {payload['results'][-1]['error']}", flush=True)
        save()
    del kv_rows
    torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
