"""Reading Hugging Face checkpoint folders: safetensors files, shards, fp8 block scales.

A safetensors file is an 8-byte little-endian unsigned header length `n`, then `n` bytes of
JSON mapping each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (plus an
optional `"__metadata__"` map of strings), then the raw little-endian tensor bytes; offsets
count from the end of the header. `SafetensorsFile` memory-maps the file and checks every
header entry up front (offsets inside the data, byte size = prod(shape) * itemsize), so a read
touches only that tensor's bytes and never holds a second copy of the whole file in memory.

`open_checkpoint(folder)` reads `config.json` and either `model.safetensors` or
`model.safetensors.index.json` with the shards its `weight_map` names. `Checkpoint` exposes
logical tensors: an fp8 (`F8_E4M3`) weight with a `<name>_scale_inv` companion is read
dequantized (each element times the float32 scale of its `weight_block_size` block, in float32,
then cast), and the companions are not listed among the names.

`save_safetensors` writes the same format (tests build checkpoints with it).
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

# safetensors dtype code -> numpy dtype (little-endian on disk).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype(np.bool_),
}
_CODES: dict[np.dtype, str] = {dt.newbyteorder("="): code for code, dt in DTYPES.items()}

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK = (128, 128)
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# A header larger than this is not a safetensors header (the reference reader's bound too).
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorEntry:
    """One header entry: `begin`/`end` are byte offsets into the data (after the header)."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _parse_entry(path: str, name: str, raw: Any, data_size: int) -> TensorEntry:
    """Checks one header entry against the rules of the format and the file's data size."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(raw, dict) or not {"dtype", "shape", "data_offsets"} <= raw.keys():
        raise ValueError(f"{where}: header entry must have dtype, shape and data_offsets; "
                         f"got {raw!r}")
    code, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    if code not in DTYPES:
        raise ValueError(f"{where}: unsupported dtype {code!r} (supported: {sorted(DTYPES)})")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise ValueError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(type(o) is int for o in offsets)):
        raise ValueError(f"{where}: data_offsets must be [begin, end] ints, got {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise ValueError(f"{where}: data_offsets {offsets} outside the file's {data_size} data "
                         "bytes (0 <= begin <= end <= data size)")
    nbytes = math.prod(shape) * DTYPES[code].itemsize
    if end - begin != nbytes:
        raise ValueError(f"{where}: data_offsets {offsets} span {end - begin} bytes but shape "
                         f"{shape} of {code} needs {nbytes}")
    return TensorEntry(code, tuple(shape), begin, end)


def _read_header(path: str) -> tuple[dict[str, TensorEntry], dict[str, str], int]:
    """(entries, metadata, data start) of the file at `path`, every entry checked."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {size} bytes, too short for a safetensors header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError(f"{path}: header length {n} exceeds the file's {size - 8} bytes "
                             "after the length field (truncated or not a safetensors file)")
        text = f.read(n)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise ValueError(f"{path}: __metadata__ must map strings to strings, got {metadata!r}")
    data_size = size - 8 - n
    entries = {name: _parse_entry(path, name, raw, data_size) for name, raw in header.items()}
    return entries, metadata, 8 + n


class SafetensorsFile:
    """One safetensors file, header parsed and checked on open, data memory-mapped on first use.

    `array(name)` returns a copy of one tensor in its stored dtype and shape; only that tensor's
    pages of the file are touched.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ValueError(f"safetensors file {self.path} does not exist")
        self.entries, self.metadata, self._data_start = _read_header(self.path)
        self._map: mmap.mmap | None = None
        self._closed = False

    def names(self) -> list[str]:
        return list(self.entries)

    def _entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise ValueError(f"{self.path}: no tensor named {name!r}") from None

    def view(self, name: str) -> np.ndarray:
        """The tensor as a read-only array over the mapped file (no copy; valid until close)."""
        if self._closed:
            raise ValueError(f"{self.path}: file is closed")
        e = self._entry(name)
        dtype = DTYPES[e.dtype]
        count = math.prod(e.shape)
        if count == 0:
            return np.zeros(e.shape, dtype)
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        flat = np.frombuffer(self._map, dtype=dtype, count=count,
                             offset=self._data_start + e.begin)
        return flat.reshape(e.shape)

    def array(self, name: str) -> np.ndarray:
        """A copy of the tensor in its stored dtype (native byte order), shape from the header."""
        return np.array(self.view(name), dtype=DTYPES[self.entries[name].dtype].newbyteorder("="))

    def close(self) -> None:
        self._closed = True
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a view() is still alive: the map closes when it is freed
                pass
            self._map = None

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def save_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                     metadata: Mapping[str, str] | None = None) -> None:
    """Writes `tensors` (name -> array of a dtype in `DTYPES`) as one safetensors file.

    Tensors are laid out in name order; the header is padded with spaces to a multiple of 8
    bytes so the data starts aligned.
    """
    header: dict[str, Any] = {}
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError(f"metadata must map strings to strings, got {dict(metadata)!r}")
        header["__metadata__"] = dict(metadata)
    arrays: list[np.ndarray] = []
    offset = 0
    for name in sorted(tensors):
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"tensor name must be a string other than '__metadata__', "
                             f"got {name!r}")
        arr = np.asarray(tensors[name])
        code = _CODES.get(arr.dtype.newbyteorder("="))
        if code is None:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors code "
                             f"(supported: {sorted(DTYPES)})")
        arr = arr.astype(DTYPES[code], order="C", copy=False)  # keeps 0-d shapes
        header[name] = {"dtype": code, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for arr in arrays:
            f.write(arr.reshape(-1).view(np.uint8).data)


def _load_json(path: str, what: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{what} {path} is not valid JSON ({e})") from None


def _block_size(config: Mapping[str, Any]) -> tuple[int, int]:
    """quantization_config.weight_block_size as (rows, cols), default (128, 128)."""
    quant = config.get("quantization_config") or {}
    block = quant.get("weight_block_size", DEFAULT_BLOCK) if isinstance(quant, dict) else None
    if not (isinstance(block, list | tuple) and len(block) == 2
            and all(type(b) is int and b > 0 for b in block)):
        raise ValueError("config.json quantization_config.weight_block_size must be two "
                         f"positive ints, got {block!r}")
    return block[0], block[1]


def dequantize_blocks(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int],
                      name: str = "weight") -> np.ndarray:
    """float32 [out, in]: `weight` [out, in] times the scale of its block, scale [ceil(out/bo),
    ceil(in/bi)] (the last row / column block may be partial). Scales one row block at a time,
    so the only full-size buffer is the float32 result."""
    bo, bi = block
    if weight.ndim != 2:
        raise ValueError(f"tensor {name!r}: block-scaled weight must be 2-D [out, in], got shape "
                         f"{weight.shape}")
    rows, cols = weight.shape
    grid = (-(-rows // bo), -(-cols // bi))
    if scale.shape != grid:
        raise ValueError(f"tensor {name!r}: weight shape {weight.shape} with blocks {list(block)} "
                         f"needs a scale grid of shape {grid}, got {name}{SCALE_SUFFIX} shape "
                         f"{scale.shape}")
    out = weight.astype(np.float32)
    scale = scale.astype(np.float32, copy=False)
    for r in range(grid[0]):
        out[r * bo:(r + 1) * bo] *= np.repeat(scale[r], bi)[:cols]
    return out


class Checkpoint:
    """A Hugging Face checkpoint folder: `config` (config.json), logical tensors by name.

    Tensor names are those of the safetensors headers less the `<weight>_scale_inv` companions of
    fp8 weights, which `read` folds into their weight. Every file stays memory-mapped until
    `close` (or the end of a `with` block).
    """

    def __init__(self, path: str, config: dict[str, Any], files: Iterable[SafetensorsFile]):
        self.path = path
        self.config = config
        self._files = list(files)
        self._where: dict[str, SafetensorsFile] = {}
        for f in self._files:
            for name in f.entries:
                if name in self._where:
                    self.close()
                    raise ValueError(f"tensor {name!r} is in two files: "
                                     f"{self._where[name].path} and {f.path}")
                self._where[name] = f
        self._names = {n for n in self._where
                       if not (n.endswith(SCALE_SUFFIX) and n[:-len(SCALE_SUFFIX)] in self._where)}

    def names(self) -> set[str]:
        """Logical tensor names (fp8 scale companions folded into their weights)."""
        return set(self._names)

    def _entry(self, name: str) -> TensorEntry:
        if name not in self._names:
            hint = (" (a block scale, folded into its weight)" if name in self._where else "")
            raise ValueError(f"checkpoint {self.path}: no tensor named {name!r}{hint}")
        return self._where[name].entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def stored_dtype(self, name: str) -> str:
        """The safetensors dtype code on disk, e.g. "BF16" or "F8_E4M3"."""
        return self._entry(name).dtype

    def is_quantized(self, name: str) -> bool:
        """True when `name` is an fp8 weight with a `<name>_scale_inv` block-scale companion."""
        return self._entry(name).dtype == "F8_E4M3" and name + SCALE_SUFFIX in self._where

    def read(self, name: str, dtype: Any = None) -> np.ndarray:
        """One tensor read from disk now, cast to `dtype` (numpy / ml_dtypes; None: the stored
        dtype, float32 for a dequantized fp8 weight). Quantized weights are dequantized in
        float32 with their block scales before the cast."""
        if self.is_quantized(name):
            scale = self._where[name + SCALE_SUFFIX].view(name + SCALE_SUFFIX)
            out = dequantize_blocks(self._where[name].view(name), scale,
                                    _block_size(self.config), name)
            return out if dtype is None else out.astype(dtype, copy=False)
        self._entry(name)
        if dtype is None:
            return self._where[name].array(name)
        return self._where[name].view(name).astype(dtype)   # one copy, straight from the map

    def close(self) -> None:
        for f in self._files:
            f.close()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({self.path!r}, {len(self._names)} tensors, {len(self._files)} files)"


def _shard_files(folder: str) -> tuple[list[str], dict[str, str]]:
    """(shard paths, weight_map) of `model.safetensors.index.json`, each shard checked to
    exist."""
    index_path = os.path.join(folder, INDEX_FILE)
    index = _load_json(index_path, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not (isinstance(weight_map, dict)
            and all(isinstance(v, str) for v in weight_map.values())):
        raise ValueError(f"index {index_path} must have a weight_map of tensor name -> file name")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if not os.path.isfile(os.path.join(folder, shard)):
            raise ValueError(f"shard {shard!r} named by {index_path} does not exist in {folder}")
    return [os.path.join(folder, s) for s in shards], weight_map


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Opens a checkpoint folder: config.json and `model.safetensors` or
    `model.safetensors.index.json` plus the shards it names (every name of its weight_map must
    be in the shard it points to; a tensor in two shards is an error)."""
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise ValueError(f"checkpoint folder {folder} does not exist or is not a directory")
    config_path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"checkpoint folder {folder} has no {CONFIG_FILE}")
    config = _load_json(config_path, "config")
    if not isinstance(config, dict):
        raise ValueError(f"config {config_path} must be a JSON object")
    if os.path.isfile(os.path.join(folder, INDEX_FILE)):
        paths, weight_map = _shard_files(folder)
    elif os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        paths, weight_map = [os.path.join(folder, SINGLE_FILE)], {}
    else:
        raise ValueError(f"checkpoint folder {folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")
    files: list[SafetensorsFile] = []
    try:
        for p in paths:
            files.append(SafetensorsFile(p))
        ckpt = Checkpoint(folder, config, files)
    except BaseException:
        for f in files:
            f.close()
        raise
    for name, shard in weight_map.items():
        holder = ckpt._where.get(name)
        if holder is None or holder.path != os.path.join(folder, shard):
            ckpt.close()
            raise ValueError(f"index {os.path.join(folder, INDEX_FILE)} maps tensor {name!r} to "
                             f"{shard!r}, which does not hold it")
    return ckpt
