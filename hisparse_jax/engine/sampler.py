"""Sampling of the next token, inside the jitted steps, and the keys it draws with.

Keys per request: the key of a request's i-th sampled token is
`fold_in(fold_in(base_key(seed), sampling_seed), i)` (`token_keys`), a function of the
engine's seed, the request's sampling seed (by default its add_request order index) and i
only. The same request therefore samples the same tokens whatever the batch it runs in, its
seat, the mode (all-resident, HiSparse, naive offload) and its preemptions (the prefill that
recomputes token i after a preemption draws with token i's key again). Greedy rows
(temperature <= 0) take the argmax and use no key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_SAMPLING_STREAM = 0x5A3D1E  # folded into the seed: sampling keys share no key with the
                             # synthetic prefill rows, which fold the request index into it


def base_key(seed: int) -> jax.Array:
    """The engine's sampling key of `seed` (raw uint32[2]), before any request is folded in."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), _SAMPLING_STREAM)


def token_keys(key: jax.Array, sampling_seed: jax.Array, token_index: jax.Array) -> jax.Array:
    """Per-row keys uint32[N, 2] of `base_key` output `key`: row n draws its request's
    (sampling_seed[n]) token_index[n]-th token. sampling_seed, token_index: int32[N] (ids past
    2**31 wrap: they are folded in as uint32)."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.fold_in(key, s), i))(
        sampling_seed, token_index)


def sample(logits: jax.Array, temperature: jax.Array, key: jax.Array) -> jax.Array:
    """Next tokens int32[N] of logits float32[N, V]: greedy (argmax) where temperature[n] <= 0,
    else a draw from softmax(logits[n] / temperature[n]).

    key: one raw key uint32[2] for the whole batch, or one per row uint32[N, 2]
    (`token_keys`: row n's draw then depends on its own key only)."""
    greedy = jnp.argmax(logits, -1).astype(jnp.int32)
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    if key.ndim == 2:
        drawn = jax.vmap(lambda k, x: jax.random.categorical(k, x))(key, logits / t)
    else:
        drawn = jax.random.categorical(key, logits / t, axis=-1)
    return jnp.where(temperature > 0, drawn.astype(jnp.int32), greedy)
