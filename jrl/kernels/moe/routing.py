"""Sorting (token, expert) pairs by expert and combining expert outputs back, around a grouped matmul.

Both directions move rows with gathers only, forward and backward. Left to autodiff, the backward of the gather
that copies each token into its experts' rows is a scatter-add of every sorted row into its token (atomic adds in
the activations' dtype on a GPU), and undoing the sort by scattering materialises the sorted outputs a second time.
Since the sort is a permutation, each of those is a gather through the inverse permutation instead, followed by
a sum over a token's ``K`` rows in float32 (:func:`_copy_rows`, :func:`_combine`).

``permute(..., capacity=C)`` keeps only the first ``C`` sorted rows (the caller knows that the rows it needs sort
first); the dropped rows' outputs read as zeros in :func:`unpermute`.

A (token, expert) pair whose expert id is ``num_experts`` or more is routed nowhere (an expert-parallel device's
view of the pairs bound for its peers' experts): it sorts past the groups, and every gather takes its row as zeros
through an out-of-range index instead of reading it. An expert-parallel device's buffer is mostly such rows. The
two gathers that write the sorted buffer (the tokens copied in, the output's gradient copied back) run
:func:`jrl.kernels.moe.rows.take_rows`, which stores zeros past the rows in use without loading anything, or with
``fill_unrouted=False`` leaves them unwritten (an expert-parallel device's, whose kernels skip them); the two
that sum into tokens stay XLA's (their rows routed nowhere all point at the same clamped row, read once from
memory).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.kernels.moe.rows import take_rows


class Permutation(NamedTuple):
    """Result of :func:`permute`: what :func:`unpermute` needs to undo it."""

    sorted_x: jax.Array  # [T*K, H] token rows, sorted by expert ([capacity, H] with a capacity)
    group_sizes: jax.Array  # [E] int32 rows per expert
    order: jax.Array  # [T*K] index into the flat (token, k) list for each sorted row
    inverse: jax.Array  # [T*K] the sorted row of each flat (token, k) entry: order[inverse[i]] == i


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _copy_rows(x: jax.Array, rows: jax.Array, back: jax.Array, k: int, fill: bool) -> jax.Array:
    """``x[rows // k]``: row ``i`` of the result is row ``rows[i] // k`` of ``x`` [T, H] (each row of ``x`` appears up
    to ``k`` times), or where that is past ``x``'s rows zeros (``fill``, else unspecified); ``rows`` are the first
    entries of a permutation of ``range(T * k)`` and ``back`` its inverse, either of them ``T * k`` for a pair routed
    nowhere."""
    return take_rows(x, rows, k=k, fill=fill)


def _copy_rows_fwd(x, rows, back, k, fill):
    return _copy_rows(x, rows, back, k, fill), (rows, back)


def _copy_rows_bwd(k, fill, res, g):
    rows, back = res
    # Row t of x went to the result rows back[t*k : t*k + k] (those past the result were dropped): gather them and
    # add (in float32 when k > 1).
    dx = jnp.take(g, back, axis=0, mode="fill", fill_value=0)
    if k > 1:
        dx = dx.reshape(-1, k, g.shape[-1]).astype(jnp.float32).sum(1).astype(g.dtype)
    return dx, None, None


_copy_rows.defvjp(_copy_rows_fwd, _copy_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _combine(y_sorted: jax.Array, weights: jax.Array, order: jax.Array, inverse: jax.Array, dtype,
             fill: bool) -> jax.Array:
    """``out[t] = sum_k weights[t, k] y_sorted[inverse[t*K + k]]`` in float32, as ``dtype``; a pair whose sorted row
    is past ``y_sorted``'s rows adds zero. ``order`` is the permutation ``inverse`` undoes (for the gradient, whose
    sorted rows of pairs routed nowhere are zeros with ``fill``, else unspecified)."""
    y = _pair_rows(y_sorted, inverse, weights.shape)
    return (y.astype(jnp.float32) * weights.astype(jnp.float32)[..., None]).sum(1).astype(dtype)


def _pair_rows(y_sorted: jax.Array, inverse: jax.Array, pairs: tuple[int, int]) -> jax.Array:
    """The sorted row of each (token, slot) pair, [T, K, H] for ``pairs`` = (T, K); zeros past ``y_sorted``."""
    return jnp.take(y_sorted, inverse, axis=0, mode="fill", fill_value=0).reshape(*pairs, -1)


def _combine_fwd(y_sorted, weights, order, inverse, dtype, fill):
    return _combine(y_sorted, weights, order, inverse, dtype, fill), (y_sorted, weights, order, inverse)


def _combine_bwd(dtype, fill, res, g):
    y_sorted, weights, order, inverse = res
    t, k = weights.shape
    # Sorted row r came from pair order[r] = (token, slot): its gradient is that token's, times the pair's weight.
    dy = take_rows(g, order[:y_sorted.shape[0]], k=k, scale=weights.reshape(-1), dtype=y_sorted.dtype, fill=fill)
    y = _pair_rows(y_sorted, inverse, (t, k))
    dweights = (y.astype(jnp.float32) * g.astype(jnp.float32)[:, None, :]).sum(-1).astype(weights.dtype)
    return dy, dweights, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def permute(x: jax.Array, expert_idx: jax.Array, num_experts: int, capacity: int | None = None, *,
            fill_unrouted: bool = True) -> Permutation:
    """Replicate each token once per chosen expert and sort the copies by expert id.

    ``x`` [T, H], ``expert_idx`` [T, K] int, ids ``>= num_experts`` routed nowhere (module docstring). The sort is
    stable, so within an expert rows keep token order. ``capacity``: keep the first ``capacity`` sorted rows only
    (``group_sizes`` still counts every row). ``order`` and ``inverse`` hold ``t * k`` for the sorted rows and the
    pairs routed nowhere: an index past every array they gather from. The sorted rows of those pairs are zeros, or
    with ``fill_unrouted=False`` unspecified (left unwritten on a GPU: for callers that never read them).
    """
    t, k = expert_idx.shape
    flat_expert = expert_idx.reshape(-1)
    order = jnp.argsort(flat_expert, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(t * k, dtype=jnp.int32))
    routed = flat_expert < num_experts
    order = jnp.where(jnp.arange(t * k) < jnp.sum(routed), order, t * k)
    inverse = jnp.where(routed, inverse, t * k)
    sorted_x = _copy_rows(x, order if capacity is None else order[:capacity], inverse, k, fill_unrouted)
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    return Permutation(sorted_x, group_sizes, order, inverse)


def unpermute(y_sorted: jax.Array, perm: Permutation, weights: jax.Array, dtype=None, *,
              fill_unrouted: bool = True) -> jax.Array:
    """Undo :func:`permute` and sum each token's expert outputs weighted by ``weights`` [T, K].

    Weighting happens in float32; the result has ``dtype`` (default: ``y_sorted``'s). Rows that a capacity dropped
    give zeros. ``fill_unrouted`` as :func:`permute`'s, for the gradient's sorted rows.
    """
    return _combine(y_sorted, weights, perm.order, perm.inverse, jnp.dtype(dtype or y_sorted.dtype), fill_unrouted)
