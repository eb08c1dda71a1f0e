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


def block_schedule(group_sizes: jax.Array, num_rows: int, block_m: int):
    """(group, row block) pairs for kernels whose row tiles must start at multiples of ``block_m`` (TMA loads
    whose offsets come from memory).

    Returns (pair_group, pair_block, row_lo, row_hi), each int32 [cdiv(num_rows, block_m) + E], and the
    number of live pairs (int32 [1]); pair i covers rows ``[row_lo, row_hi)`` of group ``pair_group``, all
    inside row block ``pair_block``. A block that two groups share appears once per group (each stores its
    own rows). Live pairs come first, in row order; rows past ``sum(group_sizes)`` form the sentinel group
    E (written as zeros). Group ends are clamped to ``num_rows``.
    """
    e = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, num_rows)
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])
    first = starts // block_m
    blocks = jnp.where(ends > starts, (ends + block_m - 1) // block_m - first, 0)
    cum = jnp.cumsum(blocks)
    max_pairs = -(-num_rows // block_m) + e
    i = jnp.arange(max_pairs, dtype=jnp.int32)
    g = jnp.minimum(jnp.searchsorted(cum, i, side="right"), e).astype(jnp.int32)
    block = first[g] + i - (cum[g] - blocks[g])
    lo = jnp.maximum(starts[g], block * block_m)
    hi = jnp.minimum(ends[g], (block + 1) * block_m)
    return g, block.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32), cum[-1:].astype(jnp.int32)
