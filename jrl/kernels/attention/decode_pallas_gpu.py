"""One-token decode attention over a KV cache as a Pallas (Triton backend) kernel for NVIDIA GPUs.

A decode step has one query per row and a cache of ``S`` slots of which only a prefix is filled (and, after
left padding, only a suffix of that prefix is real). The dense path reads all ``S`` slots of K and V and
runs five XLA kernels (two matmuls, max, sum, normalise). Here one program per (row, KV head) walks the
cache blocks between the row's first and last allowed slot with an online softmax in float32, so the
unfilled tail (and the padding head) of the cache is never read, the ``G = N / K`` query heads of a KV head
share each loaded block (no repeated KV), and the output is normalised in the same kernel.

Off GPU it runs in Pallas interpret mode (tests compare it with :func:`reference.decode_attention`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_MIN_ROWS = 16
"""Triton's matrix product needs at least 16 rows: a program loads 16 query rows from its KV head's first
(masked past the G = N / K heads of the group), so G is at most 16."""
_MASKED = -1e30
"""Score of a disallowed slot (finite, so a block with no allowed slot leaves the running max defined)."""


def unavailable_reason() -> str | None:
    return None  # compiled on an NVIDIA GPU, in interpret mode elsewhere


def _kernel(bounds_ref, q_ref, k_ref, v_ref, allowed_ref, o_ref, *, scale: float, block_k: int, slots: int,
            group: int):
    """One (row, KV head): q_ref / o_ref [N, D] (this row's heads; the program's ``group`` of them start at
    ``head * group``), k_ref / v_ref [S, D], allowed_ref [S] int8, bounds_ref [2] int32 = (first, last + 1)
    allowed slot of this row."""
    heads = pl.ds(pl.program_id(1) * group, _MIN_ROWS)
    row_ok = (jnp.arange(_MIN_ROWS) < group)[:, None]
    q = plgpu.load(q_ref.at[heads, :], mask=row_ok, other=0.0)
    lo, hi = bounds_ref[0], bounds_ref[1]
    offsets = jnp.arange(block_k)
    exact = False if q.dtype == jnp.float32 else None  # float32 inputs: no TF32 rounding in the products

    def body(j, carry):
        acc, m, l = carry
        idx = j * block_k + offsets
        in_cache = idx < slots
        window = pl.ds(j * block_k, block_k)
        k = plgpu.load(k_ref.at[window, :], mask=in_cache[:, None], other=0.0)
        v = plgpu.load(v_ref.at[window, :], mask=in_cache[:, None], other=0.0)
        ok = (plgpu.load(allowed_ref.at[window], mask=in_cache, other=0) != 0) & (idx >= lo) & (idx < hi)
        s = plgpu.dot(q, k, trans_b=True, allow_tf32=exact) * scale  # [16, block_k] float32
        s = jnp.where(ok[None, :], s, _MASKED)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(ok[None, :], jnp.exp(s - m_new[:, None]), 0.0)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(v.dtype), v, allow_tf32=exact)
        return acc, m_new, l * alpha + jnp.sum(p, axis=1)

    d = q_ref.shape[1]
    init = (jnp.zeros((_MIN_ROWS, d), jnp.float32), jnp.full((_MIN_ROWS,), _MASKED, jnp.float32),
            jnp.zeros((_MIN_ROWS,), jnp.float32))
    acc, _, l = jax.lax.fori_loop(lo // block_k, pl.cdiv(hi, block_k), body, init)
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]  # a row with no allowed slot: zeros
    plgpu.store(o_ref.at[heads, :], out.astype(o_ref.dtype), mask=row_ok)


def _bounds(allowed: jax.Array) -> jax.Array:
    """[B, 2] int32: each row's first allowed slot and one past its last (0, 0 for a row with none)."""
    s = allowed.shape[1]
    any_ok = jnp.any(allowed, axis=1)
    first = jnp.argmax(allowed, axis=1)
    last = s - jnp.argmax(allowed[:, ::-1], axis=1)
    return jnp.where(any_ok[:, None], jnp.stack([first, last], axis=1), 0).astype(jnp.int32)


def call_unsupported(q: jax.Array, k: jax.Array) -> str | None:
    """Why this call cannot use the kernel (None when it can)."""
    g, d = q.shape[1] // k.shape[2], q.shape[2]
    if g > _MIN_ROWS:
        return f"{g} query heads per KV head (at most {_MIN_ROWS})"
    if d < 16 or d & (d - 1):
        return f"head_dim {d} is not a power of two >= 16"
    return None


@functools.partial(jax.jit, static_argnames=("scale", "block_k", "num_warps", "num_stages", "interpret"))
def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, allowed: jax.Array, *, scale: float,
                     block_k: int = 64, num_warps: int = 2, num_stages: int = 2,
                     interpret: bool | None = None) -> jax.Array:
    """See :func:`jrl.kernels.attention.api.decode_attention`. The default blocks (64 slots, 2 warps) measured
    fastest on an H100 at a 64-row sampler step (``benchmarks/decode_attention.py``): small enough for every
    program of the step to be resident at once."""
    b, n, d = q.shape
    s, kv = k.shape[1], k.shape[2]
    interpret = jax.default_backend() not in ("gpu", "cuda") if interpret is None else interpret
    kernel = functools.partial(_kernel, scale=scale, block_k=block_k, slots=s, group=n // kv)
    return pl.pallas_call(
        kernel,
        grid=(b, kv),
        in_specs=[
            pl.BlockSpec((None, 2), lambda i, h: (i, 0)),
            pl.BlockSpec((None, n, d), lambda i, h: (i, 0, 0)),
            pl.BlockSpec((None, s, None, d), lambda i, h: (i, 0, h, 0)),
            pl.BlockSpec((None, s, None, d), lambda i, h: (i, 0, h, 0)),
            pl.BlockSpec((None, s), lambda i, h: (i, 0)),
        ],
        out_specs=pl.BlockSpec((None, n, d), lambda i, h: (i, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((b, n, d), v.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jrl_decode_attention",
    )(_bounds(allowed), q, k, v, allowed.astype(jnp.int8))
