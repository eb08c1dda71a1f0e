"""GPU fused logprobs: Triton kernels (``triton_kernels.py``) called through jax-triton.

Forward: one fused GEMM + online-logsumexp kernel (no logits in memory at all), split over vocab
ranges and merged in JAX. Backward (custom VJP): a loop over vocab chunks; per chunk either a Triton
kernel recomputes the logits tile and writes the logits gradient ``dz`` straight away
(``bwd="triton"``) or XLA does it (``bwd="xla"``), then two cuBLAS matmuls add ``dz @ W_c^T`` into dh
and write ``h^T @ dz`` into dW. Memory: one ``[N, chunk]`` dz in the compute dtype, never ``[N, V]``.

The recompute is a fourth matmul of the size of ``h @ W``, so this path costs at least 4/3 of the
plain matmul's forward + backward. ``Config(save_probs=True)`` trades memory for that matmul: the
differentiated forward also stores ``exp(l - m)`` per tile in the compute dtype ([N, V], e.g.
N * V * 2 bytes in bf16, the size of the bf16 logits a plain ``h @ W`` writes) with the running max
``m`` per (row, tile), and the backward turns them into ``dz`` elementwise (``bwd`` is then unused;
``impl="triton_saveprobs"`` in ``api.token_logprobs`` selects this mode). Storing
``exp(l - m)`` rather than ``l`` keeps the relative error of every probability at the storage
dtype's rounding (bf16: 2^-9), whatever the size of the logits.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import jax_triton as jt

from jrl.kernels.logprobs import triton_kernels as K
from jrl.kernels.logprobs._common import (Flags, chunked_backward, combine_partials, compute_dtype, default_block_v,
                                          dz_from_saved, recompute_dz)


@dataclasses.dataclass(frozen=True)
class Config:
    """Tiles. fwd_*: the fused forward; bwd_*: the dz kernel; chunk_v: vocab columns per backward chunk
    (0 = about 512 MiB of float32 per chunk; with save_probs, 4x wider); num_splits: vocab ranges of the
    forward (0 = auto); save_probs: keep ``exp(l - m)`` ([N, V], compute dtype) from the forward so that
    the backward needs no logits recompute (faster, N * V * itemsize more memory; see the module
    docstring)."""

    fwd_block_n: int = 128
    fwd_block_v: int = 256
    fwd_block_k: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    num_splits: int = 0
    bwd_block_n: int = 128
    bwd_block_v: int = 256
    bwd_block_k: int = 64
    bwd_warps: int = 8
    bwd_stages: int = 3
    bwd_group_n: int = 8
    chunk_v: int = 0
    bwd: str = "triton"  # "triton" | "xla" (unused with save_probs)
    save_probs: bool = False


DEFAULT_CONFIG = Config()


def unavailable_reason() -> str | None:
    if not any(d.platform == "gpu" for d in jax.devices()):
        return "needs a GPU"
    return None


def _upcast(hidden, lm_head, flags: Flags) -> bool:
    return bool(flags.lm_head_f32 or hidden.dtype != lm_head.dtype or hidden.dtype == jnp.float32)


def _k_block(bk: int, h: int, hidden, lm_head) -> int:
    bk = min(bk, max(16, 1 << (h - 1).bit_length()))
    if max(hidden.dtype.itemsize, lm_head.dtype.itemsize) >= 4:  # fp32 tiles: fit the smem pipeline
        bk = min(bk, 32)
    return bk


def _num_splits(n_blocks: int, v_tiles: int, cfg: Config) -> int:
    if cfg.num_splits:
        return max(1, min(cfg.num_splits, v_tiles))
    # About 6 waves on a 132-SM H100/H200 (the sweep's best at N=16384: 6 ranges x 128 row blocks), and
    # few vocab ranges so that the programs in flight share W tiles through L2.
    want = max(1, round(132 * 6 / n_blocks))
    return max(1, min(want, 16, v_tiles))


def _forward(hidden, lm_head, targets, inv_temp, flags: Flags, cfg: Config, save: bool = False):
    """(logp, ent, lse, saved): saved is (e [N, V], mt [N, v_tiles]) with ``save``, else None."""
    n, h = hidden.shape
    v = lm_head.shape[1]
    bn, bv, bk = cfg.fwd_block_n, cfg.fwd_block_v, _k_block(cfg.fwd_block_k, h, hidden, lm_head)
    n_blocks = -(-n // bn)
    v_tiles = -(-v // bv)
    splits = _num_splits(n_blocks, v_tiles, cfg)
    v_per_split = -(-v_tiles // splits) * bv
    part = jax.ShapeDtypeStruct((splits, n), jnp.float32)
    if save:
        cdt = compute_dtype(hidden.dtype, lm_head.dtype, flags.lm_head_f32)
        saved = (jax.ShapeDtypeStruct((n, v), cdt), jax.ShapeDtypeStruct((n, v_tiles), jnp.float32))
    else:  # the kernel's e/mt outputs are never written: one-element placeholders
        saved = (jax.ShapeDtypeStruct((1,), jnp.float32),) * 2

    @jax.custom_batching.sequential_vmap  # jax-triton has no batching rule: vmap loops over the batch
    def run(hidden, lm_head, targets, inv_temp):
        return jt.triton_call(
            hidden, lm_head, targets, inv_temp.reshape(1),
            kernel=K.lp_fwd_kernel,
            out_shape=(part, part, part, part, *saved),
            grid=(n_blocks * splits,),
            num_warps=cfg.fwd_warps, num_stages=cfg.fwd_stages,
            N=n, H=h, V=v, v_per_split=v_per_split,
            BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, NUM_SPLITS=splits,
            WITH_ENT=flags.with_entropy, UPCAST=_upcast(hidden, lm_head, flags), EVEN_H=(h % bk == 0),
            SAVE=save,
        )

    m, s, t, tg, e, mt = run(hidden, lm_head, targets, inv_temp)
    lse, logp, ent = combine_partials(m, s, t, tg)
    if not flags.with_entropy:
        ent = jnp.zeros_like(lse)
    return logp, ent, lse, ((e, mt) if save else None)


def _dz_triton(hidden, lm_head, targets, inv_temp, lse, ent, g_lp, g_ent, flags, cfg, cdt, v0, width):
    n, h = hidden.shape
    v = lm_head.shape[1]
    bn, bv = cfg.bwd_block_n, min(cfg.bwd_block_v, max(16, 1 << (width - 1).bit_length()))
    bk = _k_block(cfg.bwd_block_k, h, hidden, lm_head)
    grid = (-(-n // bn) * -(-width // bv),)

    @jax.custom_batching.sequential_vmap  # jax-triton has no batching rule: vmap loops over the batch
    def run(hidden, lm_head, targets, inv_temp, v0, lse, ent, g_lp, g_ent):
        return jt.triton_call(
            hidden, lm_head, targets, inv_temp.reshape(1), v0.reshape(1),
            lse, ent, g_lp, g_ent,
            kernel=K.lp_bwd_dz_kernel,
            out_shape=jax.ShapeDtypeStruct((n, width), cdt),
            grid=grid,
            num_warps=cfg.bwd_warps, num_stages=cfg.bwd_stages,
            N=n, H=h, V=v, CV=width,
            BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, GROUP_N=cfg.bwd_group_n,
            WITH_ENT=flags.with_entropy, UPCAST=_upcast(hidden, lm_head, flags), EVEN_H=(h % bk == 0),
        )

    return run(hidden, lm_head, targets, inv_temp, jnp.asarray(v0, jnp.int32), lse, ent, g_lp, g_ent)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _fused(hidden, lm_head, targets, inv_temp, flags: Flags, cfg: Config):
    logp, ent, _, _ = _forward(hidden, lm_head, targets, inv_temp, flags, cfg)
    return logp, ent


def _fused_fwd(hidden, lm_head, targets, inv_temp, flags, cfg):
    logp, ent, lse, saved = _forward(hidden, lm_head, targets, inv_temp, flags, cfg, save=cfg.save_probs)
    return (logp, ent), (hidden, lm_head, targets, inv_temp, lse, ent, saved)


def _fused_bwd(flags, cfg, res, cts):
    hidden, lm_head, targets, inv_temp, lse, ent, saved = res
    g_lp, g_ent = (c.astype(jnp.float32) for c in cts)
    n = hidden.shape[0]
    v = lm_head.shape[1]
    cdt = compute_dtype(hidden.dtype, lm_head.dtype, flags.lm_head_f32)
    chunk = cfg.chunk_v or default_block_v(n, v)
    if chunk % 16:
        raise ValueError(f"Config.chunk_v must be a multiple of 16 (the dz kernel assumes aligned chunk starts), got {chunk}")
    if saved is not None:
        e, mt = saved
        if not cfg.chunk_v:
            # Wider chunks than the recompute path (whose chunk also holds float32 logits): fewer float32
            # read-modify-writes of dh; one bf16 [N, chunk] dz is about 512 MiB at the default.
            chunk = default_block_v(n, v, budget_bytes=2**31)
            chunk = -(-chunk // cfg.fwd_block_v) * cfg.fwd_block_v
        if chunk % cfg.fwd_block_v:
            raise ValueError(f"Config.chunk_v={chunk} must be a multiple of fwd_block_v={cfg.fwd_block_v} with "
                             "save_probs (chunks start on the forward's vocab tiles); pick a multiple or chunk_v=0")

        def dz_fn(v0, width):
            return dz_from_saved(e, mt, cfg.fwd_block_v, v0, width, targets, lse, ent, g_lp, g_ent, inv_temp,
                                 flags.with_entropy)
    elif cfg.bwd == "triton":
        def dz_fn(v0, width):
            return _dz_triton(hidden, lm_head, targets, inv_temp, lse, ent, g_lp, g_ent, flags, cfg, cdt, v0, width)
    elif cfg.bwd == "xla":
        hid = hidden.astype(cdt)

        def dz_fn(v0, width):
            return recompute_dz(hid, lm_head, v0, width, targets, lse, ent, g_lp, g_ent, inv_temp, cdt,
                                flags.with_entropy)
    else:
        raise ValueError(f"Config.bwd must be 'triton' or 'xla', got {cfg.bwd!r}")
    dh, dw = chunked_backward(hidden, lm_head, chunk, dz_fn, cdt)
    return dh, dw, None, jnp.zeros_like(inv_temp)


_fused.defvjp(_fused_fwd, _fused_bwd)


def token_logprobs(hidden, lm_head, targets, *, temperature=1.0, with_entropy=False, lm_head_f32=False,
                   config: Config | None = None):
    """Same contract as ``reference.token_logprobs``."""
    inv_temp = jax.lax.stop_gradient(jnp.asarray(1.0, jnp.float32) / jnp.asarray(temperature, jnp.float32))
    flags = Flags(with_entropy=with_entropy, lm_head_f32=lm_head_f32)
    logp, ent = _fused(hidden, lm_head, targets.astype(jnp.int32), inv_temp, flags, config or DEFAULT_CONFIG)
    return logp, (ent if with_entropy else None)
