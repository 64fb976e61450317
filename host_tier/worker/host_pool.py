"""`HostPool`: the pinned host KV pool, one `[num_blocks, B, W]` array per sparse layer, or one
`[num_blocks, B, G * W]` array per G layers kept side by side (packed).

The arrays live in `pinned_host` memory (copies from pageable memory to the device are much
slower). Host block 0 is the null block: it is allocated like the others but never handed out by
the host `BlockPool` (`host_tier/scheduler/block_pool.py`).

Rules the owner of the arrays must follow:
  - never keep a numpy view of a pool array (`np.asarray(arr)`): a live view blocks donation, so
    the next in-place copy would silently copy the whole pool (CPU) or fail (GPU). Use
    `read_rows`, which returns copies;
  - a copy that writes into the pool donates the old array and returns the new one: hand it back
    with `replace_layer`;
  - one owner at a time (`claim` / `release`): two users writing blocks of one pool would
    overwrite each other's rows (each keeps its own block allocator), so a serving engine
    claims its pool for its lifetime.
"""

from __future__ import annotations

import math
import os
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from host_tier.sizes import check_int, config_size, is_int
from pallas_kernels import _compat

HOST_MEMORY_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
DEFAULT_HOST_MEMORY_LIMIT_GB = 64  # XLA's default cap on its pinned host allocator
RAM_FRACTION_LIMIT = 0.95
_GIB = 1 << 30


def memory_sharding(device: jax.Device | Sequence[jax.Device],
                    memory_kind: str) -> jax.sharding.Sharding:
    """A one-device sharding in `memory_kind` memory (e.g. "pinned_host"), for pools; given
    several devices, the array replicated on each of them (a mesh shard's devices).

    A NamedSharding over a one-device mesh, not a SingleDeviceSharding: on jax 0.10.2 and
    0.11.2 a jit output placed by `out_shardings=SingleDeviceSharding(..., "pinned_host")`
    is typed as device memory (`jax.typeof(x).memory_space`) although its buffer is pinned,
    so a pool written by a kernel would reach the next jit as a device operand. A
    NamedSharding carries the memory space into the output type.
    """
    devices = list(device) if isinstance(device, (list, tuple)) else [device]
    mesh = jax.sharding.Mesh(np.array(devices), ("one",))
    return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(),
                                      memory_kind=memory_kind)


def available_ram_bytes() -> int:
    """RAM the OS reports as available (psutil if installed, else /proc/meminfo, else sysconf)."""
    try:
        import psutil  # optional

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def required_host_memory_limit_gb(pool_bytes: int) -> int:
    """The `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` a pool of `pool_bytes` needs (5% + 1 GiB headroom
    for the allocator and other pinned buffers)."""
    return math.ceil(pool_bytes * 1.05 / _GIB) + 1


def ensure_host_memory_limit(pool_bytes: int, *, environ: Any = None,
                             backends_initialized: bool | None = None,
                             platform: str | None = None) -> str:
    """Makes XLA's pinned-host allocator cap large enough for a pool of `pool_bytes`.

    Pools that fit the default 64 GiB cap (headroom included) need nothing when the variable is
    unset. Otherwise: before JAX initialises its backends,
    raises `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` (never lowers it); afterwards the variable has been
    read already, so a cap that is too small is an error on a GPU backend and a warning elsewhere
    (the cap only applies to GPUs).

    Returns what was done: "not needed", "set", "already sufficient" or "too small" (warned).
    The keyword arguments exist for tests; by default they come from `os.environ` and JAX.

    Raises:
      ValueError: the backend is initialised on a GPU and the cap is below what the pool needs.
    """
    environ = os.environ if environ is None else environ
    needed = required_host_memory_limit_gb(pool_bytes)
    current_text = environ.get(HOST_MEMORY_LIMIT_ENV)
    try:
        current = float(current_text) if current_text else None
    except ValueError:
        raise ValueError(
            f"{HOST_MEMORY_LIMIT_ENV}={current_text!r} is not a number") from None
    if current is None and needed <= DEFAULT_HOST_MEMORY_LIMIT_GB:
        return "not needed"
    if current is not None and current >= needed:
        return "already sufficient"
    if backends_initialized is None:
        backends_initialized = _compat.backends_initialized()
    if not backends_initialized:
        environ[HOST_MEMORY_LIMIT_ENV] = str(needed)
        return "set"
    effective = current if current is not None else DEFAULT_HOST_MEMORY_LIMIT_GB
    message = (
        f"the host pool needs {pool_bytes / _GIB:.1f} GiB of pinned host memory, but JAX was "
        f"initialised with {HOST_MEMORY_LIMIT_ENV}={effective:g}; set "
        f"{HOST_MEMORY_LIMIT_ENV}={needed} before JAX initialises (create the HostPool before "
        f"any other JAX call) or lower host_pool_gib")
    if platform is None:
        platform = jax.default_backend()
    if platform == "gpu":
        raise ValueError(message)
    warnings.warn(message + f" (ignored on the {platform} backend)", stacklevel=3)
    return "too small"


def check_available_ram(pool_bytes: int, *, available: int | None = None,
                        what: str = "host_pool_gib") -> None:
    """Refuses a pool larger than 95% of the available RAM.

    Raises:
      ValueError: naming `what` (the knob to lower) and both sizes.
    """
    available = available_ram_bytes() if available is None else available
    if pool_bytes > RAM_FRACTION_LIMIT * available:
        raise ValueError(
            f"{what} asks for {pool_bytes / _GIB:.2f} GiB of pinned host memory, more than "
            f"{RAM_FRACTION_LIMIT:.0%} of the {available / _GIB:.2f} GiB of RAM available; "
            f"lower {what} or free memory for co-tenants")


class HostPool:
    """Pinned host KV arrays, one `[num_blocks, block_size, row_width]` array per layer, or
    (`layers_per_array` G > 1) one `[num_blocks, block_size, G * row_width]` array per G
    consecutive layers: layer l's row r is columns `(l % G) * row_width` on of row r of array
    `l // G`. Packing the layers that share a swap plan (an index group) makes every row a
    gather reads G times wider, and a random pinned-host row costs a fixed overhead beside
    its bytes (`docs/host_pool.md`). The one-layer copies address a packed array by its flat
    `row_width`-wide rows: `layer_rows`.

    A row is opaque here: `row_width` elements of `dtype` as the device caches store them
    (e.g. 576 bfloat16 values, or 656 uint8 bytes of an fp8 row format).

    Give exactly one of `host_pool_gib` (a byte budget for all layers together; the pool holds
    `floor(budget / (num_layers * B * W * itemsize))` blocks) or `num_blocks`.

    The request is checked against the available RAM (more than 95% is refused) before anything
    is allocated, and `XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB` is set or checked for pools above
    64 GiB (`ensure_host_memory_limit`). `close()` (or leaving a `with` block) deletes the arrays
    so the memory is released at a known point; a closed pool refuses further use.

    Args:
      num_layers: sparse layers.
      block_size: B, rows per block.
      row_width: W, elements per row.
      dtype: element type.
      host_pool_gib: byte budget in GiB (2**30 bytes).
      num_blocks: exact number of blocks, null block included (>= 2).
      device: the device whose pinned host memory holds the pool (default: first device);
        a tuple of devices: one copy per device (a mesh shard's devices).
      memory_kind: "pinned_host" (default); "unpinned_host" or "device" only for experiments.
      layers_per_array: G, consecutive layers kept side by side in one array (dividing
        num_layers); 1 (default): one array per layer.
    """

    def __init__(self, *, num_layers: int, block_size: int, row_width: int, dtype: Any,
                 host_pool_gib: float | None = None, num_blocks: int | None = None,
                 device: jax.Device | None = None, memory_kind: str = "pinned_host",
                 layers_per_array: int = 1) -> None:
        self.num_layers = check_int("HostPool", "num_layers", num_layers)
        self.layers_per_array = check_int("HostPool", "layers_per_array", layers_per_array)
        if self.num_layers % self.layers_per_array:
            raise ValueError(
                f"HostPool.layers_per_array={layers_per_array} must divide "
                f"num_layers={num_layers} (each array holds that many whole layers)")
        self.num_arrays = self.num_layers // self.layers_per_array
        self.block_size = check_int("HostPool", "block_size", block_size)
        self.row_width = check_int("HostPool", "row_width", row_width)
        self.dtype = np.dtype(dtype)
        num_layers, block_size, row_width = self.num_layers, self.block_size, self.row_width
        self.block_bytes = num_layers * block_size * row_width * self.dtype.itemsize
        if (host_pool_gib is None) == (num_blocks is None):
            raise ValueError("HostPool needs exactly one of host_pool_gib and num_blocks")
        if host_pool_gib is not None:
            if not isinstance(host_pool_gib, (int, float)) or not host_pool_gib > 0:
                raise ValueError(
                    f"HostPool.host_pool_gib must be a positive number, got {host_pool_gib!r}")
            num_blocks = int(host_pool_gib * _GIB // self.block_bytes)
            if num_blocks < 2:
                raise ValueError(
                    f"host_pool_gib={host_pool_gib} holds {num_blocks} blocks of "
                    f"{self.block_bytes} bytes (all layers); the pool needs at least 2 "
                    "(block 0 is the null block)")
        elif not is_int(num_blocks) or num_blocks < 2:
            raise ValueError(
                f"HostPool.num_blocks must be an int >= 2 (block 0 is the null block), "
                f"got {num_blocks!r}")
        self.num_blocks = num_blocks = int(num_blocks)
        self.nbytes = num_blocks * self.block_bytes
        what = "host_pool_gib" if host_pool_gib is not None else "num_blocks"
        check_available_ram(self.nbytes, what=what)
        ensure_host_memory_limit(self.nbytes)

        device = device or jax.devices()[0]
        first = device[0] if isinstance(device, (list, tuple)) else device
        kinds = [m.kind for m in first.addressable_memories()]
        if memory_kind not in kinds:
            raise ValueError(
                f"HostPool.memory_kind={memory_kind!r} is not a memory of {device} "
                f"(it has {kinds})")
        self.sharding = memory_sharding(device, memory_kind)
        self.shape = (num_blocks, block_size, self.layers_per_array * row_width)
        self._owner: weakref.ref | None = None  # `claim`: the one user writing its blocks
        self._arrays: list[jax.Array] | None = []
        try:
            for _ in range(self.num_arrays):
                # np.zeros maps untouched zero pages, so the staging copy costs no RAM of its own.
                self._arrays.append(
                    jax.device_put(np.zeros(self.shape, self.dtype), self.sharding))
        except BaseException:
            self.close()
            raise

    @classmethod
    def from_config(cls, config: Any, *, num_layers: int, device: jax.Device | None = None,
                    host_pool_gib: float | None = None, memory_kind: str = "pinned_host",
                    layers_per_array: int = 1) -> HostPool:
        """A pool sized by a sizes object (e.g. `hisparse_jax.HiSparseConfig`).

        Reads `config.block_size`; the stored row: `config.storage_width` and
        `config.storage_dtype` where the config has them (a row format that stores rows in
        another shape than their values, e.g. `HiSparseConfig(kv_format="fp8_ds_mla")`:
        uint8[656]), else `config.row_width` and `config.kv_dtype`; and
        `config.num_host_blocks` unless `host_pool_gib` is given (then the byte budget sets the
        block count and `num_host_blocks` is not read).

        Raises:
          ValueError: a size it reads is None or missing, or invalid (as in the constructor).
        """
        owner = "HostPool.from_config"
        stored = hasattr(config, "storage_width") and hasattr(config, "storage_dtype")
        width, dtype = (("storage_width", "storage_dtype") if stored
                        else ("row_width", "kv_dtype"))
        sizes = {name: config_size(config, name, owner=owner)
                 for name in ("block_size", width, dtype)}
        num_blocks = None if host_pool_gib is not None else config_size(
            config, "num_host_blocks", owner=owner)
        return cls(num_layers=num_layers, block_size=sizes["block_size"],
                   row_width=sizes[width], dtype=sizes[dtype],
                   host_pool_gib=host_pool_gib, num_blocks=num_blocks, device=device,
                   memory_kind=memory_kind, layers_per_array=layers_per_array)

    # ------------------------------------------------------------------ access

    @property
    def closed(self) -> bool:
        return self._arrays is None

    @property
    def arrays(self) -> tuple[jax.Array, ...]:
        """The pool's arrays: one per layer, or one per `layers_per_array` layers."""
        return tuple(self._live())

    def layer(self, index: int) -> jax.Array:
        """The array holding layer `index` (its own, or the packed one it shares)."""
        return self._live()[self.array_index(index)]

    def array_index(self, layer: int) -> int:
        """The index in `arrays` of the array holding `layer`."""
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer index must be in [0, {self.num_layers}), got {layer}")
        return layer // self.layers_per_array

    def layer_rows(self, layer: int, rows: np.ndarray) -> np.ndarray:
        """Host rows (flat `block * B + offset`; negative: none) of `layer` as row ids of its
        array's flat `row_width`-wide rows, the ids the one-layer copies take: `r * G + slot`
        (`rows` itself when G is 1; negative ids stay as they are)."""
        self.array_index(layer)
        rows = np.asarray(rows)
        g = self.layers_per_array
        if g == 1:
            return rows
        return np.where(rows >= 0, rows * g + layer % g, rows).astype(rows.dtype)

    def replace_layer(self, index: int, array: jax.Array) -> None:
        """Installs the array an in-place copy of layer `index` returned (the previous array
        holding that layer was donated): `replace_array(array_index(index), array)`."""
        self.replace_array(self.array_index(index), array)

    def replace_array(self, index: int, array: jax.Array) -> None:
        """Installs the array an in-place copy returned (the previous one was donated).

        Raises:
          ValueError: wrong shape, dtype or memory kind (the pool must stay pinned).
        """
        arrays = self._live()
        if not 0 <= index < len(arrays):
            raise ValueError(f"array index must be in [0, {len(arrays)}), got {index}")
        if tuple(array.shape) != self.shape or np.dtype(array.dtype) != self.dtype:
            raise ValueError(
                f"the pool needs a {self.dtype}{list(self.shape)} array, got "
                f"{array.dtype}{list(array.shape)}")
        kind = getattr(array.sharding, "memory_kind", None)
        if kind != self.sharding.memory_kind:
            raise ValueError(
                f"the pool needs an array in {self.sharding.memory_kind!r} memory, got "
                f"{kind!r}: a copy into the pool must return it there (out_shardings)")
        old = arrays[index]
        arrays[index] = array
        if old is not array and not old.is_deleted():
            old.delete()

    def read_rows(self, layer: int, rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """Copies of host rows (flat row ids `block * B + offset`) of one layer, for tests/debug."""
        rows = np.asarray(rows, np.int64).reshape(-1)
        total = self.num_blocks * self.block_size
        if rows.size and (rows.min() < 0 or rows.max() >= total):
            raise ValueError(f"rows must be in [0, {total}), got {rows.min()}..{rows.max()}")
        flat = np.array(self.layer(layer), copy=True).reshape(-1, self.row_width)
        return flat[self.layer_rows(layer, rows)]

    # ------------------------------------------------------------------ ownership

    @property
    def owner(self) -> Any:
        """The object that claimed the pool and has not released it (None: free). Held by a
        weak reference: an owner that no longer exists holds nothing."""
        return None if self._owner is None else self._owner()

    def claim(self, owner: Any) -> None:
        """Makes `owner` (any object that takes weak references, e.g. an engine) the pool's
        one user until `release(owner)`; claiming again by the same owner is a no-op.

        Raises:
          ValueError: the pool is closed, or another owner holds it.
        """
        self._live()
        current = self.owner
        if current is not None and current is not owner:
            raise ValueError(f"HostPool is in use by a live {type(current).__name__}; the rule: "
                             "one owner at a time, until it releases the pool")
        self._owner = weakref.ref(owner)

    def release(self, owner: Any) -> None:
        """Frees the pool when `owner` holds it (nothing otherwise; also after `close`)."""
        if self.owner is owner:
            self._owner = None

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Deletes every array now (idempotent). The pool is unusable afterwards.

        The memory goes back to XLA's pinned host allocator at once, where the next pinned
        allocation reuses it (much cheaper than the first allocation, which pins fresh pages);
        the allocator may keep it mapped, so the process RSS need not drop.
        """
        arrays, self._arrays = self._arrays, None
        for array in arrays or ():
            if not array.is_deleted():
                array.delete()

    def __enter__(self) -> HostPool:
        self._live()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.nbytes / _GIB:.3f} GiB"
        packed = (f", {self.layers_per_array} layers per array"
                  if self.layers_per_array > 1 else "")
        return (f"HostPool(layers={self.num_layers}, blocks={self.num_blocks}, "
                f"B={self.block_size}, W={self.row_width}, {self.dtype}{packed}, {state})")

    def _live(self) -> list[jax.Array]:
        if self._arrays is None:
            raise ValueError("HostPool is closed")
        return self._arrays
