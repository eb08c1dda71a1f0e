"""Portable fused logprobs: a loop over vocab tiles with an online logsumexp, and a custom VJP whose
backward recomputes each tile. Peak extra memory is one ``[N, block_v]`` float32 tile (plus dh in
float32), never ``[N, V]``. Runs on every backend; the CPU default and the GPU/TPU fallback.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jrl.kernels.logprobs._common import (NEG_INF, Flags, chunked_backward, compute_dtype, default_block_v,
                                          fold_vocab_chunks, recompute_dz, tile_logits)


def unavailable_reason() -> str | None:
    return None


def _forward(hidden, lm_head, targets, inv_temp, flags: Flags, block_v: int):
    n, _ = hidden.shape
    cdt = compute_dtype(hidden.dtype, lm_head.dtype, flags.lm_head_f32)
    hid = hidden.astype(cdt)

    def update(state, w_tile, v0, width):
        m, s, t, tg = state
        l = tile_logits(hid, w_tile, inv_temp, cdt)
        cols = v0 + jnp.arange(width, dtype=jnp.int32)
        m_new = jnp.maximum(m, jnp.max(l, axis=1))
        alpha = jnp.exp(m - m_new)
        e = jnp.exp(l - m_new[:, None])
        s = s * alpha + jnp.sum(e, axis=1)
        if flags.with_entropy:
            t = t * alpha + jnp.sum(e * l, axis=1)
        tg = tg + jnp.sum(jnp.where(cols[None, :] == targets[:, None], l, 0.0), axis=1)
        return m_new, s, t, tg

    z = jnp.zeros((n,), jnp.float32)
    m, s, t, tg = fold_vocab_chunks(lm_head, block_v, update, (jnp.full((n,), NEG_INF, jnp.float32), z, z, z))
    lse = m + jnp.log(s)
    logp = tg - lse
    ent = lse - t / s if flags.with_entropy else jnp.zeros_like(lse)
    return logp, ent, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(hidden, lm_head, targets, inv_temp, flags: Flags, block_v: int):
    logp, ent, _ = _forward(hidden, lm_head, targets, inv_temp, flags, block_v)
    return logp, ent


def _fused_fwd(hidden, lm_head, targets, inv_temp, flags, block_v):
    logp, ent, lse = _forward(hidden, lm_head, targets, inv_temp, flags, block_v)
    return (logp, ent), (hidden, lm_head, targets, inv_temp, lse, ent)


def _fused_bwd(flags, block_v, res, cts):
    hidden, lm_head, targets, inv_temp, lse, ent = res
    g_lp, g_ent = cts
    g_lp = g_lp.astype(jnp.float32)
    g_ent = g_ent.astype(jnp.float32)
    cdt = compute_dtype(hidden.dtype, lm_head.dtype, flags.lm_head_f32)
    hid = hidden.astype(cdt)

    def dz_fn(v0, width):
        return recompute_dz(hid, lm_head, v0, width, targets, lse, ent, g_lp, g_ent, inv_temp, cdt,
                            flags.with_entropy)

    dh, dw = chunked_backward(hidden, lm_head, block_v, dz_fn, cdt)
    return dh, dw, None, jnp.zeros_like(inv_temp)


_fused.defvjp(_fused_fwd, _fused_bwd)


def token_logprobs(hidden, lm_head, targets, *, temperature=1.0, with_entropy=False, lm_head_f32=False,
                   block_v: int | None = None):
    """Same contract as ``reference.token_logprobs``; ``block_v`` is the vocab tile (default: a float32
    ``[N, block_v]`` tile of about 512 MiB)."""
    n = hidden.shape[0]
    v = lm_head.shape[1]
    bv = block_v or default_block_v(n, v)
    inv_temp = jax.lax.stop_gradient(jnp.asarray(1.0, jnp.float32) / jnp.asarray(temperature, jnp.float32))
    flags = Flags(with_entropy=with_entropy, lm_head_f32=lm_head_f32)
    logp, ent = _fused(hidden, lm_head, targets.astype(jnp.int32), inv_temp, flags, int(bv))
    return logp, (ent if with_entropy else None)
