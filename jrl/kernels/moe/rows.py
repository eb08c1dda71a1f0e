"""Row operations around the grouped matmuls that skip a buffer's unused rows: :func:`take_rows` (the gathers of
``routing.py``) and :func:`swiglu` (the experts' activation). An expert-parallel device's dropless buffer holds a
row for every (token, expert) pair of its peers' tokens, ``ep`` times the rows routed to it; XLA's gathers and
elementwise kernels read and write every row of it, these touch the rows in use only (``take_rows`` stores zeros
past them unless told not to).

| name        | where                   | what                                |
|-------------|-------------------------|-------------------------------------|
| `reference` | anywhere                | ``jnp.take`` / ``jnp.where`` (the truth) |
| `triton`    | NVIDIA GPU + jax_triton | ``rows_triton.py``                  |
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jrl.kernels import _dispatch
from jrl.kernels._dispatch import Impl

IMPLS = {
    "reference": Impl("reference", "jrl.kernels.moe.rows_reference", ("cpu", "gpu", "tpu")),
    "triton": Impl("triton", "jrl.kernels.moe.rows_triton", ("gpu",)),
}
ORDER = {"gpu": ("triton", "reference"), "default": ("reference",)}


def _impl(kernel: str, impl: str, config: tuple):
    return _dispatch.select(kernel, IMPLS, ORDER, impl, config=config)[1]


def take_rows(src: jax.Array, index: jax.Array, *, k: int = 1, scale: jax.Array | None = None, dtype=None,
              fill: bool = True, impl: str = "auto") -> jax.Array:
    """``out[r] = src[index[r] // k]`` ([R, H] from ``src`` [N, H] and ``index`` [R], entries in ``[0, N * k]``),
    times ``scale[index[r]]`` in float32 when ``scale`` [N * k] is given, in ``dtype`` (default ``src``'s). Where
    ``index[r] // k >= N`` (a row routed nowhere) ``src`` is not read, and the row is zeros, or with ``fill=False``
    unspecified (the kernel leaves it unwritten: for callers none of whose readers look at it). Not differentiable:
    the callers define their gradients."""
    dtype = jnp.dtype(dtype or src.dtype)
    mod = _impl("take_rows", impl, ("take_rows", tuple(src.shape), str(src.dtype), int(index.shape[0]), k,
                                    scale is not None, str(dtype), fill))
    return mod.take_rows(src, index, k, scale, dtype, fill)


def swiglu(a: jax.Array, b: jax.Array, count: jax.Array | None = None, *, impl: str = "auto") -> jax.Array:
    """``silu(a) * b`` for ``a``, ``b`` [R, F]; differentiable wrt both. With ``count`` (a traced int: the rows sorted
    to some expert) the rows past it, of the result and of both gradients, are unspecified: the kernel neither reads
    nor writes them (the reference writes zeros), for callers whose readers skip them; without, every row is
    computed by XLA, which fuses the product with its neighbours (on one device a buffer's rows are all in use, and
    a whole Qwen3-30B-A3B LoRA update ran 2% slower with the kernel there)."""
    if count is None:
        return jax.nn.silu(a) * b
    return _swiglu(a, b, jnp.asarray(count, jnp.int32), impl)


def _swiglu_impl(a: jax.Array, impl: str):
    return _impl("swiglu", impl, ("swiglu", tuple(a.shape), str(a.dtype)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _swiglu(a, b, count, impl):
    return _swiglu_impl(a, impl).swiglu_fwd(a, b, count)


def _swiglu_fwd(a, b, count, impl):
    return _swiglu(a, b, count, impl), (a, b, count)


def _swiglu_bwd(impl, res, g):
    a, b, count = res
    da, db = _swiglu_impl(a, impl).swiglu_bwd(a, b, g, count)
    return da, db, None


_swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)
