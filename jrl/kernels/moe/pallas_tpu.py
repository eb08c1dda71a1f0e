"""TPU grouped matmul: JAX's megablox Pallas/Mosaic kernels (``gmm`` / ``tgmm``) behind jrl's own custom
VJP, so that each pass (forward, input gradient, weight gradient) gets its own tile sizes.

megablox is the kernel MaxText uses on TPU; it ships in ``jax.experimental.pallas.ops.tpu.megablox``
(the same code in JAX 0.10.2 and 0.11.2). This wrapper adds what jrl's contract needs on top: any
row count (rows are padded to the m-tile), rows past ``sum(group_sizes)`` come back as zeros, tiles
clamped to small problems, and mixed input dtypes. Off TPU it runs in Pallas interpret mode (tests).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp

# The megablox package re-exports the custom-VJP ``gmm`` function under the module's own name, so
# fetch the kernel module itself (gmm/tgmm backends) from sys.modules.
_mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")


@dataclasses.dataclass(frozen=True)
class Configs:
    """(tm, tk, tn) per pass. megablox's tgmm takes its tiling as (tm, tk, tn) too."""

    fwd: tuple[int, int, int] = (512, 1024, 1024)
    dlhs: tuple[int, int, int] = (512, 1024, 1024)
    tgmm: tuple[int, int, int] = (512, 1024, 1024)


DEFAULT_CONFIGS = Configs()


def unavailable_reason() -> str | None:
    return None  # runs for real on TPU, in interpret mode elsewhere


def _tiling(tiling, m_pad, k, n):
    """Tiles no larger than needed: a dim smaller than its tile becomes one full-dim block (TPU block
    shapes must be multiples of (8, 128) or equal the array dim); larger dims keep the configured tile
    and megablox masks the ragged last k/n tile."""
    tm, tk, tn = tiling
    return (min(tm, m_pad), min(tk, k), min(tn, n))


def _round_up(x, m):
    return -(-x // m) * m


def _pad_rows(x, tm):
    t = x.shape[0]
    tp = _round_up(max(t, 1), tm)
    if tp == t:
        return x
    return jnp.pad(x, ((0, tp - t), (0, 0)))


def _row_tile(tm, t):
    """m-tile for ``t`` rows: the configured one, shrunk (to a multiple of 8) for small problems."""
    return min(tm, _round_up(max(t, 1), 8))


def _gmm_call(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, tiling, interpret):
    t, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if t == 0 or n == 0:
        return jnp.zeros((t, n), out_dtype)
    tm = _row_tile(tiling[0], t)
    lhs_p = _pad_rows(lhs, tm)
    tiles = _tiling((tm, tiling[1], tiling[2]), lhs_p.shape[0], k, n)
    out = _mb.gmm(lhs_p, rhs, group_sizes, preferred_element_type=out_dtype, tiling=tiles,
                  transpose_rhs=transpose_rhs, interpret=interpret)
    total = jnp.sum(group_sizes)
    rows = jnp.arange(lhs_p.shape[0], dtype=jnp.int32)[:, None]
    out = jnp.where(rows < total, out, jnp.zeros((), out.dtype))
    return out[:t]


def _tgmm_call(lhs, dout, group_sizes, *, out_dtype, tiling, interpret):
    t, k = lhs.shape
    n = dout.shape[1]
    e = group_sizes.shape[0]
    if t == 0 or k == 0 or n == 0:
        return jnp.zeros((e, k, n), out_dtype)
    tm = _row_tile(tiling[0], t)
    # Rows past sum(group_sizes) must not contribute: padded rows are zeros and megablox only visits
    # the groups' own rows, so no masking is needed beyond the padding.
    lhs_p = _pad_rows(lhs, tm)
    dout_p = _pad_rows(dout, tm)
    tiles = _tiling((tm, tiling[1], tiling[2]), lhs_p.shape[0], k, n)
    return _mb.tgmm(lhs_p.swapaxes(0, 1), dout_p, group_sizes, preferred_element_type=out_dtype, tiling=tiles,
                    interpret=interpret)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _gmm(lhs, rhs, group_sizes, out_dtype, cfgs: Configs, interpret: bool):
    return _gmm_call(lhs, rhs, group_sizes, transpose_rhs=False, out_dtype=out_dtype, tiling=cfgs.fwd,
                     interpret=interpret)


def _gmm_fwd(lhs, rhs, group_sizes, out_dtype, cfgs, interpret):
    return _gmm(lhs, rhs, group_sizes, out_dtype, cfgs, interpret), (lhs, rhs, group_sizes)


def _gmm_bwd(out_dtype, cfgs, interpret, res, g):
    lhs, rhs, group_sizes = res
    g = g.astype(lhs.dtype)
    dlhs = _gmm_call(g, rhs, group_sizes, transpose_rhs=True, out_dtype=lhs.dtype, tiling=cfgs.dlhs,
                     interpret=interpret)
    drhs = _tgmm_call(lhs, g, group_sizes, out_dtype=rhs.dtype, tiling=cfgs.tgmm, interpret=interpret)
    return dlhs, drhs, None


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def _interpret_default(interpret):
    return jax.default_backend() != "tpu" if interpret is None else interpret


def gmm(lhs, rhs, group_sizes, *, preferred_element_type=None, configs: Configs | None = None,
        interpret: bool | None = None, fill_past_groups: bool = True):
    """Grouped matmul (same contract as ``reference.gmm``; the rows past the groups always zeros here),
    differentiable wrt ``lhs`` and ``rhs``."""
    cdt = jnp.promote_types(lhs.dtype, rhs.dtype)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    return _gmm(lhs.astype(cdt), rhs.astype(cdt), group_sizes.astype(jnp.int32), out_dtype,
                configs or DEFAULT_CONFIGS, _interpret_default(interpret))


def tgmm(lhs, dout, group_sizes, *, preferred_element_type=None, configs: Configs | None = None,
         interpret: bool | None = None):
    """``out[g] = lhs_g^T @ dout_g`` ([E, K, N])."""
    cdt = jnp.promote_types(lhs.dtype, dout.dtype)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    return _tgmm_call(lhs.astype(cdt), dout.astype(cdt), group_sizes.astype(jnp.int32), out_dtype=out_dtype,
                      tiling=(configs or DEFAULT_CONFIGS).tgmm, interpret=_interpret_default(interpret))
