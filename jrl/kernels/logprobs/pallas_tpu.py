"""TPU fused logprobs in Pallas (Mosaic): three kernels, none of which stores logits.

* forward, grid (row blocks, vocab tiles), vocab innermost ("arbitrary"): a ``[block_n, H] x [H,
  block_v]`` logits tile per step folded into VMEM scratch (running max, sum of exp, entropy sum,
  target logit); logprob / entropy / logsumexp written at the last vocab tile.
* dh, grid (row blocks, vocab tiles): recompute the tile, form dz (see ``_common.py``) and accumulate
  ``dz @ W_tile^T`` into a float32 ``[block_n, H]`` scratch.
* dW, grid (vocab tiles, row blocks), rows innermost: recompute, form dz and accumulate
  ``h^T @ dz`` into a float32 ``[H, block_v]`` scratch.

Rows are zero-padded to the row block in the wrapper (outside the custom VJP, so padding gets zero
cotangents); the last vocab tile may run past V and its columns are masked in-kernel (logits -> -inf,
dz -> 0, W columns -> 0), so W is never copied. Temperature must be a Python number (it is baked into
the kernel). Off TPU the kernels run in interpret mode (tests).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jrl.kernels.logprobs._common import Flags, compute_dtype


@dataclasses.dataclass(frozen=True)
class Config:
    """Tile sizes per kernel (rows, vocab) and the scoped-VMEM limit. block_n must be a multiple of 8
    and block_v of 128 on real TPUs."""

    fwd: tuple[int, int] = (256, 512)
    dh: tuple[int, int] = (256, 512)
    dw: tuple[int, int] = (256, 256)
    vmem_limit_bytes: int = 48 * 2**20


DEFAULT_CONFIG = Config()


def unavailable_reason() -> str | None:
    return None


def _params(sem, cfg: Config):
    return pltpu.CompilerParams(dimension_semantics=sem, vmem_limit_bytes=cfg.vmem_limit_bytes)


def _logits(h_ref, w_ref, inv_temp, cdt):
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(cdt) == jnp.float32 else None
    return jnp.dot(h_ref[...].astype(cdt), w_ref[...].astype(cdt), precision=precision,
                   preferred_element_type=jnp.float32) * inv_temp


def _cols(j, bn, bv):
    return j * bv + jax.lax.broadcasted_iota(jnp.int32, (bn, bv), 1)


def _fwd_kernel(h_ref, w_ref, t_ref, lse_ref, lp_ref, ent_ref, m_sc, s_sc, e_sc, g_sc, *,
                inv_temp, v, bv, nv, with_entropy, cdt):
    j = pl.program_id(1)
    bn = h_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, jnp.float32)
        s_sc[...] = jnp.zeros(s_sc.shape, jnp.float32)
        e_sc[...] = jnp.zeros(e_sc.shape, jnp.float32)
        g_sc[...] = jnp.zeros(g_sc.shape, jnp.float32)

    cols = _cols(j, bn, bv)
    valid = cols < v
    l = jnp.where(valid, _logits(h_ref, w_ref, inv_temp, cdt), -jnp.inf)
    m_old = m_sc[...]
    m_new = jnp.maximum(m_old, jnp.max(l, axis=1, keepdims=True))
    alpha = jnp.exp(m_old - m_new)
    e = jnp.exp(l - m_new)
    s_sc[...] = s_sc[...] * alpha + jnp.sum(e, axis=1, keepdims=True)
    if with_entropy:
        e_sc[...] = e_sc[...] * alpha + jnp.sum(jnp.where(valid, e * l, 0.0), axis=1, keepdims=True)
    g_sc[...] += jnp.sum(jnp.where(cols == t_ref[...], l, 0.0), axis=1, keepdims=True)
    m_sc[...] = m_new

    @pl.when(j == nv - 1)
    def _done():
        lse = m_sc[...] + jnp.log(s_sc[...])
        lse_ref[...] = lse
        lp_ref[...] = g_sc[...] - lse
        ent_ref[...] = lse - e_sc[...] / s_sc[...] if with_entropy else jnp.zeros_like(lse)


def _dz(h_ref, w_ref, t_ref, lse_ref, ent_ref, glp_ref, gent_ref, cols, *, inv_temp, v, with_entropy, cdt):
    valid = cols < v
    l = _logits(h_ref, w_ref, inv_temp, cdt)
    lse = lse_ref[...]
    glp = glp_ref[...]
    p = jnp.exp(l - lse)
    d = jnp.where(cols == t_ref[...], glp, 0.0) - glp * p
    if with_entropy:
        d = d - gent_ref[...] * p * (l - lse + ent_ref[...])
    return jnp.where(valid, d * inv_temp, 0.0).astype(cdt)


def _w_masked(w_ref, j, bv, v, cdt):
    w = w_ref[...].astype(cdt)
    if v % bv:
        cols = j * bv + jax.lax.broadcasted_iota(jnp.int32, w.shape, 1)
        w = jnp.where(cols < v, w, jnp.zeros((), cdt))
    return w


def _dh_kernel(h_ref, w_ref, t_ref, lse_ref, ent_ref, glp_ref, gent_ref, dh_ref, acc, *,
               inv_temp, v, bv, nv, with_entropy, cdt):
    j = pl.program_id(1)
    bn = h_ref.shape[0]

    @pl.when(j == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    dz = _dz(h_ref, w_ref, t_ref, lse_ref, ent_ref, glp_ref, gent_ref, _cols(j, bn, bv),
             inv_temp=inv_temp, v=v, with_entropy=with_entropy, cdt=cdt)
    w = _w_masked(w_ref, j, bv, v, cdt)
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(cdt) == jnp.float32 else None
    acc[...] += jax.lax.dot_general(dz, w, (((1,), (1,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32)

    @pl.when(j == nv - 1)
    def _done():
        dh_ref[...] = acc[...].astype(dh_ref.dtype)


def _dw_kernel(h_ref, w_ref, t_ref, lse_ref, ent_ref, glp_ref, gent_ref, dw_ref, acc, *,
               inv_temp, v, bv, nb, with_entropy, cdt):
    j = pl.program_id(0)
    i = pl.program_id(1)
    bn = h_ref.shape[0]

    @pl.when(i == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    dz = _dz(h_ref, w_ref, t_ref, lse_ref, ent_ref, glp_ref, gent_ref, _cols(j, bn, bv),
             inv_temp=inv_temp, v=v, with_entropy=with_entropy, cdt=cdt)
    precision = jax.lax.Precision.HIGHEST if jnp.dtype(cdt) == jnp.float32 else None
    acc[...] += jax.lax.dot_general(h_ref[...].astype(cdt), dz, (((0,), (0,)), ((), ())), precision=precision,
                                    preferred_element_type=jnp.float32)

    @pl.when(i == nb - 1)
    def _done():
        dw_ref[...] = acc[...].astype(dw_ref.dtype)


def _row_spec(bn, swap=False):
    return pl.BlockSpec((bn, 1), (lambda j, i: (i, 0)) if swap else (lambda i, j: (i, 0)))


def _forward(hidden, lm_head, targets, flags: Flags, inv_temp: float, cfg: Config, interpret: bool):
    n, h = hidden.shape
    v = lm_head.shape[1]
    bn, bv = cfg.fwd
    bv = v if v <= bv else bv
    nb, nv = n // bn, -(-v // bv)
    cdt = compute_dtype(hidden.dtype, lm_head.dtype, flags.lm_head_f32)
    col = jax.ShapeDtypeStruct((n, 1), jnp.float32)
    kernel = functools.partial(_fwd_kernel, inv_temp=inv_temp, v=v, bv=bv, nv=nv,
                               with_entropy=flags.with_entropy, cdt=cdt)
    lse, lp, ent = pl.pallas_call(
        kernel,
        out_shape=(col, col, col),
        grid=(nb, nv),
        in_specs=[pl.BlockSpec((bn, h), lambda i, j: (i, 0)),
                  pl.BlockSpec((h, bv), lambda i, j: (0, j)),
                  _row_spec(bn)],
        out_specs=(_row_spec(bn), _row_spec(bn), _row_spec(bn)),
        scratch_shapes=[pltpu.VMEM((bn, 1), jnp.float32) for _ in range(4)],
        compiler_params=_params(("parallel", "arbitrary"), cfg),
        interpret=interpret,
    )(hidden, lm_head, targets[:, None])
    return lp[:, 0], ent[:, 0], lse[:, 0]


def _backward(hidden, lm_head, targets, lse, ent, g_lp, g_ent, flags, inv_temp, cfg, interpret):
    n, h = hidden.shape
    v = lm_head.shape[1]
    cdt = compute_dtype(hidden.dtype, lm_head.dtype, flags.lm_head_f32)
    rows = [targets[:, None], lse[:, None], ent[:, None], g_lp[:, None], g_ent[:, None]]

    def vfit(bv):
        return v if v <= bv else bv  # a block may equal the full dim; otherwise the edge tile is masked

    bn, bv = cfg.dh[0], vfit(cfg.dh[1])
    nb, nv = n // bn, -(-v // bv)
    kernel = functools.partial(_dh_kernel, inv_temp=inv_temp, v=v, bv=bv, nv=nv,
                               with_entropy=flags.with_entropy, cdt=cdt)
    dh = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((n, h), hidden.dtype),
        grid=(nb, nv),
        in_specs=[pl.BlockSpec((bn, h), lambda i, j: (i, 0)),
                  pl.BlockSpec((h, bv), lambda i, j: (0, j))] + [_row_spec(bn)] * 5,
        out_specs=pl.BlockSpec((bn, h), lambda i, j: (i, 0)),
        scratch_shapes=[pltpu.VMEM((bn, h), jnp.float32)],
        compiler_params=_params(("parallel", "arbitrary"), cfg),
        interpret=interpret,
    )(hidden, lm_head, *rows)

    bn, bv = cfg.dw[0], vfit(cfg.dw[1])
    nb, nv = n // bn, -(-v // bv)
    kernel = functools.partial(_dw_kernel, inv_temp=inv_temp, v=v, bv=bv, nb=nb,
                               with_entropy=flags.with_entropy, cdt=cdt)
    dw = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((h, v), lm_head.dtype),
        grid=(nv, nb),
        in_specs=[pl.BlockSpec((bn, h), lambda j, i: (i, 0)),
                  pl.BlockSpec((h, bv), lambda j, i: (0, j))] + [_row_spec(bn, swap=True)] * 5,
        out_specs=pl.BlockSpec((h, bv), lambda j, i: (0, j)),
        scratch_shapes=[pltpu.VMEM((h, bv), jnp.float32)],
        compiler_params=_params(("parallel", "arbitrary"), cfg),
        interpret=interpret,
    )(hidden, lm_head, *rows)
    return dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused(hidden, lm_head, targets, flags, inv_temp, cfg, interpret):
    lp, ent, _ = _forward(hidden, lm_head, targets, flags, inv_temp, cfg, interpret)
    return lp, ent


def _fused_fwd(hidden, lm_head, targets, flags, inv_temp, cfg, interpret):
    lp, ent, lse = _forward(hidden, lm_head, targets, flags, inv_temp, cfg, interpret)
    return (lp, ent), (hidden, lm_head, targets, lse, ent)


def _fused_bwd(flags, inv_temp, cfg, interpret, res, cts):
    hidden, lm_head, targets, lse, ent = res
    g_lp, g_ent = (c.astype(jnp.float32) for c in cts)
    dh, dw = _backward(hidden, lm_head, targets, lse, ent, g_lp, g_ent, flags, inv_temp, cfg, interpret)
    return dh, dw, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def token_logprobs(hidden, lm_head, targets, *, temperature=1.0, with_entropy=False, lm_head_f32=False,
                   config: Config | None = None, interpret: bool | None = None):
    """Same contract as ``reference.token_logprobs``; ``temperature`` must be a Python number."""
    cfg = config or DEFAULT_CONFIG
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    n = hidden.shape[0]
    bn = max(cfg.fwd[0], cfg.dh[0], cfg.dw[0])
    if any(bn % b for b in (cfg.fwd[0], cfg.dh[0], cfg.dw[0])):
        raise ValueError(f"pallas_tpu logprobs: row blocks {cfg.fwd[0]}, {cfg.dh[0]}, {cfg.dw[0]} must divide "
                         f"the largest one")
    n_pad = -(-max(n, 1) // bn) * bn
    hid = jnp.pad(hidden, ((0, n_pad - n), (0, 0))) if n_pad != n else hidden
    tgt = jnp.pad(targets.astype(jnp.int32), (0, n_pad - n)) if n_pad != n else targets.astype(jnp.int32)
    flags = Flags(with_entropy=with_entropy, lm_head_f32=lm_head_f32)
    lp, ent = _fused(hid, lm_head, tgt, flags, 1.0 / float(temperature), cfg, bool(interpret))
    return lp[:n], (ent[:n] if with_entropy else None)
