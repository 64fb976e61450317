"""Hugging Face checkpoint tensors of a DSA model (DeepSeek-V3.2, GLM-5) and the parameters
they fill (`hisparse_jax.models.dsa_layers`).

* `tensor_map(cfg)`: HF name -> (HF shape, the `Slot`s it fills). A slot is a parameter path
  from the model (attribute names and list indices) and how the tensor lands there: torch
  Linear weights [out, in] transposed into [in, out] kernels; `kv_b_proj` [h * (nope + v),
  kv_lora] split per head into w_uk [h, nope, kv_lora] and w_uv [h, kv_lora, v]; per-expert
  weights written into expert e of the stacked w_gate_up [E, H, 2I] (gate in [:I], up in
  [I:]) and w_down [E, I, H].
* `expected_tensors(cfg)`: HF name -> HF shape of every tensor a checkpoint must hold (the
  MTP layer `model.layers.{num_hidden_layers}` included when num_nextn_predict_layers = 1);
  `optional_tensors(cfg)`: names a checkpoint may hold that no parameter takes (the MTP
  layer's indexer: its attention attends to one row, `dsa_layers.DSAMTP`).
* `check_names(cfg, names)`, `load_into(model, read, names=...)`: a missing tensor, a
  mis-shaped one and an unknown name are ValueErrors naming them.

The model's attributes (`MODEL_PATHS`): `embed` (nnx.Embed), `blocks` (a list of
`DSABlock`), `final_norm` (RMSNorm), `lm_head` (nnx.Linear) and, with an MTP layer, `mtp`
(`DSAMTP`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.models.dsa_config import DSAConfig

MODEL_PATHS = {"embed": ("embed", "embedding"), "final_norm": ("final_norm", "scale"),
               "lm_head": ("lm_head", "kernel"), "blocks": ("blocks",), "mtp": ("mtp",)}

Path = tuple[str | int, ...]


@dataclasses.dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lands: the parameter at `path`, after `transform`
    ("copy", "transpose", "w_uk", "w_uv"); with `expert` set, the transformed tensor fills
    [expert, :, offset : offset + width] of a stacked [E, ., .] parameter."""

    path: Path
    transform: str = "transpose"
    expert: int | None = None
    offset: int = 0


def _linear(prefix: str, path: Path, d_out: int, d_in: int) -> dict:
    return {f"{prefix}.weight": ((d_out, d_in), (Slot((*path, "kernel")),))}


def _norm(name: str, path: Path, dim: int, attr: str = "scale") -> dict:
    return {name: ((dim,), (Slot((*path, attr), "copy"),))}


def _attention_tensors(cfg: DSAConfig, p: str, path: Path) -> dict:
    """The attention's tensors of layer prefix p ("model.layers.3.") at block path `path`."""
    h, H = cfg.num_attention_heads, cfg.hidden_size
    a = (*path, "attn")
    out = {}
    out.update(_linear(f"{p}self_attn.q_a_proj", (*a, "wq_a"), cfg.q_lora_rank, H))
    out.update(_norm(f"{p}self_attn.q_a_layernorm.weight", (*a, "q_norm"), cfg.q_lora_rank))
    out.update(_linear(f"{p}self_attn.q_b_proj", (*a, "wq_b"), h * cfg.qk_head_dim,
                       cfg.q_lora_rank))
    out.update(_linear(f"{p}self_attn.kv_a_proj_with_mqa", (*a, "wkv_a"), cfg.row_width, H))
    out.update(_norm(f"{p}self_attn.kv_a_layernorm.weight", (*a, "kv_norm"), cfg.kv_lora_rank))
    out[f"{p}self_attn.kv_b_proj.weight"] = (
        (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        (Slot((*a, "w_uk"), "w_uk"), Slot((*a, "w_uv"), "w_uv")))
    out.update(_linear(f"{p}self_attn.o_proj", (*a, "wo"), H, h * cfg.v_head_dim))
    return out


def _indexer_tensors(cfg: DSAConfig, p: str, path: Path) -> dict:
    d, n, H = cfg.index_head_dim, cfg.index_n_heads, cfg.hidden_size
    i, q = (*path, "indexer"), f"{p}self_attn.indexer"
    out = {}
    out.update(_linear(f"{q}.wq_b", (*i, "wq"), n * d, cfg.q_lora_rank))
    out.update(_linear(f"{q}.wk", (*i, "wk"), d, H))
    out.update(_norm(f"{q}.k_norm.weight", (*i, "k_norm"), d))
    out.update(_norm(f"{q}.k_norm.bias", (*i, "k_norm"), d, attr="bias"))
    out.update(_linear(f"{q}.weights_proj", (*i, "w_heads"), n, H))
    return out


def _mlp_tensors(cfg: DSAConfig, layer: int, p: str, path: Path) -> dict:
    H, m = cfg.hidden_size, (*path, "mlp")
    out = {}
    if cfg.layer_mlp_type(layer) == "dense":
        width = cfg.intermediate_size
        for name, attr, shape in (("gate_proj", "gate", (width, H)), ("up_proj", "up", (width, H)),
                                  ("down_proj", "down", (H, width))):
            out.update(_linear(f"{p}mlp.{name}", (*m, attr), *shape))
        return out
    E, width = cfg.n_routed_experts, cfg.moe_intermediate_size
    out.update(_linear(f"{p}mlp.gate", (*m, "router"), E, H))
    out.update(_norm(f"{p}mlp.gate.e_score_correction_bias", (*m, "router"), E, attr="bias"))
    for e in range(E):
        x = f"{p}mlp.experts.{e}."
        out[f"{x}gate_proj.weight"] = ((width, H), (Slot((*m, "w_gate_up"), expert=e),))
        out[f"{x}up_proj.weight"] = ((width, H), (Slot((*m, "w_gate_up"), expert=e,
                                                       offset=width),))
        out[f"{x}down_proj.weight"] = ((H, width), (Slot((*m, "w_down"), expert=e),))
    if cfg.n_shared_experts:
        shared = width * cfg.n_shared_experts
        for name, attr, shape in (("gate_proj", "gate", (shared, H)),
                                  ("up_proj", "up", (shared, H)),
                                  ("down_proj", "down", (H, shared))):
            out.update(_linear(f"{p}mlp.shared_experts.{name}", (*m, "shared", attr), *shape))
    return out


def _block_tensors(cfg: DSAConfig, layer: int, path: Path) -> dict:
    p, H = f"model.layers.{layer}.", cfg.hidden_size
    out = {}
    out.update(_norm(f"{p}input_layernorm.weight", (*path, "attn_norm"), H))
    out.update(_attention_tensors(cfg, p, path))
    if cfg.layer_has_indexer(layer):
        out.update(_indexer_tensors(cfg, p, path))
    out.update(_norm(f"{p}post_attention_layernorm.weight", (*path, "mlp_norm"), H))
    out.update(_mlp_tensors(cfg, layer, p, path))
    return out


def _mtp_tensors(cfg: DSAConfig) -> dict:
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    p, m = f"model.layers.{L}.", MODEL_PATHS["mtp"]
    out = {f"{p}embed_tokens.weight": ((V, H), (Slot((*m, "embed", "embedding"), "copy"),))}
    out.update(_norm(f"{p}enorm.weight", (*m, "enorm"), H))
    out.update(_norm(f"{p}hnorm.weight", (*m, "hnorm"), H))
    out.update(_linear(f"{p}eh_proj", (*m, "eh_proj"), H, 2 * H))
    out.update(_block_tensors(cfg, L, (*m, "block")))
    out.update(_norm(f"{p}shared_head.norm.weight", (*m, "norm"), H))
    out.update(_linear(f"{p}shared_head.head", (*m, "head"), V, H))
    return out


def tensor_map(cfg: DSAConfig) -> dict[str, tuple[tuple[int, ...], tuple[Slot, ...]]]:
    """HF name -> (HF shape, slots), in checkpoint-layer order (module docstring)."""
    H, V = cfg.hidden_size, cfg.vocab_size
    out = {"model.embed_tokens.weight": ((V, H), (Slot(MODEL_PATHS["embed"], "copy"),))}
    for layer in range(cfg.num_hidden_layers):
        out.update(_block_tensors(cfg, layer, (*MODEL_PATHS["blocks"], layer)))
    out["model.norm.weight"] = ((H,), (Slot(MODEL_PATHS["final_norm"], "copy"),))
    out["lm_head.weight"] = ((V, H), (Slot(MODEL_PATHS["lm_head"]),))
    if cfg.num_nextn_predict_layers:
        out.update(_mtp_tensors(cfg))
    return out


def expected_tensors(cfg: DSAConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape of every tensor the model reads (per-expert names; the MTP layer
    when cfg.num_nextn_predict_layers)."""
    return {name: shape for name, (shape, _) in tensor_map(cfg).items()}


def optional_tensors(cfg: DSAConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> HF shape of tensors a checkpoint may hold that no parameter reads: the MTP
    layer's indexer (its one-row attention selects nothing)."""
    if not cfg.num_nextn_predict_layers:
        return {}
    p = f"model.layers.{cfg.num_hidden_layers}."
    return {name: shape for name, (shape, _) in _indexer_tensors(cfg, p, ()).items()}


def check_names(cfg: DSAConfig, names: Iterable[str]) -> None:
    """ValueError naming the expected tensors `names` lacks and the names it holds that are
    neither expected nor optional (at most 10 of each are listed)."""
    names = set(names)
    expected = expected_tensors(cfg)
    missing = [n for n in expected if n not in names]
    unexpected = sorted(names - expected.keys() - optional_tensors(cfg).keys())
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing tensor(s): {', '.join(missing[:10])}")
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected tensor(s): "
                        f"{', '.join(unexpected[:10])}")
    if problems:
        raise ValueError(f"checkpoint does not match the {cfg.name} config: "
                         + "; ".join(problems))


def load_into(model: Any, read: Callable[[str, np.dtype], np.ndarray], *,
              cfg: DSAConfig | None = None, names: Iterable[str] | None = None) -> None:
    """Fills the parameters of `model` (an nnx module with `MODEL_PATHS`' attributes; its
    parameters concrete arrays or abstract `jax.ShapeDtypeStruct`s, e.g. from
    `nnx.eval_shape`, which are allocated here) from a checkpoint, tensor by tensor.

    read(name, dtype) returns the HF tensor `name` as a numpy array of `dtype` (the dtype of
    the parameter it fills: float32 for the router and the indexer's head weights, the
    model's dtype elsewhere), e.g. `lambda n, dt: ckpt.read(n, dt)`. With `names` (the
    checkpoint's tensor names) the names are checked first (`check_names`). A tensor of
    another shape than `expected_tensors` is a ValueError naming it and both shapes. Expert
    tensors are written into their stacked parameter in place (a donated update), so no
    second copy of a stack is made. cfg defaults to model.cfg.
    """
    cfg = model.cfg if cfg is None else cfg
    if names is not None:
        check_names(cfg, names)
    for name, (shape, slots) in tensor_map(cfg).items():
        variables = [_resolve(model, s.path) for s in slots]
        dtype = np.dtype(variables[0].get_value().dtype)
        array = np.asarray(read(name, dtype))
        if tuple(array.shape) != shape:
            raise ValueError(f"checkpoint tensor {name}: expected shape {shape}, found "
                             f"{tuple(array.shape)}")
        for slot, var in zip(slots, variables, strict=True):
            _assign(var, to_parameter_layout(array, slot, cfg), slot, name)


def _resolve(model: Any, path: Path) -> nnx.Variable:
    obj = model
    for key in path:
        obj = obj[key] if isinstance(key, int) else getattr(obj, key)
    if not isinstance(obj, nnx.Variable):
        raise ValueError(f"model path {'.'.join(map(str, path))} is not a parameter "
                         f"({type(obj).__name__})")
    return obj


def to_parameter_layout(a: np.ndarray, slot: Slot, cfg: DSAConfig) -> np.ndarray:
    """Checkpoint tensor `a` (transformers' layout: a Linear weight [out, in]) in the layout of
    its parameter `slot`: "copy" as is, "transpose" [in, out], "w_uk" / "w_uv" the key and
    value halves of kv_b_proj [h * (nope + v), kv_lora] as [h, nope, kv_lora] and
    [h, kv_lora, v] (the absorbed attention's up-projections). `load_into` and the mesh
    loader (`placement.py`) both call it."""
    if slot.transform == "copy":
        return a
    if slot.transform == "transpose":
        return a.T
    h, nope = cfg.num_attention_heads, cfg.qk_nope_head_dim
    per_head = a.reshape(h, nope + cfg.v_head_dim, cfg.kv_lora_rank)
    if slot.transform == "w_uk":
        return per_head[:, :nope, :]
    return per_head[:, nope:, :].transpose(0, 2, 1)  # w_uv [h, kv_lora, v]


@functools.partial(jax.jit, donate_argnums=0)
def _write_expert(stack: jax.Array, value: jax.Array, expert: jax.Array, offset: jax.Array
                  ) -> jax.Array:
    """stack [E, a, b] with value [a, w] written at [expert, :, offset : offset + w]
    (stack donated: updated in place)."""
    return jax.lax.dynamic_update_slice(stack, value[None].astype(stack.dtype),
                                        (expert, jnp.zeros_like(expert), offset))


def _assign(var: nnx.Variable, value: np.ndarray, slot: Slot, name: str) -> None:
    """Writes `value` into `var` (whole, or expert slot.expert's slice), allocating an
    abstract parameter first; placed with the parameter's sharding when it has one."""
    current = var.get_value()
    sharding = getattr(current, "sharding", None)
    target = (tuple(value.shape) if slot.expert is None
              else (current.shape[0], *value.shape[:-1], current.shape[-1]))
    if tuple(current.shape) != target or (
            slot.expert is not None and slot.offset + value.shape[-1] > current.shape[-1]):
        raise ValueError(f"checkpoint tensor {name} does not fit parameter "
                         f"{'.'.join(map(str, slot.path))} of shape {tuple(current.shape)}")
    if slot.expert is None:
        new = np.ascontiguousarray(value, dtype=current.dtype)
        var.set_value(jax.device_put(new, sharding) if sharding is not None
                      else jnp.asarray(new))
        return
    if isinstance(current, jax.ShapeDtypeStruct):
        current = (jnp.zeros(current.shape, current.dtype, device=sharding)
                   if sharding is not None else jnp.zeros(current.shape, current.dtype))
    piece = jnp.asarray(np.ascontiguousarray(value, dtype=current.dtype))
    var.set_value(_write_expert(current, piece, jnp.int32(slot.expert),
                                        jnp.int32(slot.offset)))
