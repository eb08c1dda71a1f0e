"""Decode attention through a page table, in plain JAX (the truth the paged kernels are tested against): each row's
pages are gathered into a contiguous cache and attended densely."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.kernels.attention.reference import decode_attention, rope_step


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


def rope_and_write_pages(qkv, cos, sin, k_pages, v_pages, page, offset):
    """A paged decode step's work before its attention: of ``qkv`` [B, N + 2K, D], the queries (the first N) and
    the step's keys (the next K) rotated by cos / sin [B, R]; the keys (rotated) and the values (the last K) of
    row b stored at slot ``offset[b]`` of page ``page[b]`` of k_pages / v_pages [K, P, page_size, D]. Returns
    (q, k_pages, v_pages)."""
    q, k_new, v_new = rope_step(qkv, cos, sin, k_pages.shape[0])
    at = (slice(None), page, offset)
    return (q, k_pages.at[at].set(k_new.transpose(1, 0, 2).astype(k_pages.dtype)),
            v_pages.at[at].set(v_new.transpose(1, 0, 2).astype(v_pages.dtype)))

