"""Portable blocked attention: an online softmax over key blocks for each query block, and a custom VJP
whose backward recomputes the scores block by block from the saved log-sum-exp (FlashAttention-2's
scheme written with ``lax.scan``). Peak extra memory is one ``[B, N, block_q, block_k]`` float32 tile,
never ``[B, N, T, S]``, so long sequences fit; blocks that the causal / sliding-window rule excludes
entirely are skipped. Runs on every backend: the fallback, and the CPU pick for long sequences.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jrl.kernels.attention.mask import AttentionMask

NEG_INF = float(jnp.finfo(jnp.float32).min)


def unavailable_reason() -> str | None:
    return None


def _pad_axis(x, axis: int, size: int, value=0):
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _pad_mask(mask: AttentionMask, t: int, s: int) -> AttentionMask:
    explicit = mask.explicit
    if explicit is not None:
        explicit = _pad_axis(_pad_axis(explicit, 1, t, False), 2, s, False)
    return dataclasses.replace(mask, q_segments=_pad_axis(mask.q_segments, 1, t),
                               kv_segments=_pad_axis(mask.kv_segments, 1, s), explicit=explicit)


def _block_needed(mask: AttentionMask, q0, bq: int, k0, bk: int):
    """False when the causal / window rule excludes every (query, key) pair of the block."""
    need = jnp.bool_(True)
    if mask.causal:
        need = need & (k0 <= q0 + bq - 1)
    if mask.sliding_window is not None:
        need = need & (q0 - (k0 + bk - 1) < mask.sliding_window)
    return need


def _scores(qb, kb, allowed, scale):
    """[B, K, G, bq, bk] float32 scores of a block, -inf-like where not allowed."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qb, kb, preferred_element_type=jnp.float32) * scale
    return jnp.where(allowed[:, None, None], s, NEG_INF)


def _forward(q, k, v, mask: AttentionMask, scale: float, bq: int, bk: int):
    """(out [B, Tp, K, G, D] in v's dtype, lse [B, K, G, Tp] float32) on padded, grouped inputs."""
    b, tp, kh, g, d = q.shape
    sp = k.shape[1]

    def one_q_block(qi):
        q0 = qi * bq
        qb = jax.lax.dynamic_slice_in_dim(q, q0, bq, axis=1)

        def kv_step(state, kj):
            k0 = kj * bk

            def compute(state):
                m, l, acc = state
                kb = jax.lax.dynamic_slice_in_dim(k, k0, bk, axis=1)
                vb = jax.lax.dynamic_slice_in_dim(v, k0, bk, axis=1)
                allowed = mask.block(q0, bq, k0, bk)
                s = _scores(qb, kb, allowed, scale)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                p = jnp.where(allowed[:, None, None], jnp.exp(s - m_new[..., None]), 0.0)
                alpha = jnp.exp(m - m_new)
                l = l * alpha + jnp.sum(p, axis=-1)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(v.dtype), vb, preferred_element_type=jnp.float32)
                return m_new, l, acc * alpha[..., None] + pv

            return jax.lax.cond(_block_needed(mask, q0, bq, k0, bk), compute, lambda st: st, state), None

        init = (jnp.full((b, kh, g, bq), NEG_INF, jnp.float32), jnp.zeros((b, kh, g, bq), jnp.float32),
                jnp.zeros((b, kh, g, bq, d), jnp.float32))
        (m, l, acc), _ = jax.lax.scan(kv_step, init, jnp.arange(sp // bk))
        has_key = l > 0
        out = jnp.where(has_key[..., None], acc / jnp.where(has_key, l, 1.0)[..., None], 0.0)
        lse = jnp.where(has_key, m + jnp.log(jnp.where(has_key, l, 1.0)), 0.0)
        return out, lse

    outs, lses = jax.lax.map(one_q_block, jnp.arange(tp // bq))  # [nq, B, K, G, bq, D], [nq, B, K, G, bq]
    out = jnp.transpose(outs, (1, 0, 4, 2, 3, 5)).reshape(b, tp, kh, g, d).astype(v.dtype)
    lse = jnp.transpose(lses, (1, 2, 3, 0, 4)).reshape(b, kh, g, tp)
    return out, lse


def _backward(q, k, v, mask: AttentionMask, out, lse, dout, scale: float, bq: int, bk: int):
    b, tp, kh, g, d = q.shape
    sp = k.shape[1]
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", dout.astype(jnp.float32), out.astype(jnp.float32))

    def one_kv_block(dq, kj):
        k0 = kj * bk
        kb = jax.lax.dynamic_slice_in_dim(k, k0, bk, axis=1)
        vb = jax.lax.dynamic_slice_in_dim(v, k0, bk, axis=1)

        def q_step(state, qi):
            q0 = qi * bq

            def compute(state):
                dk, dv = state
                qb = jax.lax.dynamic_slice_in_dim(q, q0, bq, axis=1)
                dob = jax.lax.dynamic_slice_in_dim(dout, q0, bq, axis=1)
                allowed = mask.block(q0, bq, k0, bk)
                s = _scores(qb, kb, allowed, scale)
                lse_b = jax.lax.dynamic_slice_in_dim(lse, q0, bq, axis=3)
                p = jnp.where(allowed[:, None, None], jnp.exp(s - lse_b[..., None]), 0.0)
                dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dob.dtype), dob,
                                     preferred_element_type=jnp.float32)
                dp = jnp.einsum("bqkgd,bskd->bkgqs", dob, vb, preferred_element_type=jnp.float32)
                ds = p * (dp - jax.lax.dynamic_slice_in_dim(delta, q0, bq, axis=3)[..., None])
                dsc = ds.astype(q.dtype)
                dq_b = jnp.einsum("bkgqs,bskd->bqkgd", dsc, kb, preferred_element_type=jnp.float32) * scale
                dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", dsc, qb, preferred_element_type=jnp.float32) * scale
                return (dk, dv), dq_b

            def skip(state):
                return state, jnp.zeros((b, bq, kh, g, d), jnp.float32)

            return jax.lax.cond(_block_needed(mask, q0, bq, k0, bk), compute, skip, state)

        zeros = jnp.zeros((b, bk, kh, d), jnp.float32)
        (dk, dv), dq_blocks = jax.lax.scan(q_step, (zeros, zeros), jnp.arange(tp // bq))
        dq = dq + jnp.transpose(dq_blocks, (1, 0, 2, 3, 4, 5)).reshape(b, tp, kh, g, d)
        return dq, (dk, dv)

    dq, (dks, dvs) = jax.lax.scan(one_kv_block, jnp.zeros((b, tp, kh, g, d), jnp.float32), jnp.arange(sp // bk))
    dk = jnp.transpose(dks, (1, 0, 2, 3, 4)).reshape(b, sp, kh, d)
    dv = jnp.transpose(dvs, (1, 0, 2, 3, 4)).reshape(b, sp, kh, d)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _blocked(q, k, v, mask, scale, bq, bk):
    return _forward(q, k, v, mask, scale, bq, bk)[0]


def _blocked_fwd(q, k, v, mask, scale, bq, bk):
    out, lse = _forward(q, k, v, mask, scale, bq, bk)
    return out, (q, k, v, mask, out, lse)


def _blocked_bwd(scale, bq, bk, res, dout):
    q, k, v, mask, out, lse = res
    dq, dk, dv = _backward(q, k, v, mask, out, lse, dout, scale, bq, bk)
    return dq, dk, dv, jax.tree.map(lambda _: None, mask)


_blocked.defvjp(_blocked_fwd, _blocked_bwd)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def attention(q, k, v, mask: AttentionMask, *, scale: float, block_q: int = 512, block_k: int = 512) -> jax.Array:
    """Same contract as ``reference.attention``; ``block_q`` / ``block_k`` are the tile sizes."""
    b, t, n, d = q.shape
    s, kh = k.shape[1], k.shape[2]
    bq, bk = min(block_q, t), min(block_k, s)
    tp, sp = _round_up(t, bq), _round_up(s, bk)
    qg = _pad_axis(q.reshape(b, t, kh, n // kh, d), 1, tp)
    out = _blocked(qg, _pad_axis(k, 1, sp), _pad_axis(v, 1, sp), _pad_mask(mask, tp, sp), float(scale), bq, bk)
    return out[:, :t].reshape(b, t, n, d)
