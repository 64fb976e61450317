"""The layout of index groups: which layers share one top-k, one lookup and one hot state.

A model's L layers with a KV cache form G index groups of consecutive layers, given by their
layer counts `group_layers` = (n_0, ..., n_{G-1}) in layer order (sum L): group g is layers
[offset_g, offset_g + n_g), offset_g = n_0 + ... + n_{g-1}. The first layer of a group
selects the group's top-k; every layer of the group attends to it. The groups may differ in
size: GLM-5 has "full" indexer layers and "shared" layers that reuse the previous full
layer's top-k, e.g. full, full, shared, full, shared -> (1, 2, 2). Groups of one size n are
also given as an int (`index_group_size` n: group g is layers [g * n, (g + 1) * n)).

The functions here are plain Python over those static tuples (no arrays, except
`layer_rows`, which weighs per-group counts of any array type), shared by the KV-cache
handle (`hisparse_jax.cache`), the engine and the host pool's packing rule.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np


def equal_group_layers(num_layers: int, group_size: int) -> tuple[int, ...]:
    """The layer counts of `num_layers` layers in index groups of `group_size` each (the
    last group short when group_size does not divide num_layers)."""
    full, rest = divmod(num_layers, group_size)
    return (group_size,) * full + ((rest,) if rest else ())


def group_sizes(group_layers: int | Sequence[int], num_layers: int | None = None
                ) -> tuple[int, ...]:
    """Each index group's layer count: `group_layers` as a tuple of ints, or (an int n)
    groups of n layers over num_layers.

    Raises:
      ValueError: an int without num_layers, or a tuple whose sum is not num_layers.
    """
    if isinstance(group_layers, numbers.Integral):
        if num_layers is None:
            raise ValueError(f"an index group size ({group_layers}) needs num_layers")
        return equal_group_layers(num_layers, int(group_layers))
    groups = tuple(int(n) for n in group_layers)
    if num_layers is not None and sum(groups) != num_layers:
        raise ValueError(f"index groups of {groups} layers must add up to num_layers="
                         f"{num_layers}")
    return groups


def checked_group_layers(num_layers: int, index_group_size: int = 1,
                         group_layers: Sequence[int] | None = None) -> tuple[int, ...]:
    """Each index group's layer count: `group_layers` when given, else groups of
    `index_group_size` layers.

    Raises:
      ValueError: naming the argument: group_layers are not positive ints adding up to
        num_layers; index_group_size is not a positive int dividing num_layers; both are
        given and differ (index_group_size other than 1 and not every group's size).
    """
    if group_layers is None:
        if (not isinstance(index_group_size, numbers.Integral) or isinstance(index_group_size, bool)
                or index_group_size < 1 or num_layers % index_group_size):
            raise ValueError(f"index_group_size must be a positive int dividing num_layers="
                             f"{num_layers}, got {index_group_size!r}")
        return equal_group_layers(num_layers, int(index_group_size))
    groups = tuple(group_layers)
    if (not groups or any(not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 1
                          for n in groups) or sum(groups) != num_layers):
        raise ValueError(f"group_layers must be positive ints adding up to num_layers="
                         f"{num_layers}, got {group_layers!r}")
    if index_group_size != 1 and set(groups) != {index_group_size}:
        raise ValueError(f"index_group_size={index_group_size} differs from group_layers="
                         f"{groups}: give one of them")
    return tuple(int(n) for n in groups)


def group_slice(group_layers: Sequence[int], group: int) -> slice:
    """The layers [offset_g, offset_g + n_g) of index group `group` (ValueError when out of
    range)."""
    sizes = tuple(group_layers)
    if not 0 <= group < len(sizes):
        raise ValueError(f"index group {group} is out of range: there are {len(sizes)} "
                         f"groups of {sizes} layers")
    start = sum(sizes[:group])
    return slice(start, start + sizes[group])


def layer_group(group_layers: Sequence[int], layer: int) -> tuple[int, int]:
    """(g, i): layer `layer` is the i-th layer of index group g (i == 0: the group's first
    layer, the one that selects its top-k). ValueError when out of range."""
    start = 0
    for group, size in enumerate(group_layers):
        if 0 <= layer < start + size:
            return group, layer - start
        start += size
    raise ValueError(f"layer {layer} is out of range: there are {start} layers")


def packed_layers(group_layers: Sequence[int]) -> int:
    """G, the most layers one host pool array can hold side by side (`pack_host_layers`): an
    array holds the layers of one index group only, so G is the greatest common divisor of
    the group sizes: the group size when the groups are equal, 1 for GLM-5's (1, 2, 2)."""
    return math.gcd(*(int(n) for n in group_layers))


def layers_per_pool_array(num_arrays: int, num_layers: int,
                          group_layers: int | Sequence[int]) -> int:
    """G, the layers each of a host pool's `num_arrays` arrays holds side by side, for
    `num_layers` layers in index groups of `group_layers` layers (an int: every group that
    size; a tuple: each group's layer count in layer order). 1: one array per layer.

    An array holds the layers of one index group only, so G divides every group's size
    (`packed_layers`: their greatest common divisor at most).

    Raises:
      ValueError: the arrays do not split the layers into whole groups (their number must
        divide num_layers, and G divide every index group's size).
    """
    uniform = isinstance(group_layers, numbers.Integral)
    sizes = (int(group_layers),) if uniform else tuple(group_layers)
    pack = num_layers // num_arrays if num_arrays and num_layers % num_arrays == 0 else 0
    if not pack or any(n % pack for n in sizes):
        if uniform:
            raise ValueError(
                f"host_pools has {num_arrays} arrays for {num_layers} layers in index groups "
                f"of {group_layers}; the rule is one array per layer, or one per G layers "
                "with G dividing the index group size")
        raise ValueError(
            f"host_pools has {num_arrays} arrays for {num_layers} layers in index groups of "
            f"{sizes} layers; the rule is one array per layer, or one per G layers with G "
            "dividing every index group's size")
    return pack


def layer_rows(counts: Any, group_layers: Sequence[int], *, what: str = "counts") -> Any:
    """Rows counted once per layer they are copied into: per-group row counts (a lookup's
    misses, a prefill's staged rows), each row of group g copied into its n_g layers, so
    sum_g n_g * counts[g].

    counts: an int or array (NumPy or JAX, any integer dtype). With groups of equal size n
    any shape (every row weighs n: sum(counts) * n); with groups of unequal size its leading
    dim is G, one entry (or slice) per group. Returns a scalar of the counts' array type.

    Raises:
      ValueError: naming `what` and the rule, when the groups differ in size and counts
        have no leading dim of G.
    """
    sizes = tuple(int(n) for n in group_layers)
    counts = counts if hasattr(counts, "shape") else np.asarray(counts)
    if len(set(sizes)) == 1:
        return counts.sum() * sizes[0]
    if counts.ndim == 0 or counts.shape[0] != len(sizes):
        raise ValueError(
            f"{what} must be counted per index group (leading dim {len(sizes)}) for a model "
            f"whose index groups differ in size ({sizes} layers), got shape "
            f"{tuple(counts.shape)}")
    weights = np.asarray(sizes, np.int32).reshape((-1,) + (1,) * (counts.ndim - 1))
    return (counts * weights).sum()
