"""Rotary position embedding, "rotate_half" convention of HF Llama / Qwen (the model applies it before
attention; the decode-step kernel applies it inside)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate x [B, S, heads, D] by cos / sin [B, S, R] in float32, cast back to x's dtype. With R < D (partial
    rotary) only the leading R dims rotate and the rest pass through."""
    x32 = x.astype(jnp.float32)
    r = cos.shape[-1]
    x_rot, x_pass = x32[..., :r], x32[..., r:]
    x1, x2 = jnp.split(x_rot, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x_rot * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return jnp.concatenate([out, x_pass], axis=-1).astype(x.dtype)
