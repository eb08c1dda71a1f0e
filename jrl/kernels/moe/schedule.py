"""Tile schedules for grouped matmul kernels over rows sorted by group (pure JAX, no kernel deps)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int):
    """Static-size m-tile schedule for :func:`triton_kernels.gmm_kernel`: :func:`aligned_tile_schedule` with tiles
    starting at each group's first row (any row: the Triton kernel's loads take any offset).

    Returns (tile_group, row_start, row_end), each int32 [cdiv(num_rows, block_m) + E]: tile i covers
    rows ``[row_start, min(row_start + block_m, row_end))`` of group ``tile_group`` (E = the zero-fill
    sentinel for rows past ``sum(group_sizes)``, -1 = unused slot). Group ends are clamped to
    ``num_rows`` so that bad group sizes can never address memory out of bounds.
    """
    group, _, lo, hi, live = aligned_tile_schedule(group_sizes, num_rows, block_m, align=1)
    size = -(-num_rows // block_m) + group_sizes.shape[0]  # every tile (rows and group ends) fits in this
    tile_group = jnp.where(jnp.arange(size) < live, group[:size], -1).astype(jnp.int32)
    return tile_group, lo[:size], hi[:size]


def group_bounds(group_sizes: jax.Array, num_rows: int):
    """(start, end) int32 [E] of each group's rows, clamped to ``num_rows``."""
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(gs), num_rows).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


def aligned_tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int,
                          align: int | None = None):
    """Row tiles for kernels whose tile offsets, read from memory, must be multiples of ``align`` (TMA loads;
    default ``block_m``: tiles are the row blocks).

    A group's tiles start at its first row rounded down to ``align``, then every ``block_m`` rows; rows of a tile
    outside its group (at most ``align - 1`` before it, and the tail of the last tile) are computed but not stored,
    so with ``align = block_m`` a block that two groups share appears once per group.

    Returns (tile_group, tile_start, row_lo, row_hi), each int32 [cdiv(num_rows + lead, block_m) + E + 1] (lead:
    (E + 1)(align - 1), 0 for row blocks), and the number of live tiles (int32 [1]). Tile i loads rows
    ``[tile_start, tile_start + block_m)`` and stores rows ``[row_lo, row_hi)`` of group ``tile_group``;
    ``tile_start`` is clamped to ``num_rows - block_m`` (the last tiles read earlier rows instead of rows past the
    end), so it is a multiple of ``align`` when ``num_rows`` is a multiple of ``block_m`` and of ``align``. Live
    tiles come first, in row order; rows past ``sum(group_sizes)`` form the sentinel group E (written as zeros).
    Group ends are clamped to ``num_rows``.
    """
    align = block_m if align is None else align
    e = group_sizes.shape[0]
    starts, ends = group_bounds(group_sizes, num_rows)
    starts = jnp.concatenate([starts, ends[-1:]])
    ends = jnp.concatenate([ends, jnp.full((1,), num_rows, jnp.int32)])
    first = starts // align * align
    tiles = jnp.where(ends > starts, (ends - first + block_m - 1) // block_m, 0)
    cum = jnp.cumsum(tiles)
    # each of the E + 1 groups adds at most one partial tile, and align - 1 leading rows when align < block_m
    lead = 0 if align == block_m else (e + 1) * (align - 1)
    max_tiles = -(-(num_rows + lead) // block_m) + e + 1
    i = jnp.arange(max_tiles, dtype=jnp.int32)
    # compare_all: one fused comparison (the default binary search is a while loop: ~50 us of launches on a GPU)
    g = jnp.minimum(jnp.searchsorted(cum, i, side="right", method="compare_all"), e).astype(jnp.int32)
    tile = first[g] + (i - (cum[g] - tiles[g])) * block_m
    lo = jnp.maximum(starts[g], tile)
    hi = jnp.minimum(ends[g], tile + block_m)
    start = jnp.maximum(jnp.minimum(tile, num_rows - block_m), 0)
    return g, start.astype(jnp.int32), lo.astype(jnp.int32), hi.astype(jnp.int32), cum[-1:].astype(jnp.int32)
