"""The backend registry of `hisparse_jax.ops`: vocabulary, selection, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import hisparse_jax as hs
from hisparse_jax import ops
from hisparse_jax.ops import _registry
from pallas_kernels import _compat

ON_GPU = _compat.has_gpu()


def _attention_args(dtype=jnp.bfloat16, width=576):
    return (jax.ShapeDtypeStruct((2, 16, width), dtype),
            jax.ShapeDtypeStruct((64, width), dtype), jax.ShapeDtypeStruct((2, 8), jnp.int32))


def test_vocabulary():
    assert ops.BACKENDS == ("reference", "triton", "mosaic_gpu")
    for op in _registry.ops():
        assert "reference" in ops.registered_backends(op)
        assert set(ops.registered_backends(op)) <= set(ops.BACKENDS)
        assert _registry.PREFERENCE[op][-1] == "reference"
    assert ops.registered_backends("sparse_mla_decode") == ops.BACKENDS
    assert set(_registry.ops()) == {"resolve_residency", "resolve_residency_mapped",
                                    "invalidate_written_rows",
                                    "gather_compact", "gather_compact_group", "mirror_rows",
                                    "stage_prefill_rows", "sparse_mla_decode",
                                    "sparse_mla_decode_with_copies", "grouped_matmul"}


def test_every_implementation_is_named_after_its_op():
    for op in _registry.ops():
        for backend in ops.registered_backends(op):
            if backend == "mosaic_gpu" and not _compat.mosaic_gpu_interpret_available():
                continue                       # imported only where jax has Mosaic GPU
            module = _registry.module(op, backend)
            assert callable(getattr(module, op)), (op, backend)
            if backend != "reference":
                assert callable(module.supports) and hasattr(module, "DEFAULT")


def test_pallas_is_a_deprecated_alias_of_triton():
    with pytest.warns(DeprecationWarning, match="backend='pallas' is deprecated"):
        assert _registry.normalize("pallas") == "triton"
    state = hs.HotState(jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int16))
    with pytest.warns(DeprecationWarning, match="use backend='triton'"):
        got = hs.invalidate_written_rows(state, jnp.zeros(1, jnp.int32),
                                         jnp.zeros(1, jnp.int32), backend="pallas")
    assert got.slot_rows.shape == (1, 8)


@pytest.mark.skipif(ON_GPU, reason="off-GPU dispatch")
def test_none_picks_reference_off_the_gpu():
    for op in _registry.ops():
        args = _attention_args() if op.startswith("sparse_mla_decode") else ()
        assert _registry.select(op, None, *args) == "reference"


@pytest.mark.skipif(not ON_GPU, reason="GPU dispatch")
def test_none_picks_the_preferred_kernel_on_the_gpu():
    assert _registry.select("gather_compact", None) == "triton"
    assert _registry.select("sparse_mla_decode", None, *_attention_args()) == "triton"
    # float32 attention: no kernel takes it, the reference runs.
    assert _registry.select("sparse_mla_decode", None,
                            *_attention_args(jnp.float32)) == "reference"


def test_explicit_unsupported_backend_errors_with_the_reason():
    with pytest.raises(ValueError, match="cannot run these inputs.*bfloat16 or float16"):
        _registry.select("sparse_mla_decode", "triton", *_attention_args(jnp.float32))
    with pytest.raises(ValueError, match="multiple of 64"):
        _registry.select("sparse_mla_decode", "mosaic_gpu",
                         *_attention_args(jnp.bfloat16, width=100))
    with pytest.raises(ValueError, match="has no implementation of mirror_rows"):
        _registry.select("mirror_rows", "mosaic_gpu")


def _fp8_args():
    return (jax.ShapeDtypeStruct((2, 16, 576), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 656), jnp.uint8), jax.ShapeDtypeStruct((2, 8), jnp.int32))


def test_fp8_rows_run_on_every_backend_that_supports_them():
    """kv_format reaches every backend's supports(): fp8_ds_mla rows on the reference, the
    Triton kernel and the Mosaic GPU row-copy kernel (where this jax has Mosaic GPU: on the
    GPU or in its interpret mode; elsewhere refused with that reason), which refuses what it
    cannot run with its reason (v_width other than 512); None picks the row-copy kernel on a
    Hopper GPU (the Triton kernel where this jax lacks it), and the Triton kernel for bf16
    rows."""
    kw = {"kv_format": "fp8_ds_mla"}
    assert _registry.select("sparse_mla_decode", "reference", *_fp8_args(), **kw) == "reference"
    assert _registry.select("sparse_mla_decode", "triton", *_fp8_args(), **kw) == "triton"
    if ON_GPU or _compat.mosaic_gpu_interpret_available():
        assert _registry.select("sparse_mla_decode", "mosaic_gpu", *_fp8_args(),
                                **kw) == "mosaic_gpu"
    else:
        with pytest.raises(ValueError, match="backend='mosaic_gpu' cannot run these inputs.*"
                                             "interpret mode"):
            _registry.select("sparse_mla_decode", "mosaic_gpu", *_fp8_args(), **kw)
    with pytest.raises(ValueError, match="backend='mosaic_gpu' cannot run these inputs.*"
                                         "v_width 512"):
        _registry.select("sparse_mla_decode", "mosaic_gpu", *_fp8_args(), v_width=256, **kw)
    # None: on a (Hopper) GPU the row-copy kernel where this jax has it, else Triton's; the
    # fused op with copies is Triton's, so a caller with the attention's inputs runs the parts.
    mosaic = _registry.unsupported("sparse_mla_decode", "mosaic_gpu", *_fp8_args(), **kw) is None
    want = ("mosaic_gpu" if mosaic else "triton") if ON_GPU else "reference"
    assert _registry.select("sparse_mla_decode", None, *_fp8_args(), **kw) == want
    assert _registry.runs_fused("sparse_mla_decode_with_copies", None, *_fp8_args(),
                                **kw) == (want != "mosaic_gpu")
    assert _registry.runs_fused("sparse_mla_decode_with_copies", None)
    bf16 = (_fp8_args()[0], jax.ShapeDtypeStruct((64, 576), jnp.bfloat16), _fp8_args()[2])
    assert _registry.select("sparse_mla_decode", None, *bf16) == (
        "triton" if ON_GPU else "reference")
    assert _registry.runs_fused("sparse_mla_decode_with_copies", None, *bf16)
    f16 = (jax.ShapeDtypeStruct((2, 16, 576), jnp.float16), *_fp8_args()[1:])
    assert _registry.select("sparse_mla_decode", None, *f16, **kw) == "reference"


def test_explicit_supported_backend_is_kept():
    assert _registry.select("sparse_mla_decode", "triton", *_attention_args()) == "triton"
    assert _registry.select("sparse_mla_decode", "reference",
                            *_attention_args(jnp.float32)) == "reference"
    assert _registry.select("resolve_residency", "triton") == "triton"


def test_unknown_backend_name_errors_listing_the_vocabulary():
    for bad in ("cuda", "Triton", ""):
        with pytest.raises(ValueError, match=r"backend must be one of \('reference', "
                                             r"'triton', 'mosaic_gpu'\) or None"):
            _registry.select("gather_compact", bad)
    with pytest.raises(KeyError, match="no op 'gather'"):
        _registry.select("gather", None)


def test_implementation_binds_interpret_off_the_gpu():
    fn = _registry.implementation("mirror_rows", "triton")
    assert fn.keywords == {"interpret": not ON_GPU}
    assert _registry.implementation("mirror_rows", "reference").__name__ == "mirror_rows"


def test_a_fused_op_runs_where_its_backend_is_registered_else_its_parts():
    # The fallback rule, stated once in the registry: a fused op runs for None (select then
    # picks per platform) and for each backend it registers (the deprecated alias counts as
    # its new name); any other backend runs its parts. Its parts are registered ops.
    op = "sparse_mla_decode_with_copies"
    assert set(_registry.FUSED_PARTS) == {op}
    assert _registry.FUSED_PARTS[op] == ("gather_compact_group", "sparse_mla_decode")
    for fused, parts in _registry.FUSED_PARTS.items():
        assert set(parts) <= set(_registry.ops())
        assert _registry.runs_fused(fused, None) is True
        for backend in ops.BACKENDS:
            assert _registry.runs_fused(fused, backend) is (
                backend in ops.registered_backends(fused)), backend
    assert _registry.runs_fused(op, "triton") and _registry.runs_fused(op, "reference")
    assert not _registry.runs_fused(op, "mosaic_gpu")
    assert _registry.runs_fused(op, "pallas")
    with pytest.raises(ValueError, match="backend must be one of"):
        _registry.runs_fused(op, "cuda")
    with pytest.raises(KeyError, match="no fused op 'sparse_mla_decode'"):
        _registry.runs_fused("sparse_mla_decode", None)


def test_runs_fused_with_backend_none_follows_the_default_of_the_last_part(monkeypatch):
    """backend None with the last part's inputs: the fused op where the backend None picks for
    that part has it (triton, reference), the parts where it has not (mosaic_gpu: the row-copy
    attention over fp8 rows on a Hopper GPU); without inputs, the fused op."""
    picked = []

    def pick(name):
        def select(op, backend, *args, **kwargs):
            picked.append((op, backend, len(args), kwargs))
            return name
        return select

    for name, fused in (("mosaic_gpu", False), ("triton", True), ("reference", True)):
        monkeypatch.setattr(_registry, "select", pick(name))
        assert _registry.runs_fused("sparse_mla_decode_with_copies", None, *_fp8_args(),
                                    kv_format="fp8_ds_mla") is fused
        assert picked[-1] == ("sparse_mla_decode", None, 3, {"kv_format": "fp8_ds_mla"})
    count = len(picked)
    assert _registry.runs_fused("sparse_mla_decode_with_copies", None)
    assert not _registry.runs_fused("sparse_mla_decode_with_copies", "mosaic_gpu")
    assert len(picked) == count          # a named backend (or no inputs) asks no default
