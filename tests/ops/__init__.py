"""Tests of the data-plane ops, one file per op; each test body runs once per backend.

Off the GPU every kernel runs in the Pallas interpreter (small shapes, few distinct shapes so
that each compiles once); on the GPU the same tests run compiled, and the `gpu`-marked ones
add realistic sizes (K=2048, H=4096, 576-wide bf16 rows, pinned_host pools). Kernel outputs
are poisoned before each run so an entry a kernel forgets to write shows: fresh outputs start
at a poison value, in-place outputs (caches, pools, slot tables) start as random data whose
untouched rows must survive bit for bit. Shared helpers live here.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import settings

from hisparse_jax import ops
from pallas_kernels import _compat

INTERPRET = not _compat.has_gpu()
POISON = -77_777


def backends(op: str) -> list:
    """pytest params: every backend registered for `op`; mosaic_gpu is skipped off the GPU
    where this jax has no Mosaic GPU interpret mode."""
    params = []
    for name in ops.registered_backends(op):
        marks = ()
        if name == "mosaic_gpu" and INTERPRET and not _compat.mosaic_gpu_interpret_available():
            marks = pytest.mark.skip(reason="Mosaic GPU interpret mode needs jax >= 0.11")
        params.append(pytest.param(name, marks=marks, id=name))
    return params


_ISOLATED = "HISPARSE_TEST_ISOLATED"


def rerun_isolated(request, *, timeout: float = 180, attempts: int = 3) -> bool:
    """Runs the calling test again in a fresh pytest process, with a time limit, and retries
    a run that outlives it. Returns True in the calling process (the child passed: the caller
    returns) and False inside the child (the caller runs its body).

    For the Mosaic GPU interpreter of jax 0.11 (off the GPU), which sometimes deadlocks on a
    machine of few cores: its simulated threads wait at a barrier from inside XLA CPU's
    callbacks, and when those take every thread of XLA's pool (two cores, and another test
    process beside it) the thread the barrier waits for never runs. A run that ends (passes
    or fails) is final; only one that hangs is tried again."""
    if os.environ.get(_ISOLATED) == request.node.nodeid:
        return False
    env = {**os.environ, _ISOLATED: request.node.nodeid}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
           request.node.nodeid]
    for _ in range(attempts):
        try:
            run = subprocess.run(cmd, env=env, cwd=request.config.rootpath, timeout=timeout,
                                 capture_output=True, text=True, check=False)
        except subprocess.TimeoutExpired:
            continue
        assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
        return True
    pytest.fail(f"{request.node.nodeid} did not finish in {attempts} runs of {timeout} s")


def examples(share: float) -> int:
    """A share of the active hypothesis profile's examples (ci: 45, long: 2000)."""
    return max(3, int(settings.default.max_examples * share))


def to_host(x):
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                               memory_kind="pinned_host"))


def bits(x) -> np.ndarray:
    """Array contents as integers, so bf16 compares bit for bit (NaN poison included)."""
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype == jnp.bfloat16 else x


def pack_layers(pools, per_array: int) -> list[np.ndarray]:
    """Per-layer numpy pools [.., W] as packed arrays: each `per_array` consecutive layers
    side by side [.., per_array * W] (the `HostPool(layers_per_array=...)` layout)."""
    return [np.concatenate(pools[a:a + per_array], axis=-1)
            for a in range(0, len(pools), per_array)]


def random_rows(rng, shape, dtype=jnp.bfloat16):
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def random_bytes(rng, shape) -> np.ndarray:
    """uint8 rows of random bytes (fp8_ds_mla rows to the copies: any byte pattern)."""
    return rng.integers(0, 256, size=shape, dtype=np.uint8)


def np_dequantize_fp8(rows) -> np.ndarray:
    """fp8_ds_mla rows uint8 [..., 656] -> float64 [..., 576], written from the layout in
    `docs/kv_format.md` with numpy views only (independent of `pallas_kernels.kv_format`):
    bytes [0, 512) float8_e4m3fn, [512, 528) 4 little-endian float32 scales (one per 128
    values), [528, 656) 64 little-endian bfloat16 rope values."""
    rows = np.ascontiguousarray(np.asarray(rows, np.uint8))
    lead = rows.shape[:-1]
    assert rows.shape[-1] == 656, rows.shape
    fp8 = rows[..., :512].copy().view(jnp.float8_e4m3fn).astype(np.float64)
    scale = rows[..., 512:528].copy().view("<f4").astype(np.float64)          # [..., 4]
    latent = (fp8.reshape(*lead, 4, 128) * scale[..., None]).reshape(*lead, 512)
    rope = rows[..., 528:656].copy().view("<u2").view(jnp.bfloat16).astype(np.float64)
    return np.concatenate([latent, rope], axis=-1)


def sds(shape, dtype=jnp.int32):
    return jax.ShapeDtypeStruct(shape, dtype)


def lower_for_cuda(fn, *args) -> str:
    """The StableHLO of `jit(fn)(*args)` exported for CUDA from this CPU machine, through
    `_compat.lower_for_cuda` (the whole Pallas -> Triton IR lowering: a non-power-of-two shape
    or a primitive the Triton backend lacks fails here, in CI, rather than on the GPU).
    Skips on a GPU (the GPU tests compile for real) or where jax's internals moved."""
    if _compat.has_gpu():
        pytest.skip("the GPU tests compile for real")
    text = _compat.lower_for_cuda(fn, *args)
    if text is None:
        pytest.skip("this jax's Pallas Triton internals moved")
    assert "__gpu$xla.gpu.triton" in text
    return text
