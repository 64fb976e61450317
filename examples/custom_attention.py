"""Your own attention layer served through the HiSparse KV-cache handle (runs on a CPU).

`MyAttention`, a plain Flax NNX attention with one shared key/value row per token, knows
nothing of pages, host pools or hot regions: it writes its row (`cache.write`), asks for the
rows of the positions it attends to (`cache.lookup`) and attends over them. The handle's
residency type decides where rows live. Two requests decode two tokens over a 40-token
context held (a) on the device (`AllResident`) and (b) in a pinned host pool with only the
tail page resident (`HiSparse`: selected rows come through the hot region). Outputs agree.

    python3 examples/custom_attention.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hisparse_jax.cache import AllResident, CacheBatch, HiSparse, HiSparseKVCache
from hisparse_jax.config import HiSparseConfig
from host_tier import memory_sharding

N, CTX, B, W, DIM, HEADS = 2, 40, 4, 64, 32, 2
CFG = HiSparseConfig(top_k=16, hot_size=32, block_size=B, max_num_reqs=N, row_width=W,
                     kv_dtype="float32", max_model_len=64, num_gpu_blocks=64, num_host_blocks=40)


class MyAttention(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.q = nnx.Linear(DIM, HEADS * W, rngs=rngs)
        self.kv = nnx.Linear(DIM, W, rngs=rngs)
        self.o = nnx.Linear(HEADS * W, DIM, rngs=rngs)

    def __call__(self, x, cache: HiSparseKVCache, batch: CacheBatch, topk):
        cache = cache.write(0, self.kv(x), batch)            # this token's row, layer 0
        cache, found = cache.lookup(0, topk, batch)           # device rows of the top-k
        rows = found.attention_rows                           # int32[N, K], -1 masked
        kv = cache.caches[0].reshape(-1, W)[jnp.maximum(rows, 0)]             # [N, K, W]
        s = jnp.einsum("nhw,nkw->nhk", self.q(x).reshape(N, HEADS, W), kv) / np.sqrt(W)
        p = jax.nn.softmax(jnp.where(rows[:, None] >= 0, s, -jnp.inf), -1)
        return self.o(jnp.einsum("nhk,nkw->nhw", p, kv).reshape(N, -1)), cache, found


@nnx.jit(donate_argnums=1)  # the cache is donated; the batch (host pools) is not
def step(layer, cache, batch, x, topk):
    return layer(x, cache, batch, topk)


def run(residency, layer, context, xs, topks):
    P, Hb, r = CFG.max_pages, CFG.hot_blocks, np.arange(N)[:, None]
    pages = (1 + r * P + np.arange(P)).astype(np.int32)      # blocks 1 .. N * P
    context_rows = (pages[:, :, None] * B + np.arange(B)).reshape(N, -1)[:, :CTX]
    pool = np.zeros((CFG.num_host_blocks, B, W), np.float32)
    cache = HiSparseKVCache.create(CFG, num_layers=1, residency=residency)
    src, res, hot = 0 * pages, pages, np.zeros((N, Hb), np.int32)
    if isinstance(residency, HiSparse):  # the context on host, only the tail page resident
        src, res = pages, 0 * pages
        pool.reshape(-1, W)[context_rows] = context
        res[:, CTX // B] = 1 + N * P + r[:, 0]
        hot = 1 + N * P + N + r * Hb + np.arange(Hb)
    else:
        cache = cache.write_rows(0, jnp.asarray(context_rows.ravel()), context.reshape(-1, W))
    pools = (jax.device_put(pool, memory_sharding(jax.devices()[0], "pinned_host")),)
    outs, counts = [], []
    for t, (x, topk) in enumerate(zip(xs, topks, strict=True)):
        batch = CacheBatch(jnp.arange(N, dtype=jnp.int32), jnp.full(N, CTX + t, jnp.int32),
                           jnp.asarray(src), jnp.asarray(res), jnp.asarray(hot), pools)
        out, cache, found = step(layer, cache, batch, x, topk)
        outs.append(np.asarray(out))
        counts.append((int(found.hits.sum()), int(found.misses.sum())))
    return np.stack(outs), counts


def main() -> None:
    rng = np.random.default_rng(0)
    layer = MyAttention(rngs=nnx.Rngs(0))
    context = rng.standard_normal((N, CTX, W)).astype(np.float32)
    xs = [jnp.asarray(rng.standard_normal((N, DIM)), jnp.float32) for _ in range(2)]
    picks = [rng.choice(CTX, 14, replace=False) for _ in range(N)]  # 13 old + this token:
    topks = [jnp.asarray([np.r_[p[t:t + 13], CTX + t, -1, -1] for p in picks], jnp.int32)
             for t in range(2)]
    base, _ = run(AllResident(), layer, context, xs, topks)
    got, counts = run(HiSparse(), layer, context, xs, topks)
    print(f"HiSparse (hits, misses) per step: {counts}; max |AllResident - HiSparse| = "
          f"{np.abs(base - got).max()}")
    assert counts[0][1] > 0 and counts[1][0] > 0, counts     # read from host, then reused
    np.testing.assert_allclose(got, base, rtol=1e-6, atol=1e-6)


if __name__ == "__main__":
    main()
