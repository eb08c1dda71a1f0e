"""Triton kernels for the MoE layer: the grouped matmul, and the row gather and SwiGLU that skip an expert-parallel
buffer's unused rows (no JAX here: ``triton.py`` and ``rows_triton.py`` call them through jax-triton, and the CPU
tests run them under Triton's interpreter with torch tensors).

Conventions: every array is row-major and contiguous; ``lhs`` rows are sorted by group. Shapes and
strides are compile-time constants (``tl.constexpr``): jax-triton does not specialize integer
arguments for divisibility, and without it Triton cannot prove 16-byte-aligned rows, so it falls back
to narrow, unpipelined loads (checked in the PTX: no ``cp.async``).

* :func:`gmm_kernel` -- ``out[rows of tile] = lhs[rows] @ B_g`` where ``B_g[k, n] = rhs[g*stride_re +
  k*stride_rk + n*stride_rn]``. With ``stride_rk = N, stride_rn = 1`` this is ``rhs[g]`` ([E, K, N]);
  with ``stride_rk = 1, stride_rn = K`` it is ``rhs[g].T`` (the input-gradient pass reads ``rhs``
  transposed in place). The launch is 1-D over (m-tile, n-tile) pairs, n fastest, so the
  ``BLOCK_M x K`` slab of ``lhs`` and group g's matrix are shared through L2 by neighbouring programs.
  The m-tiles come from a schedule (see ``triton.tile_schedule``): tile i covers rows
  ``[row_start[i], min(row_start[i] + BLOCK_M, row_end[i]))`` of group ``tile_group[i]``; group
  ``num_groups`` is the sentinel for rows past ``sum(group_sizes)`` (written as zeros, or left unwritten
  without ``FILL``) and -1 marks an unused slot of the (statically sized) schedule.
* :func:`tgmm_kernel` -- ``out[g] = lhs[rows of g].T @ dout[rows of g]`` ([E, K, N]), one program per
  (group, k-tile, n-tile), looping over the group's rows.
* :func:`take_rows_kernel`, :func:`swiglu_fwd_kernel`, :func:`swiglu_bwd_kernel` -- row-block x column-block
  programs that load only the rows in use (``rows.py``): the gather stores zeros for the others unless ``FILL`` is
  off, the SwiGLU passes leave them unwritten.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gmm_kernel(
    lhs_ptr, rhs_ptr, tile_group_ptr, tile_row_ptr, tile_end_ptr, out_ptr,
    T: tl.constexpr, KDIM: tl.constexpr, NDIM: tl.constexpr, num_groups: tl.constexpr,
    stride_re: tl.constexpr, stride_rk: tl.constexpr, stride_rn: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, FILL: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(NDIM, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    g = tl.load(tile_group_ptr + pid_m)
    if g >= 0 and (FILL or g < num_groups):
        row_start = tl.load(tile_row_ptr + pid_m)
        row_end = tl.load(tile_end_ptr + pid_m)
        rows = row_start + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if g < num_groups:
            ks = tl.arange(0, BLOCK_K)
            # Rows are clamped (every load in bounds; rows of a neighbouring group are computed but never
            # stored). Columns are masked, not clamped: a clamp hides the contiguity Triton needs for
            # 16-byte vector loads and cp.async pipelining.
            rows_ld = tl.minimum(rows, T - 1).to(tl.int64)
            nmask = cols < NDIM
            a_ptrs = lhs_ptr + rows_ld[:, None] * KDIM + ks[None, :]
            b_ptrs = rhs_ptr + g.to(tl.int64) * stride_re + ks[:, None] * stride_rk + cols[None, :] * stride_rn
            for k0 in range(0, KDIM, BLOCK_K):
                if EVEN_K:
                    a = tl.load(a_ptrs)
                    if NDIM % BLOCK_N == 0:
                        b = tl.load(b_ptrs)
                    else:
                        b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
                else:
                    kmask = (k0 + ks) < KDIM
                    a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
                    b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
                if IEEE:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K * stride_rk
        out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * NDIM + cols[None, :]
        mask = (rows < row_end)[:, None] & (cols < NDIM)[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def tgmm_kernel(
    lhs_ptr, dout_ptr, group_start_ptr, group_end_ptr, out_ptr,
    KDIM: tl.constexpr, NDIM: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    num_k = tl.cdiv(KDIM, BLOCK_K)
    num_n = tl.cdiv(NDIM, BLOCK_N)
    g = pid // (num_k * num_n)
    r = pid % (num_k * num_n)
    pid_k = r // num_n
    pid_n = r % num_n
    start = tl.load(group_start_ptr + g)
    end = tl.load(group_end_ptr + g)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kmask = ks < KDIM
    nmask = ns < NDIM
    ts = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + ts
        tmask = t < end
        t64 = t.to(tl.int64)
        a = tl.load(lhs_ptr + t64[:, None] * KDIM + ks[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(dout_ptr + t64[:, None] * NDIM + ns[None, :], mask=tmask[:, None] & nmask[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(a), b, acc)
    out_ptrs = out_ptr + g.to(tl.int64) * KDIM * NDIM + ks[:, None] * NDIM + ns[None, :]
    mask = kmask[:, None] & nmask[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def take_rows_kernel(
    src_ptr, index_ptr, scale_ptr, out_ptr,
    R: tl.constexpr, NSRC: tl.constexpr, H: tl.constexpr, K: tl.constexpr, HAS_SCALE: tl.constexpr,
    FILL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    """``out[r] = (scale[index[r]] *) src[index[r] // K]`` (``index >= 0``); where ``index[r] // K`` is past
    ``src``'s ``NSRC`` rows nothing is loaded, and zeros are stored with ``FILL`` (else the row is left unwritten)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rmask = rows < R
    idx = tl.load(index_ptr + rows, mask=rmask, other=0)
    src_row = idx // K
    live = rmask & (src_row < NSRC)
    cmask = cols < H
    vals = tl.load(src_ptr + src_row.to(tl.int64)[:, None] * H + cols[None, :],
                   mask=live[:, None] & cmask[None, :], other=0.0)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + idx, mask=live, other=0.0)
        vals = vals.to(tl.float32) * scale[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * H + cols[None, :], vals.to(out_ptr.dtype.element_ty),
             mask=(rmask if FILL else live)[:, None] & cmask[None, :])


@triton.jit
def _row_block(count_ptr, R: tl.constexpr, F: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    """This program's block of an [R, F] array: element offsets, and the mask of the block's elements inside the
    array on rows ``< count``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    live = (rows < R) & (rows < tl.load(count_ptr))
    return rows.to(tl.int64)[:, None] * F + cols[None, :], live[:, None] & (cols < F)[None, :]


@triton.jit
def swiglu_fwd_kernel(
    a_ptr, b_ptr, count_ptr, out_ptr, R: tl.constexpr, F: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """``out = silu(a) * b`` on rows ``< count`` (float32 inside); the other rows are neither read nor written."""
    offs, live = _row_block(count_ptr, R, F, BLOCK_R, BLOCK_F)
    a = tl.load(a_ptr + offs, mask=live, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=live, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (a / (1.0 + tl.exp(-a)) * b).to(out_ptr.dtype.element_ty), mask=live)


@triton.jit
def swiglu_bwd_kernel(
    a_ptr, b_ptr, g_ptr, count_ptr, da_ptr, db_ptr, R: tl.constexpr, F: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    """The gradients of :func:`swiglu_fwd_kernel` for ``g``: ``da = g b silu'(a)``, ``db = g silu(a)`` on rows
    ``< count``; the other rows are neither read nor written."""
    offs, live = _row_block(count_ptr, R, F, BLOCK_R, BLOCK_F)
    a = tl.load(a_ptr + offs, mask=live, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + offs, mask=live, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=live, other=0.0).to(tl.float32)
    sig = 1.0 / (1.0 + tl.exp(-a))
    tl.store(da_ptr + offs, (g * b * sig * (1.0 + a * (1.0 - sig))).to(da_ptr.dtype.element_ty), mask=live)
    tl.store(db_ptr + offs, (g * a * sig).to(db_ptr.dtype.element_ty), mask=live)
