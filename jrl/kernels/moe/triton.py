"""GPU grouped matmul: Triton kernels (``triton_kernels.py``) called from JAX through jax-triton.

Three passes, each with its own tile sizes (:data:`DEFAULT_CONFIGS`):

* ``fwd``   ``out = gmm(lhs, rhs)``                          (gmm_kernel)
* ``dlhs``  ``dlhs = gmm(dout, rhs^T)``, rhs read transposed (gmm_kernel, swapped strides, no copy)
* ``tgmm``  ``drhs[g] = lhs_g^T @ dout_g``                    (tgmm_kernel)

float32 accumulation; bf16/f16 inputs use the tensor cores, float32 inputs use exact ("ieee") fp32
dots. Needs an NVIDIA GPU, Triton and jax_triton (0.3.1 with Triton 3.6 on JAX 0.11; see
``reference/environment.md``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import jax_triton as jt

from jrl.kernels.moe import triton_kernels as K
from jrl.kernels.moe.schedule import group_bounds, tile_schedule


@dataclasses.dataclass(frozen=True)
class GmmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4


@dataclasses.dataclass(frozen=True)
class TgmmConfig:
    block_k: int = 128
    block_n: int = 128
    block_t: int = 64
    num_warps: int = 4
    num_stages: int = 4


@dataclasses.dataclass(frozen=True)
class Configs:
    """Tile sizes per pass."""

    fwd: GmmConfig = GmmConfig()
    dlhs: GmmConfig = GmmConfig()
    tgmm: TgmmConfig = TgmmConfig()


# Chosen by ``benchmarks/kernels_gmm.py --sweep`` on an H200 (T=32768, K=2048, N=1024, bf16, E in
# {8, 64, 128}; tables in benchmarks/RESULTS.md). fwd and dlhs: 128x256x64 tiles, 8 warps, 4 stages won
# or tied for every E. tgmm: wide 128x256 output tiles win for big groups (E=8, ~4096 rows each), the
# 128x128 / 4-warp tile for small ones (E=64 and 128, 256-512 rows each).
_GMM = GmmConfig(128, 256, 64, num_warps=8, num_stages=4)
_TGMM_BIG_GROUPS = TgmmConfig(128, 256, 32, num_warps=8, num_stages=4)
_TGMM_SMALL_GROUPS = TgmmConfig(128, 128, 32, num_warps=4, num_stages=4)
DEFAULT_CONFIGS = Configs(fwd=_GMM, dlhs=_GMM, tgmm=_TGMM_SMALL_GROUPS)


def default_configs(num_rows: int, num_groups: int) -> Configs:
    """The tile table: per pass, by the mean rows per group."""
    big = num_rows >= 2048 * max(num_groups, 1)
    return Configs(fwd=_GMM, dlhs=_GMM, tgmm=_TGMM_BIG_GROUPS if big else _TGMM_SMALL_GROUPS)


def unavailable_reason() -> str | None:
    if not any(d.platform == "gpu" for d in jax.devices()):
        return "needs a GPU"
    return None


def _pow2_at_least(x: int, lo: int = 16) -> int:
    p = lo
    while p < x:
        p *= 2
    return p


def _fit(block: int, dim: int) -> int:
    """Shrink a block size to the problem (never below 16, the smallest tl.dot tile)."""
    return min(block, _pow2_at_least(dim))


def gmm_call(lhs, rhs, group_sizes, *, transpose_rhs: bool, out_dtype, cfg: GmmConfig,
             fill_past_groups: bool = True):
    """One launch of gmm_kernel: ``lhs [T, Kin] x rhs -> [T, Nout]`` (rhs [E, Kin, Nout], or [E, Nout, Kin]
    read transposed); the rows past the groups zeros, or unwritten without ``fill_past_groups``."""
    t, kin = lhs.shape
    e = rhs.shape[0]
    if transpose_rhs:
        nout = rhs.shape[1]
        stride_rk, stride_rn = 1, kin
    else:
        nout = rhs.shape[2]
        stride_rk, stride_rn = nout, 1
    if t == 0 or nout == 0 or kin == 0:
        return jnp.zeros((t, nout), out_dtype)
    bm = cfg.block_m
    bn = _fit(cfg.block_n, nout)
    bk = _fit(cfg.block_k, kin)
    stages = cfg.num_stages
    if lhs.dtype.itemsize >= 4:  # fp32 tiles: keep the pipelined shared-memory buffers within 227 KB
        bk, stages = min(bk, 32), min(stages, 3)
    num_tiles = -(-t // bm) + e
    grid = (num_tiles * (-(-nout // bn)),)

    @jax.custom_batching.sequential_vmap  # jax-triton has no batching rule: vmap loops over the batch
    def run(lhs, rhs, group_sizes):
        tile_group, row_start, row_end = tile_schedule(group_sizes, t, bm)
        return jt.triton_call(
            lhs, rhs, tile_group, row_start, row_end,
            kernel=K.gmm_kernel,
            out_shape=jax.ShapeDtypeStruct((t, nout), out_dtype),
            grid=grid,
            num_warps=cfg.num_warps,
            num_stages=stages,
            T=t, KDIM=kin, NDIM=nout, num_groups=e, stride_re=rhs.shape[1] * rhs.shape[2],
            stride_rk=stride_rk, stride_rn=stride_rn,
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            EVEN_K=(kin % bk == 0),
            IEEE=(lhs.dtype == jnp.float32),
            FILL=fill_past_groups,
        )

    return run(lhs, rhs, group_sizes)


def tgmm_call(lhs, dout, group_sizes, *, out_dtype, cfg: TgmmConfig):
    """One launch of tgmm_kernel: ``out[g] = lhs_g^T @ dout_g``, [E, K, N]."""
    t, kdim = lhs.shape
    ndim = dout.shape[1]
    e = group_sizes.shape[0]
    if t == 0 or kdim == 0 or ndim == 0:
        return jnp.zeros((e, kdim, ndim), out_dtype)
    bk = _fit(cfg.block_k, kdim)
    bn = _fit(cfg.block_n, ndim)
    bt, stages = cfg.block_t, cfg.num_stages
    if lhs.dtype.itemsize >= 4:
        bt, stages = min(bt, 32), min(stages, 3)
    grid = (e * (-(-kdim // bk)) * (-(-ndim // bn)),)

    @jax.custom_batching.sequential_vmap  # jax-triton has no batching rule: vmap loops over the batch
    def run(lhs, dout, group_sizes):
        starts, ends = group_bounds(group_sizes, t)
        return jt.triton_call(
            lhs, dout, starts, ends,
            kernel=K.tgmm_kernel,
            out_shape=jax.ShapeDtypeStruct((e, kdim, ndim), out_dtype),
            grid=grid,
            num_warps=cfg.num_warps,
            num_stages=stages,
            KDIM=kdim, NDIM=ndim,
            BLOCK_K=bk, BLOCK_N=bn, BLOCK_T=bt,
            IEEE=(lhs.dtype == jnp.float32),
        )

    return run(lhs, dout, group_sizes)


def differentiable_gmm(call):
    """The public ``gmm`` (same contract as ``reference.gmm``, differentiable wrt ``lhs`` and ``rhs``) for a forward
    pass and input gradient computed by ``call(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, cfgs,
    fill_past_groups)``; the weight gradient is :func:`tgmm_call`. ``configs`` are the Triton tiles
    (``default_configs`` when None). ``fill_past_groups=False`` leaves the rows past the groups unwritten in the
    output and in the input gradient."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
    def _gmm(lhs, rhs, group_sizes, out_dtype, cfgs: Configs, fill: bool):
        return call(lhs, rhs, group_sizes, transpose_rhs=False, out_dtype=out_dtype, cfgs=cfgs,
                    fill_past_groups=fill)

    def _gmm_fwd(lhs, rhs, group_sizes, out_dtype, cfgs, fill):
        return _gmm(lhs, rhs, group_sizes, out_dtype, cfgs, fill), (lhs, rhs, group_sizes)

    def _gmm_bwd(out_dtype, cfgs, fill, res, g):
        lhs, rhs, group_sizes = res
        g = g.astype(lhs.dtype)
        dlhs = call(g, rhs, group_sizes, transpose_rhs=True, out_dtype=lhs.dtype, cfgs=cfgs, fill_past_groups=fill)
        drhs = tgmm_call(lhs, g, group_sizes, out_dtype=rhs.dtype, cfg=cfgs.tgmm)
        return dlhs, drhs, None

    _gmm.defvjp(_gmm_fwd, _gmm_bwd)

    def gmm(lhs, rhs, group_sizes, *, preferred_element_type=None, configs: Configs | None = None,
            fill_past_groups: bool = True):
        cdt = jnp.promote_types(lhs.dtype, rhs.dtype)
        out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
        cfgs = configs or default_configs(lhs.shape[0], rhs.shape[0])
        return _gmm(lhs.astype(cdt), rhs.astype(cdt), group_sizes.astype(jnp.int32), out_dtype, cfgs,
                    bool(fill_past_groups))

    return gmm


def configured_gmm_call(lhs, rhs, group_sizes, *, transpose_rhs, out_dtype, cfgs: Configs,
                        fill_past_groups: bool = True):
    """:func:`gmm_call` with the tiles ``cfgs`` hold for the pass (forward, or the transposed input gradient)."""
    return gmm_call(lhs, rhs, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                    cfg=cfgs.dlhs if transpose_rhs else cfgs.fwd, fill_past_groups=fill_past_groups)


gmm = differentiable_gmm(configured_gmm_call)
gmm.__doc__ = "Grouped matmul (same contract as ``reference.gmm``), differentiable wrt ``lhs`` and ``rhs``."


def tgmm(lhs, dout, group_sizes, *, preferred_element_type=None, configs: Configs | None = None):
    """``out[g] = lhs_g^T @ dout_g`` ([E, K, N]); not differentiable (it is itself a gradient)."""
    cdt = jnp.promote_types(lhs.dtype, dout.dtype)
    out_dtype = jnp.dtype(preferred_element_type or lhs.dtype)
    return tgmm_call(lhs.astype(cdt), dout.astype(cdt), group_sizes.astype(jnp.int32), out_dtype=out_dtype,
                     cfg=(configs or default_configs(lhs.shape[0], group_sizes.shape[0])).tgmm)
