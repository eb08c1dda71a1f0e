"""Pure-JAX reference of the decode-step matmuls: the decoder layer's own ops (the truth the kernels are
tested against, and what runs where no kernel does)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_add(h: jax.Array, w: jax.Array, residual: jax.Array) -> jax.Array:
    # as ``jrl.models.layers.Linear`` then the residual add: the product in h's dtype, then the sum
    return residual + jax.lax.dot(h, w.astype(h.dtype)).astype(residual.dtype)


def matmul_swiglu(h: jax.Array, w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
    # as ``jrl.models.layers.MLP``'s hidden activation: silu(h @ w_gate) * (h @ w_up), all in h's dtype
    return jax.nn.silu(jax.lax.dot(h, w_gate.astype(h.dtype))) * jax.lax.dot(h, w_up.astype(h.dtype))


def matmul_concat(h: jax.Array, weights) -> jax.Array:
    # as the attention's q, k and v ``jrl.models.layers.Linear`` layers, their products then side by side
    return jnp.concatenate([jax.lax.dot(h, w.astype(h.dtype)) for w in weights], axis=1)
