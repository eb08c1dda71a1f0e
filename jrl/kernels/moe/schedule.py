"""Tile schedules for grouped matmul kernels over rows sorted by group (pure JAX, no kernel deps)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int):
    """Static-size m-tile schedule for :func:`triton_kernels.gmm_kernel`.

    Returns (tile_group, row_start, row_end), each int32 [cdiv(num_rows, block_m) + E]: tile i covers
    rows ``[row_start, min(row_start + block_m, row_end))`` of group ``tile_group`` (E = the zero-fill
    sentinel for rows past ``sum(group_sizes)``, -1 = unused slot). Group ends are clamped to
    ``num_rows`` so that bad group sizes can never address memory out of bounds.
    """
    e = group_sizes.shape[0]
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(gs), num_rows).astype(jnp.int32)
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    sizes = ends - starts
    tiles = (sizes + block_m - 1) // block_m
    cum = jnp.cumsum(tiles)
    max_tiles = -(-num_rows // block_m) + e
    i = jnp.arange(max_tiles, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(cum, i, side="right"), e).astype(jnp.int32)
    local = i - (cum[g] - tiles[g])
    row_start = starts[g] + local * block_m
    row_end = ends[g]
    tile_group = jnp.where(i < cum[-1], g, -1).astype(jnp.int32)
    return tile_group, row_start.astype(jnp.int32), row_end.astype(jnp.int32)


def group_bounds(group_sizes: jax.Array, num_rows: int):
    """(start, end) int32 [E] of each group's rows, clamped to ``num_rows``."""
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(gs), num_rows).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends
