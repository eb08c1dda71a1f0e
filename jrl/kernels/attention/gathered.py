"""A packed row's tokens moved into the gathered layout of shared prompts (:attr:`AttentionMask.expand`) and the
attention's outputs moved back, each with a backward that gathers too.

The transpose of a gather is a scatter-add, which XLA runs on a GPU with atomic adds: on an H200 0.5-0.7 ms per
[4, 9728, 32, 64] bf16 tensor, four per layer (queries, keys, values and outputs: ~5% of a 1B model's packed
update). Every column of the row knows the positions that hold it (``copies``: its first, whose output it takes,
then its repeats), so the backward of ``expand`` reads those few positions per column and sums them, and the
backward of ``collapse`` reads each first position's column and zeroes the repeats.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def take_rows(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x`` [B, T, ...] at ``index`` [B, I] along its second axis: [B, I, ...]; an index of T or more reads 0."""
    index = index.reshape(index.shape + (1,) * (x.ndim - 2))
    return jnp.take_along_axis(x, index, axis=1, mode="fill", fill_value=0)


@jax.custom_vjp
def expand_rows(x: jax.Array, expand: jax.Array, copies: jax.Array) -> jax.Array:
    """``x`` [B, T, ...] gathered into the layout ``expand`` [B, E] (position ``e`` holds column ``expand[e]``);
    ``copies`` [B, T, C]: the positions holding each column (its first, then its repeats; E past the last)."""
    return take_rows(x, expand)


def _expand_fwd(x, expand, copies):
    return take_rows(x, expand), copies


def _expand_bwd(copies, g):
    total = sum(take_rows(g, copies[:, :, c]).astype(jnp.float32) for c in range(copies.shape[2]))
    return total.astype(g.dtype), None, None


expand_rows.defvjp(_expand_fwd, _expand_bwd)


@jax.custom_vjp
def collapse_rows(y: jax.Array, expand: jax.Array, copies: jax.Array) -> jax.Array:
    """``y`` [B, E, ...] over the layout ``expand`` back to the row [B, T, ...]: each column takes its first
    position's (``copies[:, :, 0]``). The backward gives position ``e`` the cotangent of column ``expand[e]`` if
    ``e`` is that column's first: exact where no two columns share a first position (a packed row's padding columns
    all take the layout's last one, and only the last column's cotangent reaches it; no loss reads padding, so
    theirs are zero)."""
    return take_rows(y, copies[:, :, 0])


def _collapse_fwd(y, expand, copies):
    return take_rows(y, copies[:, :, 0]), (expand, copies)


def _collapse_bwd(residuals, g):
    expand, copies = residuals
    first = take_rows(copies[:, :, 0], expand) == jnp.arange(expand.shape[1], dtype=expand.dtype)
    dy = take_rows(g, expand)
    return jnp.where(first.reshape(first.shape + (1,) * (g.ndim - 2)), dy, 0).astype(g.dtype), None, None


collapse_rows.defvjp(_collapse_fwd, _collapse_bwd)
