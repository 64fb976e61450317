"""`hisparse_jax.models.protocol`: the spec's rules, the protocol check the engines run, and
the synthetic model's spec."""

from __future__ import annotations

import pytest
from flax import nnx

from hisparse_jax import models
from hisparse_jax.engine import AllResident, Engine, EngineConfig
from hisparse_jax.models import ModelSpec, check_served_model

FIELDS = dict(name="m", vocab_size=16, top_k=4, kv_lora_rank=8, rope_dim=0, num_heads=1,
              sm_scale=1.0)


def test_spec_describes_equal_and_uneven_groups():
    even = ModelSpec.equal_groups(num_layers=4, index_group_size=2, **FIELDS)
    assert even.group_layers == (2, 2) and even.num_groups == 2 and even.index_group_size == 2
    assert even.row_width == 8
    uneven = ModelSpec(num_layers=5, group_layers=(2, 2, 1), **FIELDS)
    assert uneven.num_groups == 3
    with pytest.raises(ValueError, match="not groups of equal size"):
        uneven.index_group_size  # noqa: B018 - the engine's handle serves equal groups only
    with pytest.raises(ValueError, match="must add up to num_layers=4"):
        ModelSpec(num_layers=4, group_layers=(2, 1), **FIELDS)
    with pytest.raises(ValueError, match="ModelSpec.top_k must be a positive int"):
        ModelSpec(num_layers=1, group_layers=(1,), **{**FIELDS, "top_k": 0})
    with pytest.raises(ValueError, match="multiple of index_group_size=2"):
        ModelSpec.equal_groups(num_layers=3, index_group_size=2, **FIELDS)


def test_synthetic_spec_is_read_from_its_config():
    cfg = models.get_config("tiny", index_group_size=2, mtp_layers=1)
    spec = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0))).spec
    assert spec == models.model_spec(cfg)
    assert (spec.num_layers, spec.group_layers, spec.top_k, spec.vocab_size) == (
        cfg.num_layers, (2,), cfg.top_k, cfg.vocab_size)
    assert spec.row_width == cfg.row_width and spec.has_draft


class _NoDecode(nnx.Module):
    spec = ModelSpec(num_layers=1, group_layers=(1,), **FIELDS)

    def init_index_keys(self, *a, **k):
        return ()

    def prefill(self, *a, **k):
        raise NotImplementedError

    prefill_chunk = prefill


def test_the_engines_refuse_what_is_not_a_served_model():
    with pytest.raises(ValueError, match="must be a Flax NNX module implementing"):
        check_served_model("Engine", object())
    with pytest.raises(ValueError, match="must have a `spec`"):
        check_served_model("Engine", nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="does not implement .*: no decode"):
        Engine(_NoDecode(), EngineConfig(residency=AllResident()))


def test_the_engine_imports_no_model():
    """The engine package reaches models only through the protocol module."""
    import ast
    import pathlib

    import hisparse_jax.engine as engine_pkg

    for path in pathlib.Path(engine_pkg.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not (name.startswith("hisparse_jax.models")
                            and name != "hisparse_jax.models.protocol"), (path.name, name)
