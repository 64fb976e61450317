"""grouped_matmul, jnp reference: `jax.lax.ragged_dot` with float32 accumulation and output.

The contract it defines (and every kernel backend reproduces):

  lhs:          [M, K]     rows sorted by group: group g owns rows [start_g, start_g + n_g),
                           start_g = n_0 + ... + n_{g-1}
  rhs:          [G, K, N]  one matrix per group, lhs's dtype
  group_sizes:  int32[G]   n_g >= 0, sum(n_g) = M (empty groups anywhere)

  out[r] = lhs[r] @ rhs[g(r)]    float32[M, N], g(r) the group owning row r

Products are accumulated in float32 from the inputs as they are (bf16 inputs are not rounded
further). On a CPU the work is proportional to M; XLA's GPU compiler, unless its grouped-GEMM
lowering is turned on, runs it as a dense product of every group's matrix with a masked copy
of the rows (G times the work, a [G, M, K] temporary): the kernels exist for the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """float32[M, N]: rows of group g of lhs [M, K] times rhs[g] [K, N] (module docstring)."""
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=jnp.float32)
