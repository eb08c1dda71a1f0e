"""Pure-JAX grouped matmul: the truth every MoE kernel is tested against.

Built on ``jax.lax.ragged_dot`` (fast on TPU, correct everywhere, slow on NVIDIA GPUs). Gradients come
from JAX's own transpose rules for ``ragged_dot``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _common_dtype(lhs: jax.Array, rhs: jax.Array):
    return jnp.promote_types(lhs.dtype, rhs.dtype)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, preferred_element_type=None,
        fill_past_groups: bool = True) -> jax.Array:
    """Grouped matmul for rows sorted by group.

    ``lhs`` [T, K] holds rows sorted by group, ``rhs`` [E, K, N] one matrix per group, ``group_sizes``
    [E] int32 the number of rows of each group (sum <= T; rows past the sum give zeros, whatever
    ``fill_past_groups`` says: with False an implementation may leave them unwritten).
    Returns [T, N] where row t uses ``rhs[g(t)]``; float32 accumulation, output in
    ``preferred_element_type`` (default: ``lhs``'s dtype).
    """
    out_dtype = preferred_element_type or lhs.dtype
    cdt = _common_dtype(lhs, rhs)
    return jax.lax.ragged_dot(
        lhs.astype(cdt), rhs.astype(cdt), group_sizes.astype(jnp.int32), preferred_element_type=jnp.float32
    ).astype(out_dtype)


def tgmm(lhs: jax.Array, dout: jax.Array, group_sizes: jax.Array, *, preferred_element_type=None) -> jax.Array:
    """Transposed grouped matmul: ``out[g] = lhs[rows of g].T @ dout[rows of g]``, shape [E, K, N].

    This is the weight gradient of :func:`gmm`. Empty groups give zeros; rows past ``sum(group_sizes)``
    are ignored.
    """
    e = group_sizes.shape[0]
    out_dtype = preferred_element_type or lhs.dtype
    cdt = _common_dtype(lhs, dout)
    k, n = lhs.shape[1], dout.shape[1]
    zeros = jnp.zeros((e, k, n), cdt)
    _, vjp = jax.vjp(
        lambda r: jax.lax.ragged_dot(lhs.astype(cdt), r, group_sizes.astype(jnp.int32),
                                     preferred_element_type=jnp.float32),
        zeros,
    )
    (out,) = vjp(dout.astype(jnp.float32))
    return out.astype(out_dtype)


def gmm_lora(lhs: jax.Array, rhs: jax.Array, lora_a: jax.Array, lora_b: jax.Array, scale, group_sizes: jax.Array,
             *, preferred_element_type=None) -> jax.Array:
    """``gmm(lhs, rhs) + scale * (lhs @ A_g) @ B_g`` per group, all in float32, with no [E, K, N] delta.

    ``lora_a`` [E, K, r], ``lora_b`` [E, r, N]; ``scale`` a scalar (PEFT's ``alpha / r``).
    """
    out_dtype = preferred_element_type or lhs.dtype
    gs = group_sizes.astype(jnp.int32)
    f32 = jnp.float32
    base = jax.lax.ragged_dot(lhs.astype(f32), rhs.astype(f32), gs, preferred_element_type=f32)
    xa = jax.lax.ragged_dot(lhs.astype(f32), lora_a.astype(f32), gs, preferred_element_type=f32)
    delta = jax.lax.ragged_dot(xa, lora_b.astype(f32), gs, preferred_element_type=f32)
    return (base + jnp.asarray(scale, f32) * delta).astype(out_dtype)
