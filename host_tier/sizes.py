"""Small size rules used across the project, written once (standard library only).

`hisparse_jax`, both sides of `host_tier`, the examples and the benchmarks import these;
`pallas_kernels` (a lower layer) keeps its own tile-shape helpers.
"""

from __future__ import annotations

import numbers
from typing import Any


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for ints, b > 0 (e.g. pages needed by a tokens: cdiv(a, block_size))."""
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    """The smallest multiple of b that is >= a (b > 0)."""
    return cdiv(a, b) * b


def pow2_bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum): padded sizes of host-built arrays (row
    lists, table updates), so that the jitted functions that take them compile for a few
    sizes only. `minimum` must itself be a power of two."""
    return max(minimum, 1 << max(int(n) - 1, 0).bit_length())


def is_int(value: Any) -> bool:
    """A Python or NumPy integer that is not a bool."""
    return type(value) is int or (  # the common case first: an ABC check costs more
        isinstance(value, numbers.Integral) and not isinstance(value, bool))


def check_int(owner: str, name: str, value: Any, *, minimum: int = 1) -> int:
    """`value` as an int; raises ValueError naming `owner.name` and the rule unless it is an
    integer >= minimum (a bool is not an integer here). The rule reads "a positive int" for
    minimum 1, "an int >= minimum" otherwise."""
    if not is_int(value) or value < minimum:
        rule = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{owner}.{name} must be {rule}, got {value!r}")
    return int(value)


def config_size(config: Any, name: str, *, owner: str, keyword: bool = False) -> Any:
    """`config.<name>` of a duck-typed sizes object (e.g. `hisparse_jax.HiSparseConfig`).

    Args:
      owner: the reader, named in the error ("Coordinator.from_config").
      keyword: the reader also takes `name=` as a keyword argument (the error says so).

    Raises:
      ValueError: the attribute is missing or None.
    """
    value = getattr(config, name, None)
    if value is None:
        hint = f" or pass {name}= to {owner}" if keyword else ""
        raise ValueError(f"{owner}: config.{name} is None or missing; set it on the "
                         f"{type(config).__name__}{hint}")
    return value
