"""The row operations of :mod:`jrl.kernels.moe.rows` in plain JAX (the truth the kernels are tested against, and
the implementation off GPUs)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def take_rows(src: jax.Array, index: jax.Array, k: int, scale: jax.Array | None, dtype, fill: bool) -> jax.Array:
    del fill  # zeros either way: a row the caller leaves unspecified may hold them
    rows = jnp.take(src, index // k, axis=0, mode="fill", fill_value=0)
    if scale is not None:
        rows = rows.astype(jnp.float32) * jnp.take(scale, index, mode="fill", fill_value=0)[:, None]
    return rows.astype(dtype)


def swiglu_fwd(a: jax.Array, b: jax.Array, count: jax.Array) -> jax.Array:
    live = (jnp.arange(a.shape[0]) < count)[:, None]
    return jnp.where(live, jax.nn.silu(a) * b, 0).astype(a.dtype)


def swiglu_bwd(a: jax.Array, b: jax.Array, g: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jax.vjp(lambda a, b: swiglu_fwd(a, b, count), a, b)[1](g.astype(a.dtype))
