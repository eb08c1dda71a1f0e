"""Triton kernels for the fused logprobs (no JAX here: ``triton.py`` calls them through jax-triton; the
CPU tests run them under Triton's interpreter with torch tensors).

* :func:`lp_fwd_kernel` -- a GEMM ``h [N, H] @ W [H, V]`` whose epilogue folds each ``[BLOCK_N,
  BLOCK_V]`` logits tile into an online logsumexp instead of storing it. The vocab is split into
  ``NUM_SPLITS`` contiguous ranges; program ``(n-block, split)`` walks its range tile by tile and
  writes float32 partials ``m`` (running max), ``s`` (sum of exp(l - m)), ``t`` (sum of exp(l - m) * l,
  for the entropy) and ``tg`` (the target's logit when it lies in the range) at ``[split, row]``; the
  caller merges the splits. Programs are ordered split-fastest so that the ~SM-count programs in
  flight share a few ``h`` blocks and W tiles through L2. With ``SAVE`` it also stores, for the
  backward, each tile's ``exp(l - m)`` (``m`` = the row's running max after that tile) in ``e`` [N, V]
  and that ``m`` in ``mt`` [N, cdiv(V, BLOCK_V)]; ``p = e * exp(mt - lse)`` and ``l = mt + log(e)``
  then recover probabilities and logits without a second matmul (see ``triton.py``).
* :func:`lp_bwd_dz_kernel` -- the same GEMM over one vocab chunk ``[v_off, v_off + CV)``, whose
  epilogue turns the logits tile into the gradient of ``h @ W`` (see ``_common.py``) and stores it in
  the compute dtype; the caller multiplies it into dh and dW with ordinary (cuBLAS) matmuls.

``UPCAST``: load bf16/f16 and multiply in exact float32 (the ``lm_head_f32`` flag, or mixed input
dtypes). Rows past the end are clamped on load (never stored); columns past the end are masked. Shapes are
``tl.constexpr`` (see the note in ``moe/triton_kernels.py``: jax-triton passes integers without
divisibility hints, which would cost the pipelined 16-byte loads).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _logits_tile(h_ptr, w_ptr, rows_ld, cols, H: tl.constexpr, V: tl.constexpr, inv_temp,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_H: tl.constexpr, UPCAST: tl.constexpr):
    # Columns past V are masked, not clamped (a clamp would cost the vectorized, pipelined loads).
    ks = tl.arange(0, BLOCK_K)
    vmask = cols < V
    a_ptrs = h_ptr + rows_ld[:, None] * H + ks[None, :]
    b_ptrs = w_ptr + ks[:, None].to(tl.int64) * V + cols[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if EVEN_H:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs, mask=vmask[None, :], other=0.0)
        else:
            kmask = (k0 + ks) < H
            a = tl.load(a_ptrs, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=kmask[:, None] & vmask[None, :], other=0.0)
        if UPCAST:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * V
    return acc * inv_temp


@triton.jit
def lp_fwd_kernel(
    h_ptr, w_ptr, tgt_ptr, inv_temp_ptr, m_ptr, s_ptr, t_ptr, tg_ptr, e_ptr, mt_ptr,
    N: tl.constexpr, H: tl.constexpr, V: tl.constexpr, v_per_split: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, NUM_SPLITS: tl.constexpr,
    WITH_ENT: tl.constexpr, UPCAST: tl.constexpr, EVEN_H: tl.constexpr, SAVE: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_n = pid // NUM_SPLITS
    split = pid % NUM_SPLITS
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ld = tl.minimum(rows, N - 1).to(tl.int64)
    tgt = tl.load(tgt_ptr + rows_ld)
    inv_temp = tl.load(inv_temp_ptr)
    v_lo = split * v_per_split
    v_hi = tl.minimum(v_lo + v_per_split, V)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    tg = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        cmask = cols < v_hi
        l = _logits_tile(h_ptr, w_ptr, rows_ld, cols, H, V, inv_temp,
                         BLOCK_N, BLOCK_V, BLOCK_K, EVEN_H, UPCAST)
        l = tl.where(cmask[None, :], l, float("-inf"))
        m_new = tl.maximum(m, tl.max(l, axis=1))
        alpha = tl.exp(m - m_new)
        e = tl.exp(l - m_new[:, None])
        s = s * alpha + tl.sum(e, axis=1)
        if WITH_ENT:
            t = t * alpha + tl.sum(tl.where(cmask[None, :], e * l, 0.0), axis=1)
        hit = (cols[None, :] == tgt[:, None]) & cmask[None, :]
        tg += tl.sum(tl.where(hit, l, 0.0), axis=1)
        m = m_new
        if SAVE:
            rmask_t = rows < N
            row64 = rows.to(tl.int64)
            tl.store(e_ptr + row64[:, None] * V + cols[None, :], e.to(e_ptr.dtype.element_ty),
                     mask=rmask_t[:, None] & cmask[None, :])
            tl.store(mt_ptr + row64 * tl.cdiv(V, BLOCK_V) + v0 // BLOCK_V, m_new, mask=rmask_t)
    out = split * N + rows
    rmask = rows < N
    tl.store(m_ptr + out, m, mask=rmask)
    tl.store(s_ptr + out, s, mask=rmask)
    tl.store(t_ptr + out, t, mask=rmask)
    tl.store(tg_ptr + out, tg, mask=rmask)


@triton.jit
def lp_bwd_dz_kernel(
    h_ptr, w_ptr, tgt_ptr, inv_temp_ptr, voff_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, dz_ptr,
    N: tl.constexpr, H: tl.constexpr, V: tl.constexpr, CV: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    WITH_ENT: tl.constexpr, UPCAST: tl.constexpr, EVEN_H: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    num_v = tl.cdiv(CV, BLOCK_V)
    # Grouped ordering (as in Triton's matmul tutorial) for L2 reuse.
    per_group = GROUP_N * num_v
    group_id = pid // per_group
    first_n = group_id * GROUP_N
    group_size = tl.minimum(num_n - first_n, GROUP_N)
    pid_n = first_n + ((pid % per_group) % group_size)
    pid_v = (pid % per_group) // group_size

    v_off = tl.multiple_of(tl.load(voff_ptr), 16)  # chunk starts are multiples of 16 (checked by the caller)
    inv_temp = tl.load(inv_temp_ptr)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_ld = tl.minimum(rows, N - 1).to(tl.int64)
    cl = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    cols = v_off + cl
    cmask = (cl < CV) & (cols < V)
    l = _logits_tile(h_ptr, w_ptr, rows_ld, cols, H, V, inv_temp,
                     BLOCK_N, BLOCK_V, BLOCK_K, EVEN_H, UPCAST)
    tgt = tl.load(tgt_ptr + rows_ld)
    lse = tl.load(lse_ptr + rows_ld)
    glp = tl.load(glp_ptr + rows_ld)
    p = tl.exp(l - lse[:, None])
    d = tl.where(cols[None, :] == tgt[:, None], glp[:, None], 0.0) - glp[:, None] * p
    if WITH_ENT:
        ent = tl.load(ent_ptr + rows_ld)
        gent = tl.load(gent_ptr + rows_ld)
        d = d - gent[:, None] * p * (l - lse[:, None] + ent[:, None])
    dz = tl.where(cmask[None, :], d * inv_temp, 0.0)
    mask = (rows < N)[:, None] & (cl < CV)[None, :]
    tl.store(dz_ptr + rows.to(tl.int64)[:, None] * CV + cl[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
