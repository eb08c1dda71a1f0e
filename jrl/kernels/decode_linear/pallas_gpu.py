"""A decode step's projections for a few rows as Pallas (Triton backend) kernels for NVIDIA GPUs.

In a decode step a few rows (M <= :data:`MAX_ROWS`) meet every weight once, so the matmul is bound by
reading the weight. XLA runs an output projection and the residual add after it as a split-K GEMM, a
reduction kernel and an add kernel; :func:`matmul_add` splits the contraction over ``split_k`` programs per
block of ``block_n`` output columns (enough programs to pull the weight from memory when the output is
narrow), each writing float32 partial sums; without a split the add is in the kernel, with one the partial
sums and the residual are added by one XLA kernel. :func:`matmul_swiglu` is the MLP's gate and up
projections with SwiGLU applied to the two products in the kernel (XLA: one GEMM, then an elementwise
kernel that reads both products back). :func:`matmul_concat` is the attention's query, key and value
projections as one kernel writing their products side by side (XLA: three narrow GEMMs, each too small to
pull its weight from memory at speed, and a concatenation). Off GPU they run in Pallas interpret mode (the
tests compare them with :mod:`.reference`).

Kernels that also fused the RMSNorm before a projection were measured slower than XLA's GEMM after its norm
kernel on an H100 (``benchmarks/RESULTS.md``): the prologue between the loads and the matrix product costs
more than the kernel it saves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

MIN_ROWS = 16
"""Triton's matrix product needs 16 rows and its blocks a power of two: rows are padded up to one."""
MAX_ROWS = 64
"""Above this many rows XLA's GEMM and add are as fast or faster (H100: equal at 256 rows for the 1B attention
output, 1.45x faster for its down projection, `benchmarks/RESULTS.md`); the dispatcher uses them."""
DEFAULTS = dict(split_k=2, block_k=256, block_n=32, num_warps=4, num_stages=4)
"""Block configuration of :func:`matmul_add` (``benchmarks/decode_linear.py --sweep`` on an H100: best for
both the attention output and the MLP down projection of the 1B shape at 64 rows)."""
FEW_ROWS = 32
FEW_ROWS_DEFAULTS = dict(split_k=4, block_k=128, block_n=64, num_warps=4, num_stages=4)
"""Block configuration of :func:`matmul_add` for at most :data:`FEW_ROWS` rows (a long generation's tail):
more, shorter contraction splits keep enough loads in flight when each program's product is small
(``--sweep`` on an H200, 1B shape at 16 and 32 rows, ``benchmarks/RESULTS.md``)."""
SWIGLU_DEFAULTS = dict(split_k=1, block_k=64, block_n=64, num_warps=4, num_stages=4)
"""Block configuration of :func:`matmul_swiglu` (``benchmarks/decode_linear.py --ops gate_up --sweep`` on an
H100, 1B shape at 64 rows; no split: the MLP is wide enough to give every SM programs)."""
SHARED_MEMORY = 220 * 1024
"""Bytes of shared memory a program may ask for (an H100 SM has 227 KiB): the pipeline's stages of the h and
weight blocks, ``itemsize`` bytes a value (a float32 model's blocks take twice a bfloat16 one's)."""


def unavailable_reason() -> str | None:
    return None  # compiled on an NVIDIA GPU, in interpret mode elsewhere


def itemsize(*arrays) -> int:
    """Bytes of the widest value of ``arrays`` (the blocks a program keeps in shared memory)."""
    return max(jnp.dtype(a.dtype).itemsize for a in arrays)


def _interpreting(interpret: bool | None) -> bool:
    """``interpret``, or where None whether no GPU compiles the kernel (Pallas interpret mode then)."""
    return jax.default_backend() not in ("gpu", "cuda") if interpret is None else interpret


def _rows(m: int) -> int:
    return max(MIN_ROWS, 1 << (m - 1).bit_length())


def config(rows: int, k: int, n: int, *, weights: int = 1, itemsize: int = 2, **overrides) -> dict:
    """The block configuration for ``rows`` x ``k`` times ``weights`` matrices ``k`` x ``n`` of ``itemsize``-byte
    values: the defaults (:data:`DEFAULTS`, or :data:`FEW_ROWS_DEFAULTS` for a few rows; with two weights
    :data:`SWIGLU_DEFAULTS`) updated by ``overrides``, blocks no larger than the matrix, no more splits than
    contraction blocks, and (unless given) the contraction block halved, down to 32, while the pipeline's buffers
    exceed :data:`SHARED_MEMORY`."""
    if weights != 1:
        defaults = SWIGLU_DEFAULTS
    else:
        defaults = FEW_ROWS_DEFAULTS if _rows(rows) <= FEW_ROWS else DEFAULTS
    c = {**defaults, **overrides}
    c["block_k"], c["block_n"] = min(c["block_k"], k), min(c["block_n"], n)
    c["split_k"] = max(1, min(c["split_k"], k // c["block_k"]))
    while ("block_k" not in overrides and c["block_k"] > 32
           and itemsize * c["num_stages"] * c["block_k"] * (_rows(rows) + weights * c["block_n"]) > SHARED_MEMORY):
        c["block_k"] //= 2
    return c


def call_unsupported(rows: int, k: int, n: int, *, weights: int = 1, widths: tuple[int, ...] = (), itemsize: int = 2,
                     **overrides) -> str | None:
    """Why a call with these sizes cannot use the kernel (None when it can); ``widths``: the columns of each weight
    whose products are written side by side (:func:`matmul_concat`, ``n`` their sum)."""
    c = config(rows, k, n, weights=weights, itemsize=itemsize, **overrides)
    if rows > MAX_ROWS:
        return f"{rows} rows (the kernel takes at most {MAX_ROWS})"
    if k % (c["block_k"] * c["split_k"]) or any(w % c["block_n"] for w in widths or (n,)):
        return (f"contraction {k} / columns {', '.join(map(str, widths or (n,)))} are not multiples of block_k "
                f"{c['block_k']} x split_k {c['split_k']} / block_n {c['block_n']}")
    if min(c["block_k"], c["block_n"]) < 16 or (c["block_k"] | c["block_n"]) & 15:
        return f"blocks {c['block_k']} x {c['block_n']} (Triton needs multiples of 16)"
    return None


def _product(h_ref, w_ref, block_k: int) -> jax.Array:
    """float32 h_ref [M, K] @ w_ref [K, N], over the contraction in blocks of ``block_k``."""
    rows, k = h_ref.shape
    exact = False if h_ref.dtype == jnp.float32 else None  # float32 inputs: no TF32 rounding

    def body(j, acc):
        cols = pl.ds(j * block_k, block_k)
        return acc + plgpu.dot(h_ref[:, cols], w_ref[cols, :].astype(h_ref.dtype), allow_tf32=exact)

    return jax.lax.fori_loop(0, k // block_k, body, jnp.zeros((rows, w_ref.shape[-1]), jnp.float32))


def _kernel(h_ref, w_ref, *refs, block_k: int, has_residual: bool):
    """h_ref [M, K / split_k], w_ref [K / split_k, block_n]; then the residual block [M, block_n] when
    ``has_residual`` (no split) and the output block [M, block_n] (float32 partial sums under a split)."""
    o_ref = refs[-1]
    acc = _product(h_ref, w_ref, block_k)
    if has_residual:  # as the reference: the product rounded to h's dtype, then added
        acc = refs[0][...].astype(jnp.float32) + acc.astype(h_ref.dtype).astype(jnp.float32)
    o_ref[...] = acc.astype(o_ref.dtype)


def matmul_add(h, w, residual, *, interpret: bool | None = None, **overrides):
    """See :func:`jrl.kernels.decode_linear.api.matmul_add`; ``overrides``: block configuration."""
    interpret = _interpreting(interpret)
    return _matmul_add(h, w, residual, interpret=interpret,
                       **config(h.shape[0], *w.shape, itemsize=itemsize(h, w), **overrides))


@functools.partial(jax.jit, static_argnames=("split_k", "block_k", "block_n", "num_warps", "num_stages",
                                             "interpret"))
def _matmul_add(h, w, residual, *, split_k, block_k, block_n, num_warps, num_stages, interpret):
    rows = h.shape[0]
    m = _rows(rows)
    h = jnp.pad(h, ((0, m - rows), (0, 0)))
    k, n = w.shape
    part = k // split_k
    common = dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                  interpret=interpret, name="jrl_matmul_add")
    if split_k == 1:
        return pl.pallas_call(
            functools.partial(_kernel, block_k=block_k, has_residual=True),
            grid=(n // block_n,),
            in_specs=[pl.BlockSpec((m, k), lambda j: (0, 0)), pl.BlockSpec((k, block_n), lambda j: (0, j)),
                      pl.BlockSpec((m, block_n), lambda j: (0, j))],
            out_specs=pl.BlockSpec((m, block_n), lambda j: (0, j)),
            out_shape=jax.ShapeDtypeStruct((m, n), residual.dtype), **common,
        )(h, w, jnp.pad(residual, ((0, m - rows), (0, 0))))[:rows]
    partial = pl.pallas_call(
        functools.partial(_kernel, block_k=block_k, has_residual=False),
        grid=(n // block_n, split_k),
        in_specs=[pl.BlockSpec((m, part), lambda j, s: (0, s)), pl.BlockSpec((part, block_n), lambda j, s: (s, j))],
        out_specs=pl.BlockSpec((None, m, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((split_k, m, n), jnp.float32), **common,
    )(h, w)
    return residual + partial[:, :rows].sum(axis=0).astype(h.dtype).astype(residual.dtype)


def _swiglu_kernel(h_ref, wg_ref, wu_ref, o_ref, *, block_k: int):
    """h_ref [M, K], wg_ref / wu_ref [K, block_n], o_ref [M, block_n]: silu(h @ wg) * (h @ wu)."""
    rows, k = h_ref.shape
    dtype = h_ref.dtype
    exact = False if dtype == jnp.float32 else None

    def body(j, acc):
        cols = pl.ds(j * block_k, block_k)
        h = h_ref[:, cols]
        return (acc[0] + plgpu.dot(h, wg_ref[cols, :].astype(dtype), allow_tf32=exact),
                acc[1] + plgpu.dot(h, wu_ref[cols, :].astype(dtype), allow_tf32=exact))

    zeros = jnp.zeros((rows, o_ref.shape[-1]), jnp.float32)
    g, u = jax.lax.fori_loop(0, k // block_k, body, (zeros, zeros))
    # rounded as the reference: each product, silu(gate) and the result in h's dtype
    g, u = g.astype(dtype).astype(jnp.float32), u.astype(dtype).astype(jnp.float32)
    silu = (g / (1.0 + jnp.exp(-g))).astype(dtype).astype(jnp.float32)
    o_ref[...] = (silu * u).astype(o_ref.dtype)


def matmul_swiglu(h, w_gate, w_up, *, interpret: bool | None = None, **overrides):
    """See :func:`jrl.kernels.decode_linear.api.matmul_swiglu`; ``overrides``: block configuration."""
    if overrides.get("split_k", 1) != 1:
        raise ValueError(f"matmul_swiglu does not split the contraction; got split_k={overrides['split_k']}")
    interpret = _interpreting(interpret)
    c = config(h.shape[0], *w_gate.shape, weights=2, itemsize=itemsize(h, w_gate, w_up), **overrides)
    return _matmul_swiglu(h, w_gate, w_up, interpret=interpret,
                          **{k: v for k, v in c.items() if k != "split_k"})


@functools.partial(jax.jit, static_argnames=("block_k", "block_n", "num_warps", "num_stages", "interpret"))
def _matmul_swiglu(h, w_gate, w_up, *, block_k, block_n, num_warps, num_stages, interpret):
    rows = h.shape[0]
    m = _rows(rows)
    k, n = w_gate.shape
    weight = pl.BlockSpec((k, block_n), lambda j: (0, j))
    return pl.pallas_call(
        functools.partial(_swiglu_kernel, block_k=block_k),
        grid=(n // block_n,),
        in_specs=[pl.BlockSpec((m, k), lambda j: (0, 0)), weight, weight],
        out_specs=pl.BlockSpec((m, block_n), lambda j: (0, j)),
        out_shape=jax.ShapeDtypeStruct((m, n), h.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="jrl_matmul_swiglu",
    )(jnp.pad(h, ((0, m - rows), (0, 0))), w_gate, w_up)[:rows]


def _concat_kernel(h_ref, *refs, starts: tuple[int, ...], block_k: int):
    """h_ref [M, K / split_k], a [K / split_k, block_n] block of every weight, then the output block [M, block_n]
    (float32 partial sums under a split): program j's columns are those of the weight whose column blocks
    ``starts[i] .. starts[i + 1]`` hold j (the other weights' blocks are not read)."""
    *w_refs, o_ref = refs
    j = pl.program_id(0)
    for i, w_ref in enumerate(w_refs):
        @pl.when((j >= starts[i]) & (j < starts[i + 1]))
        def _(w_ref=w_ref):
            o_ref[...] = _product(h_ref, w_ref, block_k).astype(o_ref.dtype)


def matmul_concat(h, weights, *, interpret: bool | None = None, **overrides):
    """See :func:`jrl.kernels.decode_linear.api.matmul_concat`; ``overrides``: block configuration."""
    interpret = _interpreting(interpret)
    n = sum(w.shape[1] for w in weights)
    return _matmul_concat(h, tuple(weights), interpret=interpret,
                          **config(h.shape[0], h.shape[1], n, itemsize=itemsize(h, *weights), **overrides))


@functools.partial(jax.jit, static_argnames=("split_k", "block_k", "block_n", "num_warps", "num_stages",
                                             "interpret"))
def _matmul_concat(h, weights, *, split_k, block_k, block_n, num_warps, num_stages, interpret):
    rows = h.shape[0]
    m = _rows(rows)
    k = h.shape[1]
    part = k // split_k
    blocks = [w.shape[1] // block_n for w in weights]
    starts = tuple(int(x) for x in np.cumsum([0] + blocks))

    def weight_spec(i):
        return pl.BlockSpec((part, block_n), lambda j, s: (s, jnp.clip(j - starts[i], 0, blocks[i] - 1)))

    n = starts[-1] * block_n
    out = pl.pallas_call(
        functools.partial(_concat_kernel, starts=starts, block_k=block_k),
        grid=(starts[-1], split_k),
        in_specs=[pl.BlockSpec((m, part), lambda j, s: (0, s))] + [weight_spec(i) for i in range(len(weights))],
        out_specs=pl.BlockSpec((None, m, block_n), lambda j, s: (s, 0, j)),
        out_shape=jax.ShapeDtypeStruct((split_k, m, n), jnp.float32 if split_k > 1 else h.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="jrl_matmul_concat",
    )(jnp.pad(h, ((0, m - rows), (0, 0))), *weights)
    return (out[0] if split_k == 1 else out.sum(axis=0))[:rows].astype(h.dtype)
