"""The MLPs of the DSA decoder (`hisparse_jax.models.dsa_layers`): the dense SwiGLU MLP and
the DeepSeek-V3 mixture of experts.

* `SwiGLU`: down(silu(gate(x)) * up(x)), the dense layers' MLP and the MoE's shared experts.
* `Router`: sigmoid scores of float32 logits (the router weight and its score-correction
  bias are float32 parameters whatever the model's dtype, as transformers keeps them); the
  experts are chosen by score + bias, group-limited (the `topk_group` groups of highest
  top-2 sum first); their weights are the unbiased scores, normalised to sum 1 when
  `norm_topk_prob`, times `routed_scaling_factor`.
* `MoE`: the routed experts as grouped matmuls (`jax.lax.ragged_dot`) over the token-expert
  pairs sorted by expert (gate and up fused into one [E, H, 2I] stack, down [E, I, H]), each
  pair's output weighted and summed back to its token in float32; plus the shared experts.
  Split over a mesh axis (`MoE.split_experts`, `expert_parallel`), each device of the axis
  multiplies by its own E / M experts only and the partial sums are added over the axis.

`grouped_matmul` is the one place the experts' grouped matmuls run: the op
`hisparse_jax.ops.grouped_matmul`, whose registry picks the backend (`jax.lax.ragged_dot` off
the GPU and for float32; on a GPU a Pallas kernel whose work follows the pairs, where XLA's
own lowering of `ragged_dot` multiplies every expert's weights by a masked copy of all rows).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from hisparse_jax import ops
from hisparse_jax.models.dsa_config import DSAConfig
from hisparse_jax.models.synthetic_layers import as_dtype, linear
from pallas_kernels import _compat

_HI = jax.lax.Precision.HIGHEST


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)) with kernels gate, up [H, width] and down [width, H]."""

    def __init__(self, cfg: DSAConfig, width: int, *, rngs: nnx.Rngs):
        self.gate = linear(cfg, cfg.hidden_size, width, rngs)
        self.up = linear(cfg, cfg.hidden_size, width, rngs)
        self.down = linear(cfg, width, cfg.hidden_size, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Router(nnx.Module):
    """DeepSeek-V3's group-limited sigmoid router (module docstring).

    kernel float32[H, E] (the transpose of the checkpoint's `mlp.gate.weight` [E, H]), bias
    float32[E] (`mlp.gate.e_score_correction_bias`): it moves the choice, never the weights.
    """

    def __init__(self, cfg: DSAConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        H, E = cfg.hidden_size, cfg.n_routed_experts
        self.kernel = nnx.Param(nnx.initializers.normal(H ** -0.5)(rngs.params(), (H, E),
                                                                   jnp.float32))
        self.bias = nnx.Param(jnp.zeros((E,), jnp.float32))

    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """x [T, H] -> (weights float32[T, K], experts int32[T, K]), K = num_experts_per_tok
        (experts distinct per row, in no particular order)."""
        scores = jax.nn.sigmoid(jnp.dot(x.astype(jnp.float32), self.kernel[...], precision=_HI))
        experts = choose_experts(scores, self.bias[...], self.cfg)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if self.cfg.norm_topk_prob:
            weights = weights / (jnp.sum(weights, -1, keepdims=True) + 1e-20)
        return weights * self.cfg.routed_scaling_factor, experts


def choose_experts(scores: jax.Array, bias: jax.Array, cfg: DSAConfig) -> jax.Array:
    """int32[T, K] experts of each row: the K highest score + bias among the experts of the
    row's `topk_group` best groups (a group's score: the sum of its two highest score + bias;
    `n_group` equal groups of consecutive experts)."""
    T, E = scores.shape
    G = cfg.n_group
    choice = scores + bias
    top2, _ = jax.lax.top_k(choice.reshape(T, G, E // G), 2)
    _, groups = jax.lax.top_k(jnp.sum(top2, -1), cfg.topk_group)              # [T, topk_group]
    keep = jnp.any(jax.nn.one_hot(groups, G, dtype=jnp.bool_), axis=-2)      # [T, G]
    choice = jnp.where(jnp.repeat(keep, E // G, axis=-1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    return experts.astype(jnp.int32)


def grouped_matmul(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                   backend: str | None = None) -> jax.Array:
    """float32[M, N]: rows [start_e, start_e + group_sizes[e]) of lhs [M, K] times rhs[e]
    [K, N], groups in order (sum(group_sizes) = M), accumulated in float32
    (`hisparse_jax.ops.grouped_matmul`; backend None: the registry's choice)."""
    return ops.grouped_matmul(lhs, rhs, group_sizes, backend=backend)


def routed_experts(x: jax.Array, weights: jax.Array, experts: jax.Array,
                   w_gate_up: jax.Array, w_down: jax.Array, *,
                   backend: str | None = None, out_dtype: Any = None) -> jax.Array:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) -> [T, H] in out_dtype (default:
    x's dtype; float32 returns the float32 sums unrounded).

    x [T, H]; weights float32[T, K]; experts int32[T, K]; w_gate_up [E, H, 2I] (gate then
    up), w_down [E, I, H]. The T * K token-expert pairs are sorted by expert and each
    expert's run multiplied by its weights in one grouped matmul (`grouped_matmul`), never
    a loop over every expert; `backend` picks its implementation (None: the op registry's
    default). Each expert's output is rounded to x's dtype
    (as a per-expert matmul in that dtype would), weighted in float32 and summed per token in
    float32.
    """
    T, K = experts.shape
    E, _, I2 = w_gate_up.shape
    dt = x.dtype
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // K
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    h = grouped_matmul(x[token], w_gate_up.astype(dt), sizes, backend=backend).astype(dt)
    gate, up = h[:, : I2 // 2], h[:, I2 // 2:]
    act = (jax.nn.silu(gate.astype(jnp.float32)).astype(dt).astype(jnp.float32)
           * up.astype(jnp.float32)).astype(dt)
    y = grouped_matmul(act, w_down.astype(dt), sizes, backend=backend).astype(dt)
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    out = jnp.zeros((T, x.shape[-1]), jnp.float32).at[token].add(y)
    return out.astype(dt if out_dtype is None else out_dtype)


def expert_parallel(x: jax.Array, weights: jax.Array, experts: jax.Array,
                    w_gate_up: jax.Array, w_down: jax.Array, *, mesh: Any, axis: str,
                    backend: str | None = None) -> jax.Array:
    """`routed_experts` with the expert stacks split over mesh axis `axis` (M devices, E / M
    consecutive experts each): [T, H] in x's dtype.

    A `shard_map` manual over `axis` (the mesh's other axes: as the caller has them, e.g.
    manual "data" in the mesh engine's decode step): x, weights and experts are replicated
    over `axis`; device m holds experts [m * E/M, (m + 1) * E/M) of w_gate_up / w_down and
    multiplies only by those (the token-expert pairs of other devices' experts ride along at
    weight 0 in its first expert's group: `grouped_matmul`'s groups cover every row), so no
    device reads another's expert weights; the float32 partial sums are added over `axis`
    (psum) and rounded to x's dtype once, as `routed_experts` rounds its float32 sum.
    """
    def local(x, weights, experts, w_gate_up, w_down):
        n = w_gate_up.shape[0]
        first = jax.lax.axis_index(axis) * n
        mine = (experts >= first) & (experts < first + n)
        part = routed_experts(x, jnp.where(mine, weights, 0.0),
                              jnp.where(mine, experts - first, 0), w_gate_up, w_down,
                              backend=backend, out_dtype=jnp.float32)
        return jax.lax.psum(part, axis)

    split, whole = P(axis), P()
    mapped = _compat.shard_map(local, mesh=mesh, in_specs=(whole, whole, whole, split, split),
                               out_specs=whole, manual_axes=(axis,))
    return mapped(x, weights, experts, w_gate_up, w_down).astype(x.dtype)


class MoE(nnx.Module):
    """The MoE MLP: `Router`, routed experts (w_gate_up [E, H, 2I], w_down [E, I, H] in the
    parameter dtype; `routed_experts`) and, when n_shared_experts > 0, `shared` (a
    `SwiGLU` of width moe_intermediate_size * n_shared_experts) added to every token.

    Expert parallelism (`split_experts`): with `expert_axis` set (static, part of the
    module's graph), the routed experts run split over that mesh axis (`expert_parallel`),
    on the mesh of the enclosing `shard_map` when the call is inside one that has the axis
    (the mesh engine's decode step), else on `expert_mesh`. Unset (None): one device's path.
    """

    def __init__(self, cfg: DSAConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        E, H, width = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        pd = as_dtype(cfg.param_dtype)
        self.router = Router(cfg, rngs=rngs)
        self.w_gate_up = nnx.Param(
            nnx.initializers.normal(H ** -0.5)(rngs.params(), (E, H, 2 * width), pd))
        self.w_down = nnx.Param(
            nnx.initializers.normal(width ** -0.5)(rngs.params(), (E, width, H), pd))
        self.shared = (SwiGLU(cfg, width * cfg.n_shared_experts, rngs=rngs)
                       if cfg.n_shared_experts else None)
        self.expert_mesh: Any = None
        self.expert_axis: str | None = None

    def split_experts(self, mesh: Any, axis: str) -> None:
        """Runs the routed experts split over `axis` of `mesh` (a `jax.sharding.Mesh`) from
        now on; the stacks' expert dim must be a multiple of the axis size."""
        size = mesh.shape[axis]
        if self.cfg.n_routed_experts % size:
            raise ValueError(f"MoE: the mesh axis {axis!r} ({size} devices) must divide "
                             f"n_routed_experts={self.cfg.n_routed_experts}")
        self.expert_mesh, self.expert_axis = mesh, axis

    def _mesh(self) -> Any:
        """The enclosing `shard_map`'s mesh when it has `expert_axis`, else `expert_mesh`."""
        context = jax.sharding.get_abstract_mesh()
        if not context.empty and self.expert_axis in context.axis_names:
            return context
        return self.expert_mesh

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [T, H] (compute dtype) -> [T, H]."""
        weights, experts = self.router(x)
        if self.expert_axis is None:
            out = routed_experts(x, weights, experts, self.w_gate_up[...], self.w_down[...])
        else:
            out = expert_parallel(x, weights, experts, self.w_gate_up[...], self.w_down[...],
                                  mesh=self._mesh(), axis=self.expert_axis)
        if self.shared is not None:
            out = out + self.shared(x)
        return out
