"""Decode attention through a page table, in plain JAX (the truth the paged kernels are tested against): each row's
pages are gathered into a contiguous cache and attended densely."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.kernels.attention.reference import decode_attention


def unavailable_reason() -> str | None:
    return None


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """Row-major cache [B, M * page_size, K, D] of ``pages`` [K, P, page_size, D] through ``page_table`` [B, M]."""
    kh, _, page, d = pages.shape
    b, m = page_table.shape
    rows = pages[:, page_table]  # [K, B, M, page, D]
    return rows.transpose(1, 2, 3, 0, 4).reshape(b, m * page, kh, d)


def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, scale: float,
                           window: int | None = None) -> jax.Array:
    """``q`` [B, N, D] over the first ``lengths[b]`` slots of row b's pages (the last ``window`` of them)."""
    k, v = gather_pages(k_pages, page_table), gather_pages(v_pages, page_table)
    slots = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
    allowed = slots < lengths[:, None]
    if window is not None:
        allowed &= slots >= lengths[:, None] - window
    return decode_attention(q, k, v, allowed, scale=scale)
