"""Sorting (token, expert) pairs by expert and combining expert outputs back, around a grouped matmul."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Permutation(NamedTuple):
    """Result of :func:`permute`: what :func:`unpermute` needs to undo it."""

    sorted_x: jax.Array  # [T*K, H] token rows, sorted by expert
    group_sizes: jax.Array  # [E] int32 rows per expert
    order: jax.Array  # [T*K] index into the flat (token, k) list for each sorted row


def permute(x: jax.Array, expert_idx: jax.Array, num_experts: int) -> Permutation:
    """Replicate each token once per chosen expert and sort the copies by expert id.

    ``x`` [T, H], ``expert_idx`` [T, K] int. The sort is stable, so within an expert rows keep token order.
    """
    t, k = expert_idx.shape
    flat_expert = expert_idx.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True)
    sorted_x = jnp.take(x, order // k, axis=0)
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    return Permutation(sorted_x, group_sizes, order)


def unpermute(y_sorted: jax.Array, perm: Permutation, weights: jax.Array, dtype=None) -> jax.Array:
    """Undo :func:`permute` and sum each token's expert outputs weighted by ``weights`` [T, K].

    Weighting happens in float32; the result has ``dtype`` (default: ``y_sorted``'s).
    """
    t, k = weights.shape
    y_flat = jnp.zeros_like(y_sorted).at[perm.order].set(y_sorted)
    y = y_flat.reshape(t, k, -1).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", y, weights.astype(jnp.float32)).astype(dtype or y_sorted.dtype)
