"""Shared math for the fused logprob kernels: the per-tile online-logsumexp update, the gradient of a
logits tile (from logits, or from probabilities a forward saved), the loop over vocab chunks, and the
vocab-chunked backward pass used by the XLA and GPU implementations.

Notation, per row n (token) and vocab column v: ``l = (h @ W) * inv_temp`` (float32),
``lse = logsumexp_v l``, ``p = exp(l - lse)``, ``logp = l[target] - lse`` and
``ent = lse - sum_v p l``. With cotangents ``g_lp`` and ``g_ent`` [N]:

    dL/dl_v = g_lp * (1[v == target] - p_v) - g_ent * p_v * (l_v - lse + ent)

and ``dz = dL/dl * inv_temp`` is the gradient of the raw product ``h @ W``, so
``dh = dz @ W^T`` and ``dW = h^T @ dz``. Temperature is treated as a constant (no gradient).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

NEG_INF = float("-inf")


@dataclasses.dataclass(frozen=True)
class Flags:
    """Static switches shared by all implementations."""

    with_entropy: bool = False
    lm_head_f32: bool = False


def compute_dtype(hidden_dtype, lm_head_dtype, lm_head_f32: bool):
    """Dtype the logits matmul runs in: float32 with ``lm_head_f32``, else the promoted input dtype."""
    if lm_head_f32:
        return jnp.dtype(jnp.float32)
    return jnp.promote_types(hidden_dtype, lm_head_dtype)


def dot_f32(a, b, cdt, dims=(((1,), (0,)), ((), ()))):
    """``a @ b`` (dot_general dims) in dtype ``cdt`` with float32 accumulation; exact float32 when
    ``cdt`` is float32 (no tf32 on GPU)."""
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(cdt) == jnp.float32 else None
    return jax.lax.dot_general(a.astype(cdt), b.astype(cdt), dims, precision=precision,
                               preferred_element_type=jnp.float32)


def tile_logits(hid, w_tile, inv_temp, cdt):
    """One float32 logits tile ``(hid @ w_tile) * inv_temp`` (see :func:`dot_f32`)."""
    return dot_f32(hid, w_tile, cdt) * inv_temp


def default_block_v(n: int, v: int, budget_bytes: int = 512 * 2**20) -> int:
    """Vocab tile so that one float32 ``[n, block_v]`` logits tile stays near ``budget_bytes``."""
    bv = 128
    while bv * 2 * n * 4 <= budget_bytes and bv < 32768:
        bv *= 2
    return min(bv, max(128, -(-v // 128) * 128))


def combine_partials(m, s, t, tg):
    """Merge online-softmax partials over a leading split axis ([S, N] each) -> (lse, logp, ent)."""
    big = jnp.max(m, axis=0)
    scale = jnp.exp(m - big[None])  # empty splits have m = -inf -> 0
    s_tot = jnp.sum(s * scale, axis=0)
    t_tot = jnp.sum(t * scale, axis=0)
    lse = big + jnp.log(s_tot)
    return lse, jnp.sum(tg, axis=0) - lse, lse - t_tot / s_tot


def dz_tile(l, cols, targets, lse, ent, g_lp, g_ent, inv_temp, with_entropy: bool):
    """Gradient of ``h @ W`` for one logits tile ``l`` [N, bv] (float32, already scaled by inv_temp).

    ``cols`` [bv] are the tile's global vocab ids; columns >= V must be masked by the caller.
    """
    return dz_from_probs(jnp.exp(l - lse[:, None]), l, cols, targets, lse, ent, g_lp, g_ent, inv_temp, with_entropy)


def recompute_dz(hid, lm_head, v0, width: int, targets, lse, ent, g_lp, g_ent, inv_temp, cdt, with_entropy: bool):
    """:func:`dz_tile` for columns ``[v0, v0 + width)``, recomputing that logits tile from ``hid`` (the
    hidden states in ``cdt``) and ``lm_head``; ``v0`` may be traced, ``width`` is static."""
    w_tile = jax.lax.dynamic_slice_in_dim(lm_head, v0, width, axis=1)
    l = tile_logits(hid, w_tile, inv_temp, cdt)
    cols = v0 + jnp.arange(width, dtype=jnp.int32)
    return dz_tile(l, cols, targets, lse, ent, g_lp, g_ent, inv_temp, with_entropy)


def dz_from_probs(p, l, cols, targets, lse, ent, g_lp, g_ent, inv_temp, with_entropy: bool):
    """:func:`dz_tile` given the tile's probabilities ``p`` as well as its logits ``l`` (``l`` is only
    read for the entropy term, and only where ``p > 0``, so ``l = -inf`` there is harmless)."""
    d = jnp.where(cols[None, :] == targets[:, None], g_lp[:, None], 0.0) - g_lp[:, None] * p
    if with_entropy:
        d = d - g_ent[:, None] * jnp.where(p > 0, p * (l - lse[:, None] + ent[:, None]), 0.0)
    return d * inv_temp


def dz_from_saved(e, mt, block_v: int, v0, width: int, targets, lse, ent, g_lp, g_ent, inv_temp, with_entropy: bool):
    """:func:`dz_tile` for columns ``[v0, v0 + width)`` from a forward that saved, per vocab tile of
    ``block_v`` columns, ``e = exp(l - m)`` ([N, V], any float dtype) and that tile's running max ``m``
    (``mt`` [N, cdiv(V, block_v)], float32): ``p = e * exp(m - lse)`` and ``l = m + log(e)``, no matmul.
    ``v0`` (a multiple of ``block_v``) may be traced; ``width`` is static."""
    n = e.shape[0]
    tiles = -(-width // block_v)
    e_c = jax.lax.dynamic_slice_in_dim(e, v0, width, axis=1).astype(jnp.float32)
    mt_c = jax.lax.dynamic_slice_in_dim(mt, v0 // block_v, tiles, axis=1)
    mt_c = jnp.broadcast_to(mt_c[:, :, None], (n, tiles, block_v)).reshape(n, tiles * block_v)[:, :width]
    p = e_c * jnp.exp(mt_c - lse[:, None])
    l = mt_c + jnp.log(e_c) if with_entropy else None
    cols = v0 + jnp.arange(width, dtype=jnp.int32)
    return dz_from_probs(p, l, cols, targets, lse, ent, g_lp, g_ent, inv_temp, with_entropy)


def fold_vocab_chunks(lm_head, block_v: int, step: Callable, carry):
    """Fold ``step(carry, w_chunk, v0, width) -> carry`` over ``lm_head``'s vocab chunks of ``block_v``
    columns: one ``lax.fori_loop`` over the full chunks (``v0`` a traced int32 scalar) and a static
    remainder chunk (``v0`` a Python int)."""
    nfull, rem = divmod(lm_head.shape[1], block_v)
    if nfull:
        def body(i, c):
            v0 = (i * block_v).astype(jnp.int32)
            return step(c, jax.lax.dynamic_slice_in_dim(lm_head, v0, block_v, axis=1), v0, block_v)

        carry = jax.lax.fori_loop(0, nfull, body, carry)
    if rem:
        v0 = nfull * block_v
        carry = step(carry, lm_head[:, v0:], v0, rem)
    return carry


def chunked_backward(hidden, lm_head, block_v: int, dz_fn: Callable, cdt):
    """dh [N, H] and dW [H, V] from vocab chunks of ``block_v`` columns.

    ``dz_fn(v0, width)`` returns the gradient of ``h @ W[:, v0:v0+width]`` ([N, width], dtype ``cdt``),
    ``v0`` as in :func:`fold_vocab_chunks` (so only one chunk is live at a time); dh accumulates in
    float32, dW is written chunk by chunk.
    """
    n, h = hidden.shape
    v = lm_head.shape[1]
    hid = hidden.astype(cdt)

    def chunk(carry, w_chunk, v0, width):
        dh, dw = carry
        dz = dz_fn(v0, width).astype(cdt)
        dh = dh + dot_f32(dz, w_chunk, cdt, (((1,), (1,)), ((), ())))
        dw_c = dot_f32(hid, dz, cdt, (((0,), (0,)), ((), ()))).astype(lm_head.dtype)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, dw_c, v0, axis=1)
        return dh, dw

    zeros = (jnp.zeros((n, h), jnp.float32), jnp.zeros((h, v), lm_head.dtype))
    dh, dw = fold_vocab_chunks(lm_head, block_v, chunk, zeros)
    return dh.astype(hidden.dtype), dw
