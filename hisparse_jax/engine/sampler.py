"""Sampling of the next token, inside the jitted steps, and the keys it draws with."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def sample(logits: jax.Array, temperature: jax.Array, key: jax.Array) -> jax.Array:
    """Next tokens int32[N] of logits float32[N, V]: greedy (argmax) where temperature[n] <= 0,
    else a draw from softmax(logits[n] / temperature[n])."""
    greedy = jnp.argmax(logits, -1).astype(jnp.int32)
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    drawn = jax.random.categorical(key, logits / t, axis=-1).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)


class KeyStream:
    """One base key (committed to the device once) and a call counter: each jitted call gets
    (key, counter) and folds the counter into the key itself, so no key is built on the host
    per step and the key argument never changes placement."""

    def __init__(self, seed: int, device: jax.Device) -> None:
        self.key = jax.device_put(jax.random.PRNGKey(seed), device)
        self.counter = 0

    def next(self) -> tuple[jax.Array, np.int32]:
        self.counter += 1
        return self.key, np.int32(self.counter)
