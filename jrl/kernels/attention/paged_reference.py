"""Decode attention through a page table, in plain JAX (the truth the paged kernels are tested against): each row's
pages are gathered into a contiguous cache and attended densely."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.kernels.attention.reference import decode_attention, rope_step


def unavailable_reason() -> str | None:
    return None


def is_float8(dtype) -> bool:
    """Whether a pool of ``dtype`` holds float8 keys and values (stored clipped, read widened)."""
    dtype = jnp.dtype(dtype)
    return dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def stored_as(x: jax.Array, dtype) -> jax.Array:
    """``x`` as a pool of ``dtype`` stores it: a float8 pool's values clipped to the type's finite range first (a
    conversion past it gives NaN in XLA; the GPU kernel's conversion saturates the same way)."""
    dtype = jnp.dtype(dtype)
    if is_float8(dtype):
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)


def read_dtype(query_dtype, pool_dtype) -> jnp.dtype:
    """The dtype a decode step's attention reads a pool in: float16 for a float8 pool (every float8 value is exact in
    float16, and a GPU widens a pair of them in one instruction, where bfloat16 takes three), else the queries'."""
    return jnp.dtype(jnp.float16 if is_float8(pool_dtype) else query_dtype)


def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """Row-major cache [B, M * page_size, K, D] of ``pages`` [K, P, page_size, D] through ``page_table`` [B, M]."""
    kh, _, page, d = pages.shape
    b, m = page_table.shape
    rows = pages[:, page_table]  # [K, B, M, page, D]
    return rows.transpose(1, 2, 3, 0, 4).reshape(b, m * page, kh, d)


def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, scale: float,
                           window: int | None = None) -> jax.Array:
    """``q`` [B, N, D] over the first ``lengths[b]`` slots of row b's pages (the last ``window`` of them), in
    :func:`read_dtype` (a float8 pool's keys and values and the queries in float16); the output in q's dtype."""
    dtype = read_dtype(q.dtype, k_pages.dtype)
    k, v = (gather_pages(pages, page_table).astype(dtype) for pages in (k_pages, v_pages))
    slots = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :]
    allowed = slots < lengths[:, None]
    if window is not None:
        allowed &= slots >= lengths[:, None] - window
    return decode_attention(q.astype(dtype), k, v, allowed, scale=scale).astype(q.dtype)


def rope_and_write_pages(qkv, cos, sin, k_pages, v_pages, page, offset):
    """A paged decode step's work before its attention: of ``qkv`` [B, N + 2K, D], the queries (the first N) and
    the step's keys (the next K) rotated by cos / sin [B, R]; the keys (rotated) and the values (the last K) of
    row b stored at slot ``offset[b]`` of page ``page[b]`` of k_pages / v_pages [K, P, page_size, D] (in the pool's
    dtype, :func:`stored_as`). Returns (q, k_pages, v_pages)."""
    q, k_new, v_new = rope_step(qkv, cos, sin, k_pages.shape[0])
    at = (slice(None), page, offset)
    return (q, k_pages.at[at].set(stored_as(k_new.transpose(1, 0, 2), k_pages.dtype)),
            v_pages.at[at].set(stored_as(v_new.transpose(1, 0, 2), v_pages.dtype)))

