"""Decode attention through a page table on NVIDIA GPUs: JAX's Pallas paged attention kernel
(``jax.experimental.pallas.ops.gpu.paged_attention``), which reads only the pages a row's length reaches, split
over ``k_splits`` partitions of the page table per (row, KV head group). Off GPU it runs in interpret mode (tests
compare it with :mod:`.paged_reference`)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

_MAX_SPLITS = 16
_PAGES_PER_BLOCK = 8


def unavailable_reason() -> str | None:
    return None  # compiled on an NVIDIA GPU, in interpret mode elsewhere


def call_unsupported(q: jax.Array, k_pages: jax.Array) -> str | None:
    d, page = q.shape[-1], k_pages.shape[2]
    if k_pages.dtype != q.dtype:
        return f"a {k_pages.dtype} pool under {q.dtype} queries (the kernel multiplies them as they are)"
    if d % 16 or page % 16:
        return f"head_dim {d} and page_size {page} must be multiples of 16 (Triton's matrix product)"
    return None


def _layout(pages_per_row: int) -> tuple[int, int, int]:
    """``(splits, pages per compute block, padded table width)``: Triton needs power-of-two blocks, so the page
    table is padded with page 0 (never read: past every row's length) to ``splits x block x n`` columns; as many
    splits (up to 16) as leave each a whole block of up to 8 pages."""
    block = min(_PAGES_PER_BLOCK, 1 << (pages_per_row - 1).bit_length())
    splits = 1
    while splits < _MAX_SPLITS and 2 * splits * block <= pages_per_row:
        splits *= 2
    unit = splits * block
    return splits, block, -(-pages_per_row // unit) * unit


@functools.partial(jax.jit, static_argnames=("scale", "interpret"))
def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, scale: float,
                           interpret: bool | None = None) -> jax.Array:
    """See :func:`jrl.kernels.attention.api.paged_decode_attention`. The kernel takes unscaled scores: the queries
    are scaled first. A row of length 0 reads one slot (its output is unspecified, finite)."""
    interpret = jax.default_backend() not in ("gpu", "cuda") if interpret is None else interpret
    splits, block, width = _layout(page_table.shape[1])
    table = jnp.pad(page_table.astype(jnp.int32), ((0, 0), (0, width - page_table.shape[1])))
    out = jax_paged.paged_attention((q * scale).astype(q.dtype), k_pages, v_pages, table,
                                    jnp.maximum(lengths, 1).astype(jnp.int32), k_splits=splits,
                                    pages_per_compute_block=block, interpret=interpret)
    return out.astype(q.dtype)
