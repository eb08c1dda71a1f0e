"""Pure-JAX reference of the decode-step matmul: the decoder layer's own two ops (the truth the kernel is
tested against, and what runs where no kernel does)."""

from __future__ import annotations

import jax


def matmul_add(h: jax.Array, w: jax.Array, residual: jax.Array) -> jax.Array:
    # as ``jrl.models.layers.Linear`` then the residual add: the product in h's dtype, then the sum
    return residual + jax.lax.dot(h, w.astype(h.dtype)).astype(residual.dtype)
