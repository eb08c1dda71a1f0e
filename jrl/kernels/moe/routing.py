"""Sorting (token, expert) pairs by expert and combining expert outputs back, around a grouped matmul.

Both directions move rows with gathers only, forward and backward. Left to autodiff, the backward of the gather
that copies each token into its experts' rows is a scatter-add of every sorted row into its token (atomic adds in
the activations' dtype on a GPU), and undoing the sort by scattering materialises the sorted outputs a second time.
Since the sort is a permutation, each of those is a gather through the inverse permutation instead, followed by
a sum over a token's ``K`` rows in float32 (:func:`_gather_rows`).

``permute(..., capacity=C)`` keeps only the first ``C`` sorted rows (the caller knows that the rows it needs sort
first); the dropped rows' outputs read as zeros in :func:`unpermute`.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Permutation(NamedTuple):
    """Result of :func:`permute`: what :func:`unpermute` needs to undo it."""

    sorted_x: jax.Array  # [T*K, H] token rows, sorted by expert ([capacity, H] with a capacity)
    group_sizes: jax.Array  # [E] int32 rows per expert
    order: jax.Array  # [T*K] index into the flat (token, k) list for each sorted row
    inverse: jax.Array  # [T*K] the sorted row of each flat (token, k) entry: order[inverse[i]] == i


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gather_rows(x: jax.Array, rows: jax.Array, back: jax.Array, k: int) -> jax.Array:
    """``x[rows // k]`` for ``rows`` the first entries of a permutation of ``range(n)`` and ``back`` its inverse:
    row ``i`` of the result is row ``rows[i] // k`` of ``x`` (each row of ``x`` appears up to ``k`` times), or zeros
    where ``rows[i] // k`` is past ``x``'s rows."""
    return jnp.take(x, rows // k, axis=0, mode="fill", fill_value=0)


def _gather_rows_fwd(x, rows, back, k):
    return _gather_rows(x, rows, back, k), (rows, back)


def _gather_rows_bwd(k, res, g):
    rows, back = res
    # Row t of x went to the result rows back[t*k : t*k + k] (those past the result were dropped): gather them and
    # add (in float32 when k > 1).
    dx = jnp.take(g, back, axis=0, mode="fill", fill_value=0)
    if k > 1:
        dx = dx.reshape(-1, k, g.shape[-1]).astype(jnp.float32).sum(1).astype(g.dtype)
    return dx, None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def permute(x: jax.Array, expert_idx: jax.Array, num_experts: int, capacity: int | None = None) -> Permutation:
    """Replicate each token once per chosen expert and sort the copies by expert id.

    ``x`` [T, H], ``expert_idx`` [T, K] int. The sort is stable, so within an expert rows keep token order.
    ``capacity``: keep the first ``capacity`` sorted rows only (``group_sizes`` still counts every row).
    """
    t, k = expert_idx.shape
    flat_expert = expert_idx.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=jnp.int32))
    sorted_x = _gather_rows(x, order if capacity is None else order[:capacity], inverse, k)
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    return Permutation(sorted_x, group_sizes, order, inverse)


def unpermute(y_sorted: jax.Array, perm: Permutation, weights: jax.Array, dtype=None) -> jax.Array:
    """Undo :func:`permute` and sum each token's expert outputs weighted by ``weights`` [T, K].

    Weighting happens in float32; the result has ``dtype`` (default: ``y_sorted``'s). Rows that a capacity dropped
    give zeros.
    """
    t, k = weights.shape
    y = _gather_rows(y_sorted, perm.inverse, perm.order[:y_sorted.shape[0]], 1).reshape(t, k, -1)
    out = (y.astype(jnp.float32) * weights.astype(jnp.float32)[..., None]).sum(1)
    return out.astype(dtype or y_sorted.dtype)
