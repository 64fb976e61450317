"""Your own model served by the HiSparse engine (runs on a CPU).

`TinyLM` is a small Flax NNX decoder of its own design, not the project's synthetic model:
each layer is its own index group with a one-head dot-product indexer, and it attends with
plain multi-head attention over rows of [key; value] (no MLA, no RoPE). It knows nothing
of pages, host pools or hot regions. It implements `hisparse_jax.models.ServedModel`:

  * `spec`: the static facts the engine sizes itself by (`ModelSpec`);
  * `init_index_keys`: its own per-seat arrays, one index-key cache per layer;
  * `prefill` / `prefill_chunk` / `decode`: each layer writes its row through the KV-cache
    handle (`kv.write_rows` / `kv.write`), picks its top-k with its indexer, asks the handle
    for the device rows of those positions (`kv.lookup`) and attends over them.

`main` serves the same greedy requests twice, all-resident and HiSparse with a device pool
too small for them (rows spill to the pinned host pool and come back through the hot
regions), and checks that the tokens are identical.

    python3 examples/custom_attention.py
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.cache import AllResident, CacheBatch
from hisparse_jax.engine import Engine, EngineConfig, HiSparse, PrefillPolicy, Sizes
from hisparse_jax.models import DecodeBatch, DecodeCache, ModelSpec

VOCAB, DIM, LAYERS, HEADS, KEY, VALUE, INDEX, TOP_K = 128, 32, 2, 2, 16, 16, 8, 8
W = KEY + VALUE  # one KV row: the token's key, then its value (shared by the heads)


class Layer(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.q = nnx.Linear(DIM, HEADS * KEY, use_bias=False, rngs=rngs)
        self.kv = nnx.Linear(DIM, W, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(HEADS * VALUE, DIM, use_bias=False, rngs=rngs)
        self.index_q = nnx.Linear(DIM, INDEX, use_bias=False, rngs=rngs)
        self.index_k = nnx.Linear(DIM, INDEX, use_bias=False, rngs=rngs)
        self.mlp_norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)

    def select(self, h, keys, positions):
        """Top-k positions int32[T, K] of query rows h [T, DIM] over index keys [T, L, INDEX]
        or [L, INDEX]: causal (s <= position), -1 where fewer than K exist."""
        q = self.index_q(h)
        scores = (jnp.einsum("ti,tsi->ts", q, keys) if keys.ndim == 3
                  else jnp.einsum("ti,si->ts", q, keys))
        length = scores.shape[-1]
        scores = jnp.where(jnp.arange(length)[None] <= positions[:, None], scores, -jnp.inf)
        if length < TOP_K:
            scores = jnp.pad(scores, ((0, 0), (0, TOP_K - length)), constant_values=-jnp.inf)
        best, idx = jax.lax.top_k(scores, TOP_K)
        return jnp.where(jnp.isfinite(best), idx, -1).astype(jnp.int32)

    def attend(self, h, rows, valid):
        """Attention of h [T, DIM] over rows [T, K, W] (valid bool[T, K])."""
        q = self.q(h).reshape(-1, HEADS, KEY)
        s = jnp.einsum("thd,tkd->thk", q, rows[..., :KEY]) / math.sqrt(KEY)
        p = jax.nn.softmax(jnp.where(valid[:, None], s, -jnp.inf), -1)
        p = jnp.where(valid.any(-1)[:, None, None], p, 0.0)  # a row with nothing to read
        return self.o(jnp.einsum("thk,tkv->thv", p, rows[..., KEY:]).reshape(h.shape[0], -1))

    def finish(self, x, attended):
        x = x + attended
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class TinyLM(nnx.Module):
    """A user's decoder implementing `hisparse_jax.models.ServedModel`."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.layers = nnx.List([Layer(rngs=rngs) for _ in range(LAYERS)])
        self.norm = nnx.RMSNorm(DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, VOCAB, use_bias=False, rngs=rngs)

    spec = ModelSpec(name="tiny-user", vocab_size=VOCAB, num_layers=LAYERS,
                     group_layers=(1,) * LAYERS, top_k=TOP_K, kv_lora_rank=W, rope_dim=0,
                     num_heads=HEADS, sm_scale=1 / math.sqrt(KEY), kv_dtype="float32")

    def init_index_keys(self, max_seats, max_model_len, *, external_topk):
        shape = (1, 1, INDEX) if external_topk else (max_seats, max_model_len, INDEX)
        return tuple(jnp.zeros(shape, jnp.float32) for _ in range(LAYERS))

    def decode(self, cache, batch: DecodeBatch, *, attention_backend=None,
               collect_attention=False):
        kvb = batch.kv
        live, pos = kvb.live, kvb.positions
        seat = jnp.where(live, kvb.state_rows, 0)
        kv, index_keys, hits, misses = cache.kv, list(cache.index_keys), [], []
        x = self.embed(batch.tokens)
        for g, layer in enumerate(self.layers):
            h = layer.norm(x)
            kv = kv.write(g, layer.kv(h), kvb)  # this token's row, in its resident page
            if batch.topk is not None:  # an external top-k source
                topk = jnp.where((batch.topk[g] <= pos[:, None]) & live[:, None],
                                 batch.topk[g], -1)
            else:
                keys = index_keys[g]  # out-of-range indices (padding rows) are dropped
                keys = keys.at[jnp.where(live, kvb.state_rows, keys.shape[0]), pos].set(
                    layer.index_k(h), mode="drop")
                index_keys[g] = keys
                topk = jnp.where(live[:, None], layer.select(h, keys[seat], pos), -1)
            kv, found = kv.lookup(g, topk, kvb)  # device rows (misses copied from host)
            rows = kv.caches[g].reshape(-1, W)[jnp.maximum(found.attention_rows, 0)]
            x = layer.finish(x, layer.attend(h, rows, found.attention_rows >= 0))
            hits.append(found.hits.sum())
            misses.append(found.misses.sum())
        aux = {"hits": jnp.stack(hits), "misses": jnp.stack(misses), "hidden": x}
        return self.logits(x), DecodeCache(kv, tuple(index_keys)), aux

    def prefill(self, cache, tokens, length, state_row, write_rows, *,
                attention_backend=None, collect_attention=False):
        pos = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        kv, index_keys = cache.kv, list(cache.index_keys)
        real = pos < length
        x = self.embed(tokens)
        for g, layer in enumerate(self.layers):
            h = layer.norm(x)
            row = layer.kv(h)
            kv = kv.write_rows(g, write_rows, row)
            keys = layer.index_k(h)
            at = jnp.where(real, pos, index_keys[g].shape[1])  # padding: dropped
            index_keys[g] = index_keys[g].at[state_row, at].set(keys, mode="drop")
            topk = layer.select(h, keys, pos)  # positions of this prompt = its own rows
            stored = kv.encode(row)            # the values a later lookup reads
            x = layer.finish(x, layer.attend(h, stored[jnp.maximum(topk, 0)], topk >= 0))
        last = jax.lax.dynamic_index_in_dim(x, length - 1, keepdims=False)
        return self.logits(last[None])[0], DecodeCache(kv, tuple(index_keys)), {}

    def prefill_chunk(self, cache, tokens, start, length, state_row, pages, *,
                      host_pages=None, host_pools=(), attention_backend=None,
                      collect_attention=False):
        if host_pages is not None:
            raise ValueError("TinyLM.prefill_chunk cannot stage host-only pages (use "
                             "EngineConfig.prefill.prefix_hit_pages='restore')")
        T = tokens.shape[0]
        pos = start + jnp.arange(T, dtype=jnp.int32)
        real = jnp.arange(T) < length
        res = jnp.broadcast_to(pages, (T, pages.shape[0]))
        batch = CacheBatch(jnp.where(real, state_row, -1), pos, jnp.zeros_like(res), res,
                           jnp.zeros((T, 0), jnp.int32))
        kv, index_keys = cache.kv, list(cache.index_keys)
        x = self.embed(tokens)
        for g, layer in enumerate(self.layers):
            h = layer.norm(x)
            kv = kv.write(g, layer.kv(h), batch)
            keys = index_keys[g]
            keys = keys.at[state_row, jnp.where(real, pos, keys.shape[1])].set(
                layer.index_k(h), mode="drop")
            index_keys[g] = keys
            topk = jnp.where(real[:, None], layer.select(h, keys[state_row], pos), -1)
            kv, found = AllResident().lookup(kv, g, topk, batch)  # through its pages
            rows = kv.caches[g].reshape(-1, W)[jnp.maximum(found.attention_rows, 0)]
            x = layer.finish(x, layer.attend(h, rows, found.attention_rows >= 0))
        last = jax.lax.dynamic_index_in_dim(x, length - 1, keepdims=False)
        return self.logits(last[None])[0], DecodeCache(kv, tuple(index_keys)), {}

    def logits(self, x):
        return self.head(self.norm(x)).astype(jnp.float32)


PROMPTS = [np.random.default_rng(i).integers(0, VOCAB, 20 + 4 * i).tolist() for i in range(5)]
SIZES = dict(max_seats=3, max_model_len=64, block_size=4)


def serve(model, residency=None, **sizes):
    """The greedy tokens of every request (in add order) and the engine's summary;
    `residency`: None for `HiSparse()`; `sizes`: the `Sizes` fields beside SIZES."""
    engine = Engine(model, EngineConfig(sizes=Sizes(**SIZES, **sizes),
                                        residency=residency or HiSparse(),
                                        prefill=PrefillPolicy(bucket=16)))
    try:
        ids = [engine.add_request(p, max_new_tokens=20) for p in PROMPTS]
        done = engine.run()
        return [done[i].generated for i in ids], engine.summary()
    finally:
        engine.close()


def main() -> None:
    model = TinyLM(rngs=nnx.Rngs(0))
    resident, _ = serve(model, residency=AllResident())
    tokens, summary = serve(model, num_gpu_blocks=32)  # too small for the requests' pages
    print(f"HiSparse under pressure: {summary['spilled_pages']} pages spilled, "
          f"{summary['rows_moved_h2d']} rows read back from host; tokens identical to "
          f"all-resident: {tokens == resident}")
    assert summary["spilled_pages"] > 0 and summary["rows_moved_h2d"] > 0, summary
    assert tokens == resident


if __name__ == "__main__":
    main()
