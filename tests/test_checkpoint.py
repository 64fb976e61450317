"""hisparse_jax.models.checkpoint: the safetensors reader and writer, sharded folders, fp8
block-scale dequantization, and errors on bad files that name the file and tensor."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from hisparse_jax.models.checkpoint import (
    DTYPES,
    SafetensorsFile,
    dequantize_blocks,
    open_checkpoint,
    save_safetensors,
)

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "hf")


def _bits(a: np.ndarray) -> np.ndarray:
    """The raw bytes of `a` (NaN-safe equality for float dtypes)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


def _folder(tmp_path, tensors, config=None, name="model.safetensors"):
    (tmp_path / "config.json").write_text(json.dumps(config or {"model_type": "test"}))
    save_safetensors(tmp_path / name, tensors)
    return tmp_path


@st.composite
def _tensor(draw):
    code = draw(st.sampled_from(sorted(DTYPES)))
    dtype = DTYPES[code]
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5))
    # Any bit pattern is a valid value of every dtype but BOOL: draw the bytes and view them.
    if code == "BOOL":
        return draw(hnp.arrays(np.bool_, shape))
    raw = draw(hnp.arrays(np.dtype(f"u{dtype.itemsize}"), shape))
    return raw.view(dtype)


_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1,
                 max_size=12).filter(lambda n: n != "__metadata__")


@given(tensors=st.dictionaries(_names, _tensor(), max_size=6),
       metadata=st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
def test_round_trip_every_dtype(tmp_path_factory, tensors, metadata):
    path = tmp_path_factory.mktemp("rt") / "x.safetensors"
    save_safetensors(path, tensors, metadata)
    with SafetensorsFile(path) as f:
        assert sorted(f.names()) == sorted(tensors)
        assert f.metadata == (metadata or {})
        for name, want in tensors.items():
            got = f.array(name)
            assert _same(got, want), name
            assert f.entries[name].shape == want.shape


def test_every_dtype_code_round_trips(tmp_path):
    tensors = {code: np.arange(6).reshape(2, 3).astype(dt) for code, dt in DTYPES.items()}
    save_safetensors(tmp_path / "x.safetensors", tensors)
    with SafetensorsFile(tmp_path / "x.safetensors") as f:
        for code, want in tensors.items():
            assert f.entries[code].dtype == code
            assert _same(f.array(code), want)


def test_header_is_aligned_and_readable_by_layout(tmp_path):
    a = np.arange(5, dtype=np.float32)
    save_safetensors(tmp_path / "x.safetensors", {"a": a}, {"format": "np"})
    raw = (tmp_path / "x.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n % 8 == 0
    header = json.loads(raw[8:8 + n])
    assert header["__metadata__"] == {"format": "np"}
    assert header["a"] == {"dtype": "F32", "shape": [5], "data_offsets": [0, 20]}
    assert np.array_equal(np.frombuffer(raw[8 + n:], "<f4"), a)


def test_writer_rejects_unknown_dtype(tmp_path):
    with pytest.raises(ValueError, match=r"'c'.*complex64"):
        save_safetensors(tmp_path / "x.safetensors", {"c": np.zeros(2, np.complex64)})


def test_single_file_checkpoint(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    with open_checkpoint(_folder(tmp_path, {"w": w, "b": np.ones(3, ml_dtypes.bfloat16)})) as ck:
        assert ck.config == {"model_type": "test"}
        assert ck.path == str(tmp_path)
        assert ck.names() == {"w", "b"}
        assert ck.shape("w") == (3, 4)
        assert not ck.is_quantized("w")
        assert _same(ck.read("w", np.float32), w)
        assert ck.read("w", ml_dtypes.bfloat16).dtype == ml_dtypes.bfloat16
        assert _same(ck.read("b", np.float32), np.ones(3, np.float32))
        assert ck.read("b").dtype == ml_dtypes.bfloat16
        with pytest.raises(ValueError, match=r"no tensor named 'missing'"):
            ck.read("missing", np.float32)
        with pytest.raises(ValueError, match=r"no tensor named 'missing'"):
            ck.shape("missing")
        kept = [ck.read("w", np.float32), ck.read("w"), ck.read("b", np.float32)]
    # reads are copies: writable, and alive after the files are closed
    assert all(a.flags.writeable and a.flags.owndata for a in kept)
    assert _same(kept[0], w) and _same(kept[1], w)
    with pytest.raises(ValueError, match=r"model.safetensors: file is closed"):
        ck.read("w", np.float32)


def _sharded(tmp_path, shards: dict[str, dict[str, np.ndarray]], weight_map=None):
    (tmp_path / "config.json").write_text("{}")
    for shard, tensors in shards.items():
        save_safetensors(tmp_path / shard, tensors)
    if weight_map is None:
        weight_map = {n: shard for shard, ts in shards.items() for n in ts}
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return tmp_path


def test_sharded_index(tmp_path):
    a, b, c = (np.full((2, 2), i, np.float32) for i in range(3))
    folder = _sharded(tmp_path, {"s-1.safetensors": {"a": a, "b": b},
                                 "s-2.safetensors": {"c": c}})
    with open_checkpoint(folder) as ck:
        assert ck.names() == {"a", "b", "c"}
        for name, want in zip("abc", (a, b, c), strict=True):
            assert _same(ck.read(name, np.float32), want)


def test_sharded_missing_shard(tmp_path):
    folder = _sharded(tmp_path, {"s-1.safetensors": {"a": np.zeros(2, np.float32)}},
                      weight_map={"a": "s-1.safetensors", "b": "s-2.safetensors"})
    with pytest.raises(ValueError, match=r"shard 's-2.safetensors'.*does not exist"):
        open_checkpoint(folder)


def test_sharded_name_in_two_files(tmp_path):
    folder = _sharded(tmp_path, {"s-1.safetensors": {"a": np.zeros(2, np.float32)},
                                 "s-2.safetensors": {"a": np.zeros(2, np.float32)}},
                      weight_map={"a": "s-1.safetensors", "x": "s-2.safetensors"})
    with pytest.raises(ValueError, match=r"tensor 'a' is in two files.*s-1.*s-2"):
        open_checkpoint(folder)


def test_sharded_index_points_to_wrong_shard(tmp_path):
    folder = _sharded(tmp_path, {"s-1.safetensors": {"a": np.zeros(2, np.float32)},
                                 "s-2.safetensors": {"b": np.zeros(2, np.float32)}},
                      weight_map={"a": "s-2.safetensors", "b": "s-2.safetensors",
                                  "z": "s-1.safetensors"})
    with pytest.raises(ValueError, match=r"maps tensor 'a' to 's-2.safetensors'"):
        open_checkpoint(folder)


def test_missing_config_and_weights(tmp_path):
    with pytest.raises(ValueError, match=r"does not exist"):
        open_checkpoint(tmp_path / "nowhere")
    save_safetensors(tmp_path / "model.safetensors", {"a": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match=r"has no config.json"):
        open_checkpoint(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"neither model.safetensors nor "
                                         r"model.safetensors.index.json"):
        open_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    save_safetensors(tmp_path / "model.safetensors", {"a": np.zeros(1, np.float32)})
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        open_checkpoint(tmp_path)


def _write_raw(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def test_truncated_file(tmp_path):
    path = tmp_path / "x.safetensors"
    save_safetensors(path, {"w": np.zeros((4, 4), np.float32)})
    raw = path.read_bytes()
    path.write_bytes(raw[:-4])
    with pytest.raises(ValueError, match=r"x.safetensors: tensor 'w': data_offsets \[0, 64\] "
                                         r"outside the file's 60 data bytes"):
        SafetensorsFile(path)
    path.write_bytes(raw[:20])
    with pytest.raises(ValueError, match=r"x.safetensors: header length .* exceeds"):
        SafetensorsFile(path)
    path.write_bytes(raw[:5])
    with pytest.raises(ValueError, match=r"x.safetensors: 5 bytes, too short"):
        SafetensorsFile(path)


@pytest.mark.parametrize("entry, message", [
    ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, r"span 4 bytes but shape \[2\]"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}, r"outside the file's 8 data"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, r"outside"),
    ({"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}, r"unsupported dtype 'C64'"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, r"shape must be"),
    ({"dtype": "F32", "shape": [2]}, r"must have dtype, shape and data_offsets"),
])
def test_bad_header_entry_names_file_and_tensor(tmp_path, entry, message):
    path = tmp_path / "bad.safetensors"
    _write_raw(path, {"t": entry}, bytes(8))
    with pytest.raises(ValueError, match=r"bad.safetensors: tensor 't': .*" + message):
        SafetensorsFile(path)


def test_bad_header_json(tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(ValueError, match=r"bad.safetensors: header is not valid JSON"):
        SafetensorsFile(path)


def _dequant_reference(w8: np.ndarray, scale: np.ndarray, bo: int, bi: int) -> np.ndarray:
    out = np.empty(w8.shape, np.float32)
    for i in range(w8.shape[0]):
        for j in range(w8.shape[1]):
            out[i, j] = np.float32(w8[i, j]) * scale[i // bo, j // bi]
    return out


def _fp8_folder(tmp_path, shape=(40, 72), block=(32, 32), grid=None):
    rng = np.random.default_rng(0)
    w8 = rng.normal(size=shape).astype(ml_dtypes.float8_e4m3fn)
    grid = grid or (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale = rng.uniform(0.5, 2.0, size=grid).astype(np.float32)
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": list(block)}}
    folder = _folder(tmp_path, {"layer.weight": w8, "layer.weight_scale_inv": scale,
                                "norm.weight": np.ones(4, np.float32)}, config)
    return folder, w8, scale


def test_fp8_dequant_non_multiple_shape(tmp_path):
    folder, w8, scale = _fp8_folder(tmp_path)
    want = _dequant_reference(w8, scale, 32, 32)
    with open_checkpoint(folder) as ck:
        assert ck.names() == {"layer.weight", "norm.weight"}
        assert ck.is_quantized("layer.weight") and not ck.is_quantized("norm.weight")
        assert ck.shape("layer.weight") == (40, 72)
        assert ck.stored_dtype("layer.weight") == "F8_E4M3"
        np.testing.assert_array_equal(ck.read("layer.weight", np.float32), want)
        np.testing.assert_array_equal(ck.read("layer.weight", ml_dtypes.bfloat16),
                                      want.astype(ml_dtypes.bfloat16))
        with pytest.raises(ValueError, match=r"'layer.weight_scale_inv' \(a block scale"):
            ck.read("layer.weight_scale_inv", np.float32)


def test_fp8_default_block_is_128(tmp_path):
    rng = np.random.default_rng(1)
    w8 = rng.normal(size=(130, 260)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.5, 2.0, size=(2, 3)).astype(np.float32)
    folder = _folder(tmp_path, {"w": w8, "w_scale_inv": scale})
    with open_checkpoint(folder) as ck:
        np.testing.assert_array_equal(ck.read("w", np.float32),
                                      _dequant_reference(w8, scale, 128, 128))


def test_fp8_scale_grid_mismatch(tmp_path):
    folder, _, _ = _fp8_folder(tmp_path, grid=(1, 3))
    with open_checkpoint(folder) as ck:
        with pytest.raises(ValueError, match=r"'layer.weight'.*\(40, 72\).*\(2, 3\).*\(1, 3\)"):
            ck.read("layer.weight", np.float32)


def test_dequantize_rejects_non_2d():
    with pytest.raises(ValueError, match=r"'w': block-scaled weight must be 2-D"):
        dequantize_blocks(np.zeros(4, np.float32), np.ones((1,), np.float32), (2, 2), "w")


def test_fp8_without_scale_is_plain(tmp_path):
    w8 = np.array([1.0, -2.0, 0.5], ml_dtypes.float8_e4m3fn)
    with open_checkpoint(_folder(tmp_path, {"w": w8})) as ck:
        assert not ck.is_quantized("w")
        np.testing.assert_array_equal(ck.read("w", np.float32), [1.0, -2.0, 0.5])


def _fixture_folders() -> list[str]:
    if not os.path.isdir(FIXTURES):
        return []
    return sorted(d for d in os.listdir(FIXTURES)
                  if os.path.isfile(os.path.join(FIXTURES, d, "config.json")))


@pytest.mark.parametrize("name", _fixture_folders() or [pytest.param("none", marks=pytest.mark.skip(
    reason="no committed fixtures under tests/fixtures/hf"))])
def test_reads_committed_fixtures(name):
    with open_checkpoint(os.path.join(FIXTURES, name)) as ck:
        assert ck.names()
        for n in sorted(ck.names()):
            a = ck.read(n, np.float32)
            assert a.shape == ck.shape(n) and np.isfinite(a).all(), n
