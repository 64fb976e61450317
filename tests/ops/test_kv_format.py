"""The KV row formats (`pallas_kernels/kv_format.py`): the fp8_ds_mla byte layout against a
numpy decoder written from `docs/kv_format.md`, quantization rules and error bounds, the size
helpers."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import kv_format as kvf
from tests.ops import examples, np_dequantize_fp8

E4M3_MIN_NORMAL = 2.0**-6


def test_names_and_sizes():
    assert kvf.KV_FORMATS == ("bf16", "fp8_ds_mla")
    assert (kvf.SCALE_OFFSET, kvf.ROPE_OFFSET, kvf.FP8_ROW_BYTES) == (512, 528, 656)
    assert kvf.row_bytes("fp8_ds_mla") == 656 and kvf.row_bytes("fp8_ds_mla", 576) == 656
    assert kvf.row_bytes("bf16", 576) == 1152
    assert kvf.row_bytes("bf16", 576, jnp.float32) == 2304
    assert kvf.storage_width("fp8_ds_mla", 576) == 656 and kvf.storage_width("bf16", 100) == 100
    assert kvf.storage_dtype("fp8_ds_mla") == jnp.uint8
    assert kvf.storage_dtype("bf16") == jnp.bfloat16
    assert kvf.storage_dtype("bf16", jnp.float16) == jnp.float16
    assert 1 - 656 / 1152 > 0.43                      # the 43% fewer bytes
    assert 656 % 16 == 0                               # 16-byte aligned rows


def test_unknown_format_and_wrong_width_are_errors():
    for bad in ("fp8", "FP8_DS_MLA", None, 8):
        with pytest.raises(ValueError, match=r"kv_format must be one of \('bf16', 'fp8_ds_mla'\)"):
            kvf.row_bytes(bad)
    with pytest.raises(ValueError, match="576-value rows"):
        kvf.storage_width("fp8_ds_mla", 512)
    with pytest.raises(ValueError, match="576-value rows"):
        kvf.quantize(jnp.zeros((2, 512), jnp.float32))
    with pytest.raises(ValueError, match=r"uint8\[..., 656\]"):
        kvf.dequantize(jnp.zeros((2, 656), jnp.int8))


def test_byte_layout_by_hand():
    """One row built by hand: value i at byte i, scale g at bytes 512 + 4g (little-endian
    float32), rope j at bytes 528 + 2j (little-endian bfloat16)."""
    x = np.zeros((576,), np.float32)
    x[0], x[1], x[127] = 448.0, -224.0, 1.0           # group 0: amax 448 -> scale 1
    x[128] = 3.0                                      # group 1: scale 3/448, value 448
    # group 2 all zero: scale 0, zero bytes
    x[384], x[385] = -2.0, 0.5                        # group 3: scale 2/448
    x[512], x[575] = 1.5, -3.0                        # rope
    row = np.asarray(kvf.quantize(jnp.asarray(x)))
    assert row.shape == (656,) and row.dtype == np.uint8
    assert row[0] == 0x7E and row[1] == 0xF6 and row[127] == 0x38   # 448, -224, 1.0 in e4m3
    assert row[2:127].max() == 0
    assert row[128] == 0x7E                           # 3.0 / (3/448) = 448
    assert row[256:384].max() == 0                    # the zero group
    assert row[384] == 0xFE and row[385] == 0x6E      # -448; 0.5 / (2/448) = 112 = 1.75 * 2^6
    scales = row[512:528].copy().view("<f4")
    inv = np.float32(1.0 / 448.0)                     # scale = amax * float32(1/448)
    np.testing.assert_array_equal(scales, np.float32([448.0, 3.0, 0.0, 2.0]) * inv)
    np.testing.assert_allclose(scales, np.float32([448.0, 3.0, 0.0, 2.0]) / 448.0, rtol=1.2e-7)
    np.testing.assert_array_equal(row[512:516], [0x00, 0x00, 0x80, 0x3F])   # 1.0f, LSB first
    assert (row[528], row[529]) == (0xC0, 0x3F)       # bf16 1.5 = 0x3FC0, low byte first
    assert (row[654], row[655]) == (0x40, 0xC0)       # bf16 -3.0 = 0xC040
    np.testing.assert_allclose(np_dequantize_fp8(row)[[0, 1, 127, 128, 384, 512, 575]],
                               [448.0, -224.0, 1.0, 3.0, -2.0, 1.5, -3.0], rtol=1e-6)


def test_quantized_value_bytes_match_numpy_cast():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 576)) * rng.uniform(1e-3, 1e3, (64, 1))).astype(np.float32)
    row = np.asarray(kvf.quantize(jnp.asarray(x)))
    scale = np.abs(x[:, :512].reshape(64, 4, 128)).max(-1) * np.float32(1.0 / 448.0)
    np.testing.assert_array_equal(row[:, 512:528].copy().view("<f4"), scale.astype(np.float32))
    want = (x[:, :512].reshape(64, 4, 128) / scale[..., None]).astype(jnp.float8_e4m3fn)
    np.testing.assert_array_equal(row[:, :512], want.reshape(64, 512).view(np.uint8))
    rope = x[:, 512:].astype(jnp.bfloat16)
    np.testing.assert_array_equal(row[:, 528:].copy().view(jnp.bfloat16).view(np.uint16),
                                  rope.view(np.uint16))


@settings(max_examples=examples(0.5))
@given(seed=st.integers(0, 2**32 - 1), log_mag=st.floats(-20, 20),
       zero_groups=st.lists(st.integers(0, 3), max_size=4))
def test_round_trip_error_bounds(seed, log_mag, zero_groups):
    """dequantize(quantize(x)): each group's largest |x| comes back exactly (it maps to
    +-448); every latent value within half an e4m3 step (relative 2^-4 where x / scale is
    normal, absolute scale * 2^-10 below); zero groups come back as zeros, never NaN; rope
    values are x rounded to bf16; `dequantize` equals the numpy decoder."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((8, 576)) * 2.0**log_mag).astype(np.float32)
    for g in zero_groups:
        x[:, g * 128:(g + 1) * 128] = 0.0
    rows = kvf.quantize(jnp.asarray(x))
    back = np.asarray(kvf.dequantize(rows, jnp.float32), np.float64)
    np.testing.assert_array_equal(back, np_dequantize_fp8(rows).astype(np.float32))
    assert not np.isnan(back).any()
    lat, got = x[:, :512].reshape(8, 4, 128).astype(np.float64), back[:, :512].reshape(8, 4, 128)
    amax = np.abs(lat).max(-1, keepdims=True)
    scale = amax / 448.0
    at_max = np.abs(lat) == amax
    np.testing.assert_allclose(got[at_max], lat[at_max], rtol=1e-6)
    y = np.abs(lat) / np.where(scale > 0, scale, 1.0)
    normal = y >= E4M3_MIN_NORMAL
    err = np.abs(got - lat)
    assert np.all(err[normal] <= np.abs(lat[normal]) * 2.0**-4 * (1 + 1e-6))
    sub = ~normal
    assert np.all(err[sub] <= np.broadcast_to(scale, lat.shape)[sub] * 2.0**-10 * (1 + 1e-6))
    for g in zero_groups:
        assert np.all(got[:, g] == 0.0)
    np.testing.assert_array_equal(back[:, 512:].astype(np.float32),
                                  x[:, 512:].astype(jnp.bfloat16).astype(np.float32))


def test_gaussian_rows_relative_error():
    """The figure `docs/kv_format.md` quotes: Gaussian rows lose ~2.5-2.7% (RMS, relative)
    of their latent part; the rope part ~0.2% (bf16)."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4096, 576)).astype(np.float32)
    back = np.asarray(kvf.dequantize(kvf.quantize(jnp.asarray(x))), np.float64)
    lat = np.linalg.norm(back[:, :512] - x[:, :512]) / np.linalg.norm(x[:, :512])
    rope = np.linalg.norm(back[:, 512:] - x[:, 512:]) / np.linalg.norm(x[:, 512:])
    assert 0.015 < lat < 0.035, lat
    assert rope < 3e-3, rope


def test_leading_dims_and_dtype():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((3, 2, 4, 576)), jnp.bfloat16)
    rows = kvf.quantize(x)
    assert rows.shape == (3, 2, 4, 656) and rows.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(rows).reshape(24, 656),
                                  np.asarray(kvf.quantize(x.reshape(24, 576))))
    out = kvf.dequantize(rows, jnp.bfloat16)
    assert out.shape == (3, 2, 4, 576) and out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(kvf.scales(rows)),
                                  np.asarray(rows)[..., 512:528].copy().view("<f4"))
