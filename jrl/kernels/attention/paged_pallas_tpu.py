"""Decode attention through a page table on TPUs: JAX's Pallas TPU paged attention kernel
(``jax.experimental.pallas.ops.tpu.paged_attention``), which copies only the pages a row's length reaches from HBM,
``pages_per_compute_block`` at a time. It reads keys and values in bfloat16 whatever their dtype, so it takes
bfloat16 inputs only (float32 ones fall back to the reference). Off TPU it runs in Pallas TPU interpret mode
(tests compare it with :mod:`.paged_reference`)."""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as jax_paged

_PAGES_PER_BLOCK = 8


def unavailable_reason() -> str | None:
    return None  # runs for real on TPU, in interpret mode elsewhere


def call_unsupported(q: jax.Array, k_pages: jax.Array) -> str | None:
    if q.dtype != jnp.bfloat16 or k_pages.dtype != jnp.bfloat16:
        return f"dtype {q.dtype} (the kernel reads keys and values in bfloat16)"
    if q.shape[-1] % 128:
        return f"head_dim {q.shape[-1]} (a TPU lane holds 128)"
    return None


def paged_decode_attention(q, k_pages, v_pages, page_table, lengths, *, scale: float,
                           interpret: bool | None = None) -> jax.Array:
    """See :func:`jrl.kernels.attention.api.paged_decode_attention`; the kernel takes unscaled scores, so the
    queries are scaled first."""
    interpret = jax.default_backend() != "tpu" if interpret is None else interpret
    per_row = page_table.shape[1]
    block = max(b for b in range(1, min(per_row, _PAGES_PER_BLOCK) + 1) if per_row % b == 0)
    with pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext():
        out = jax_paged((q * scale).astype(q.dtype), k_pages, v_pages, jnp.maximum(lengths, 1).astype(jnp.int32),
                        page_table.astype(jnp.int32), pages_per_compute_block=block)
    return out.astype(q.dtype)
