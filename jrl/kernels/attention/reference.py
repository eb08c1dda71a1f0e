"""Dense grouped-query attention: the whole ``[B, K, G, T, S]`` float32 score tensor at once (the truth)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.kernels.attention.mask import AttentionMask
from jrl.kernels.attention.rope import apply_rope

NEG_INF = float(jnp.finfo(jnp.float32).min)


def unavailable_reason() -> str | None:
    return None


def attend_dense(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, *, scale: float) -> jax.Array:
    """``q`` [B, T, N, D], ``k``/``v`` [B, S, K, D] (N % K == 0), ``allowed`` bool [B, T, S]. Scores and
    softmax in float32; a query with no allowed key gets a uniform average. Returns [B, T, N, D] in v's
    dtype."""
    b, t, n, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, n // kh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = jnp.where(allowed[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
    return out.reshape(b, t, n, d)


def attention(q, k, v, mask: AttentionMask, *, scale: float) -> jax.Array:
    return attend_dense(q, k, v, mask.dense(), scale=scale)


def decode_attention(q, k, v, allowed, *, scale: float) -> jax.Array:
    """One query per row: ``q`` [B, N, D] over ``k``/``v`` [B, S, K, D] where ``allowed`` [B, S]."""
    return attend_dense(q[:, None], k, v, allowed[:, None], scale=scale)[:, 0]


def rope_step(qkv, cos, sin, kv: int):
    """A decode step's ``qkv`` [B, N + 2K, D] split into its queries [B, N, D], keys and values [B, K, D], the
    queries and keys rotated by cos / sin [B, R]."""
    n = qkv.shape[1] - 2 * kv
    q, k_new, v_new = qkv[:, :n], qkv[:, n:n + kv], qkv[:, n + kv:]
    q = apply_rope(q[:, None], cos[:, None], sin[:, None])[:, 0]
    return q, apply_rope(k_new[:, None], cos[:, None], sin[:, None])[:, 0], v_new


def rope_and_write(qkv, cos, sin, k_cache, v_cache, index):
    """A decode step's work before its attention: of ``qkv`` [B, N + 2K, D], the queries q (the first N) and the
    step's keys k_new (the next K) rotated by cos / sin [B, R]; k_new (rotated) and the values v_new (the last
    K) stored at slot ``index`` of k_cache / v_cache [B, S, K, D]. Returns (q, k_cache, v_cache)."""
    q, k_new, v_new = rope_step(qkv, cos, sin, k_cache.shape[2])
    start = (0, index, 0, 0)
    k_cache = jax.lax.dynamic_update_slice(k_cache, k_new[:, None].astype(k_cache.dtype), start)
    v_cache = jax.lax.dynamic_update_slice(v_cache, v_new[:, None].astype(v_cache.dtype), start)
    return q, k_cache, v_cache


def decode_attention_append(qkv, cos, sin, k_cache, v_cache, allowed, index, *, scale: float):
    """A decode step's attention with its rope and cache write (:func:`rope_and_write`): q attends over the
    ``allowed`` [B, S] slots of the updated cache. Returns (output [B, N, D], k_cache, v_cache)."""
    q, k_cache, v_cache = rope_and_write(qkv, cos, sin, k_cache, v_cache, index)
    return decode_attention(q, k_cache, v_cache, allowed, scale=scale), k_cache, v_cache
