"""The row operations of :mod:`jrl.kernels.moe.rows` as Triton kernels (``triton_kernels.py``) called through
jax-triton: each program takes a block of rows and columns and loads only the rows in use (``take_rows`` stores
zeros for the others unless told not to), so its memory traffic follows the rows routed, not the buffer's size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax_triton as jt

from jrl.kernels.moe import triton_kernels as K
from jrl.kernels.moe import triton as triton_gmm

unavailable_reason = triton_gmm.unavailable_reason  # what the dispatcher asks: a GPU

_ROWS_PER_PROGRAM = 16
_MAX_COLS_PER_PROGRAM = 512


def _cols(width: int) -> int:
    """The columns per program: the widest power of two up to 512 that divides ``width`` (no masked-off half
    blocks), or, for a width no such block of 16 or more divides, the power of two that covers it up to 512."""
    block = _MAX_COLS_PER_PROGRAM
    while block > 16 and width % block:
        block //= 2
    if width % block == 0:
        return block
    return min(_MAX_COLS_PER_PROGRAM, 1 << (width - 1).bit_length())


def _launch(kernel, out_shape, *args, rows: int, width: int, **consts):
    """One launch of a row kernel over ``rows x width`` (jax-triton has no batching rule: vmap loops)."""
    return jax.custom_batching.sequential_vmap(lambda *a: jt.triton_call(
        *a, kernel=kernel, out_shape=out_shape, grid=(-(-rows // _ROWS_PER_PROGRAM), -(-width // _cols(width))),
        num_warps=4, **consts))(*args)


def take_rows(src: jax.Array, index: jax.Array, k: int, scale: jax.Array | None, dtype, fill: bool) -> jax.Array:
    (nsrc, h), r = src.shape, index.shape[0]
    if r == 0 or h == 0:
        return jnp.zeros((r, h), dtype)
    scales = jnp.zeros((1,), jnp.float32) if scale is None else scale.astype(jnp.float32)
    return _launch(K.take_rows_kernel, jax.ShapeDtypeStruct((r, h), dtype), src, index.astype(jnp.int32), scales,
                   rows=r, width=h, R=r, NSRC=nsrc, H=h, K=k, HAS_SCALE=scale is not None, FILL=fill,
                   BLOCK_R=_ROWS_PER_PROGRAM, BLOCK_H=_cols(h))


def _count(count: jax.Array) -> jax.Array:
    return jnp.reshape(count, (1,)).astype(jnp.int32)


def swiglu_fwd(a: jax.Array, b: jax.Array, count: jax.Array) -> jax.Array:
    r, f = a.shape
    if r == 0 or f == 0:
        return jnp.zeros_like(a)
    return _launch(K.swiglu_fwd_kernel, jax.ShapeDtypeStruct(a.shape, a.dtype), a, b, _count(count), rows=r,
                   width=f, R=r, F=f, BLOCK_R=_ROWS_PER_PROGRAM, BLOCK_F=_cols(f))


def swiglu_bwd(a: jax.Array, b: jax.Array, g: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    r, f = a.shape
    if r == 0 or f == 0:
        return jnp.zeros_like(a), jnp.zeros_like(b)
    out = jax.ShapeDtypeStruct(a.shape, a.dtype)
    return tuple(_launch(K.swiglu_bwd_kernel, (out, out), a, b, g.astype(a.dtype), _count(count), rows=r, width=f,
                         R=r, F=f, BLOCK_R=_ROWS_PER_PROGRAM, BLOCK_F=_cols(f)))
