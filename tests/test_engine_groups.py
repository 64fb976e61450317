"""The engine serves a model whose index groups differ in size (`ModelSpec.group_layers`,
GLM-5's "full" indexer layer followed by "shared" layers): under pool pressure HiSparse
decodes exactly what all-resident decodes, and counts each miss once per layer of its group.

The model is a small test-only `ServedModel` (no indexer: its top-k comes from an external
source, `hisparse_jax.topk_sources`; the engine's synthetic prefill writes the prompt rows).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hisparse_jax.cache import PendingLookup
from hisparse_jax.engine import (
    AllResident,
    Debug,
    Engine,
    EngineConfig,
    HiSparse,
    NaiveOffload,
    PrefillPolicy,
    Sizes,
    Tuning,
)
from hisparse_jax.models.protocol import DecodeCache, ModelSpec
from hisparse_jax.topk_sources import DriftTopK
from host_tier import HostPool
from tests.engine_runs import run_prompts

VOCAB, HIDDEN, HEADS, W, TOP_K = 64, 32, 2, 16, 8
MAX_LEN, GEN = 64, 12
PROMPTS = [np.random.default_rng(i).integers(0, VOCAB, 30 + 4 * i).tolist() for i in range(4)]


class GroupedModel(nnx.Module):
    """Layers in index groups of `group_layers` layers: each layer writes its KV row, the
    first layer of a group looks the group's top-k up (`kv.layer_group`), every layer of the
    group attends over the rows found. With copy_with_attention group g + 1 is looked up
    ahead, before group g attends (the synthetic model's rule)."""

    def __init__(self, group_layers: tuple[int, ...], *, rngs: nnx.Rngs):
        self.group_layers = tuple(group_layers)
        num_layers = sum(group_layers)
        self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
        self.wq = nnx.List([nnx.Linear(HIDDEN, HEADS * W, rngs=rngs) for _ in range(num_layers)])
        self.wkv = nnx.List([nnx.Linear(HIDDEN, W, rngs=rngs) for _ in range(num_layers)])
        self.wo = nnx.List([nnx.Linear(HEADS * W, HIDDEN, rngs=rngs) for _ in range(num_layers)])

    @property
    def spec(self) -> ModelSpec:
        return ModelSpec(name=f"grouped{self.group_layers}", vocab_size=VOCAB,
                         num_layers=sum(self.group_layers), group_layers=self.group_layers,
                         top_k=TOP_K, kv_lora_rank=W, rope_dim=0, num_heads=HEADS,
                         sm_scale=W ** -0.5, kv_dtype="float32")

    def init_index_keys(self, max_seats, max_model_len, *, external_topk):
        return ()

    def prefill(self, *args, **kwargs):
        raise ValueError("GroupedModel has no prefill: serve it with synthetic prefill")

    prefill_chunk = prefill

    def decode(self, cache, batch, *, attention_backend=None, collect_attention=False):
        kvb = batch.kv
        if batch.topk is None:
            raise ValueError("GroupedModel has no indexer: serve it with a topk_source")
        kv, num_groups = cache.kv, len(self.group_layers)

        def topk(g):  # causal entries only, none for padding rows
            keep = (batch.topk[g] <= kvb.positions[:, None]) & kvb.live[:, None]
            return jnp.where(keep, batch.topk[g], -1)

        ahead = kv.copy_with_attention
        pending = lookup = None
        if ahead:
            kv, found = kv.lookup(0, topk(0), kvb)
            pending = PendingLookup(0, found)
        x = self.embed(batch.tokens)
        hits, misses, attn = [], [], []
        for layer in range(kv.num_layers):
            g, member = kv.layer_group(layer)
            h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
            q = self.wq[layer](h).reshape(-1, HEADS, W)
            if member == 0 and ahead:
                kv, lookup = kv.land(pending, kvb)
                pending = None
                if g + 1 < num_groups:
                    kv, pending = kv.lookup_ahead(g + 1, topk(g + 1), kvb)
            kv = kv.write(layer, self.wkv[layer](h), kvb)
            if member == 0 and not ahead:
                kv, lookup = kv.lookup(g, topk(g), kvb)
            if member == 0:
                hits.append(lookup.hits.sum())
                misses.append(lookup.misses.sum())
            kv, latent, _, pending = kv.attend(layer, q, lookup.attention_rows, kvb,
                                               sm_scale=W ** -0.5, v_width=W,
                                               backend=attention_backend, pending=pending)
            attn.append(latent)
            x = x + self.wo[layer](latent.reshape(latent.shape[0], -1))
        logits = (x @ self.embed.embedding[...].T).astype(jnp.float32)
        aux = {"hits": jnp.stack(hits), "misses": jnp.stack(misses)}  # per group: [G]
        if collect_attention:
            aux["attention"] = jnp.stack(attn)
        return logits, DecodeCache(kv, cache.index_keys), aux


@functools.cache
def _runs(groups: tuple[int, ...]):
    """All-resident, HiSparse under pressure (pool packed by default, and one copy run in
    model order) and naive offload: (summary, host arrays, tokens, attention, metrics)."""
    model = GroupedModel(groups, rngs=nnx.Rngs(0))
    out = {}
    for name, residency, gpu_blocks, beside in (
            ("all_resident", AllResident(), None, True),
            ("hisparse", HiSparse(), 40, True),
            ("in_order", HiSparse(), 40, False),
            ("naive", NaiveOffload(), 40, True)):
        engine, done = run_prompts(
            model, PROMPTS, max_new_tokens=GEN, residency=residency,
            topk_source=DriftTopK(turnover=0.25, seed=1),
            sizes=Sizes(max_seats=4, max_model_len=MAX_LEN, block_size=4,
                        num_gpu_blocks=gpu_blocks),
            prefill=PrefillPolicy(bucket=MAX_LEN, synthetic=True),
            debug=Debug(collect_attention=True, max_traces=1),
            tuning=Tuning(copy_with_attention=beside))
        arrays = None if engine.host_pool is None else engine.host_pool.layers_per_array
        out[name] = (engine.summary(), arrays, [r.generated for r in done],
                     [np.stack(r.attention) for r in done], engine.metrics)
        engine.close()
    return out


@pytest.mark.parametrize("groups", [(1, 2), (2, 4)], ids=["1-2", "2-4"])
def test_uneven_groups_under_pressure_decode_what_all_resident_decodes(groups):
    runs = _runs(groups)
    base = runs["all_resident"]
    assert base[0]["rows_moved_h2d"] == 0
    for name in ("hisparse", "in_order", "naive"):
        summary, layers_per_array, tokens, attention, metrics = runs[name]
        assert tokens == base[2], name
        for got, want in zip(attention, base[3], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)
        # Packing: an array holds one group's layers, the groups' common divisor of them.
        assert layers_per_array == (2 if groups == (2, 4) else 1), name
        assert summary["lost_pages"] > 0 and metrics.hot_misses > 0, (name, summary)
        # Each miss of group g is copied into its n_g layers: between min and max n_g.
        rows, misses = summary["rows_moved_h2d"], metrics.hot_misses
        assert min(groups) * misses < rows < max(groups) * misses, (name, rows, misses)
        assert summary["bytes_moved_h2d"] == rows * W * 4
    assert runs["hisparse"][4].hot_hits > 0 and runs["naive"][4].hot_hits == 0


def test_a_packed_host_pool_must_hold_whole_groups_of_unequal_size():
    model = GroupedModel((2, 4), rngs=nnx.Rngs(0))
    config = EngineConfig(topk_source=DriftTopK(), sizes=Sizes(
        max_seats=2, max_model_len=MAX_LEN, block_size=4), prefill=PrefillPolicy(synthetic=True))
    with HostPool(num_layers=6, block_size=4, row_width=W, dtype=np.float32, num_blocks=8,
                  layers_per_array=3) as pool:
        with pytest.raises(ValueError, match=r"host_pool keeps 3 layers per array; the rule "
                                             r"is a number dividing every index group's size "
                                             r"\(2, 4\)"):
            Engine(model, config, host_pool=pool)
