"""A DSA checkpoint loaded straight into its parameters' places over a device mesh
(`load_placed`, what `from_pretrained(..., mesh=)` runs), by the tensor-parallel
`PartitionSpec`s the model's `tensor_parallel_dim` names (`protocol.partition_specs`, what
`hisparse_jax.engine.mesh.MeshEngine` places by).

`load_placed` creates each parameter as a global array with its `NamedSharding` from the
checkpoint slices its devices hold: per distinct slice (devices of the slice's replicas share
one read), the tensors that fill it are read (`Checkpoint.read`: a memory-mapped file
slice), cut to the slice and copied to those devices, then dropped. An expert stack split on
its expert dim reads only the per-expert tensors of the slice's experts, so a device's
experts are the only ones read for it; a dense tensor split over the axis is read whole
(one tensor in host memory) and cut. No device holds more than its slices, and the host
holds one slice (and the tensor it is cut from) at a time, never a copy of the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from hisparse_jax.models.dsa_config import DSAConfig
from hisparse_jax.models.dsa_weights import Slot, check_names, tensor_map, to_parameter_layout
from hisparse_jax.models.protocol import MODEL_AXIS, partition_spec


def place(shape: tuple[int, ...], dtype: Any, sharding: NamedSharding,
          make: Callable[[tuple[slice, ...]], np.ndarray]) -> jax.Array:
    """A global array of `shape` / `dtype` under `sharding`, its local devices filled from
    `make(index)` (the numpy value of the slice `index`), called once per distinct slice;
    each slice is copied to its devices and dropped before the next is made."""
    index_map = sharding.addressable_devices_indices_map(shape)
    by_slice: dict[tuple, list[jax.Device]] = {}
    for device, index in index_map.items():
        key = tuple(s.indices(n) for s, n in zip(index, shape, strict=True))
        by_slice.setdefault(key, []).append(device)
    arrays: dict[jax.Device, jax.Array] = {}
    for key, devices in by_slice.items():
        value = np.ascontiguousarray(make(tuple(slice(*k) for k in key)), dtype=dtype)
        for device in devices:
            arrays[device] = jax.device_put(value, device)
        del value
    return jax.make_array_from_single_device_arrays(
        shape, sharding, [arrays[d] for d in index_map])


def _parameter_slots(cfg: DSAConfig) -> dict[tuple, list[tuple[str, Slot]]]:
    """Parameter path -> the (checkpoint name, slot) pairs that fill it."""
    out: dict[tuple, list[tuple[str, Slot]]] = {}
    for name, (_, slots) in tensor_map(cfg).items():
        for slot in slots:
            out.setdefault(slot.path, []).append((name, slot))
    return out


def _variable(model: Any, path: tuple) -> nnx.Variable:
    obj = model
    for key in path:
        obj = obj[key] if isinstance(key, int) else getattr(obj, key)
    return obj


def _slice_reader(read: Callable[[str, Any], np.ndarray], cfg: DSAConfig,
                  fills: list[tuple[str, Slot]], shape: tuple[int, ...], dtype: Any
                  ) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """make(index) for `place`: the slice `index` of the parameter that `fills` fill."""
    if fills[0][1].expert is None:
        (name, slot), = fills

        def make(index):
            return to_parameter_layout(read(name, dtype), slot, cfg)[index]
        return make
    by_expert: dict[int, list[tuple[str, Slot]]] = {}
    for name, slot in fills:
        by_expert.setdefault(slot.expert, []).append((name, slot))

    def make_experts(index):
        experts = range(shape[0])[index[0]]
        out = np.zeros((len(experts), *shape[1:]), dtype)
        for i, e in enumerate(experts):  # only this slice's experts are read
            for name, slot in by_expert[e]:
                value = to_parameter_layout(read(name, dtype), slot, cfg)
                out[i, ..., slot.offset:slot.offset + value.shape[-1]] = value
        return out[(slice(None), *index[1:])]
    return make_experts


def load_placed(model: Any, ckpt: Any, mesh: Mesh, *, cfg: DSAConfig | None = None,
                axis: str = MODEL_AXIS) -> None:
    """Fills the abstract parameters of DSA `model` (`nnx.eval_shape`) with global arrays
    over `mesh`: each split over `axis` on its `tensor_parallel_dim` and replicated over the
    mesh's other axes (module docstring), read from `ckpt` (a `Checkpoint`).

    Raises:
      ValueError: `mesh` has no axis `axis`; a tensor is missing, unexpected or of another
        shape than the config's (named); the axis size does not divide a split dim.
    """
    cfg = model.cfg if cfg is None else cfg
    if axis not in mesh.axis_names:
        raise ValueError(f"from_pretrained mesh must have an axis {axis!r} (the "
                         f"tensor-parallel one), got axes {tuple(mesh.axis_names)}")
    names = ckpt.names()
    check_names(cfg, names)
    for name, (shape, _) in tensor_map(cfg).items():
        if tuple(ckpt.shape(name)) != shape:
            raise ValueError(f"checkpoint tensor {name}: expected shape {shape}, found "
                             f"{tuple(ckpt.shape(name))}")
    rule, size = model.tensor_parallel_dim, mesh.shape[axis]
    for path, fills in _parameter_slots(cfg).items():
        var = _variable(model, path)
        abstract = var.get_value()
        shape, dtype = tuple(abstract.shape), np.dtype(abstract.dtype)
        spec = partition_spec(rule, ".".join(map(str, path)), shape, axis, size)
        var.set_value(place(shape, dtype, NamedSharding(mesh, spec),
                            _slice_reader(ckpt.read, cfg, fills, shape, dtype)))
