"""Decode-step matmul dispatcher: ``residual + h @ w`` (:func:`matmul_add`), ``silu(h @ w_gate) * (h @
w_up)`` (:func:`matmul_swiglu`) and ``h @ [w_1 | w_2 | ...]`` (:func:`matmul_concat`) for a few rows.

| name         | where                                  | what                                                   |
|--------------|----------------------------------------|--------------------------------------------------------|
| `reference`  | anywhere                               | XLA's matmuls, then the add / SwiGLU / concatenation   |
|              |                                        | (the truth)                                            |
| `pallas_gpu` | NVIDIA GPU (interpret mode elsewhere)  | one Triton kernel: split-K matmul with the add fused;  |
|              |                                        | both matmuls with SwiGLU fused; several weights'       |
|              |                                        | split-K products side by side                          |

``impl="auto"`` order: GPU: pallas_gpu (at most :data:`pallas_gpu.MAX_ROWS` rows, block-divisible sizes),
reference. Elsewhere: reference.
"""

from __future__ import annotations

import jax

from jrl.kernels import _dispatch
from jrl.kernels._dispatch import Impl

IMPLS = {
    "reference": Impl("reference", "jrl.kernels.decode_linear.reference", ("cpu", "gpu", "tpu")),
    "pallas_gpu": Impl("pallas_gpu", "jrl.kernels.decode_linear.pallas_gpu", ("gpu",), interpret_ok=True),
}
ORDER = {"gpu": ("pallas_gpu", "reference"), "default": ("reference",)}


def _pallas_check(h: jax.Array, arrays, n: int, kwargs: dict, **sizes):
    """The dispatcher's ``call_check`` for rows ``h`` times the weight matrices ``arrays`` (``n`` output columns;
    ``sizes``: the kernel's other sizes): why the Pallas kernel cannot take the call with ``kwargs``' blocks."""
    blocks = {k: v for k, v in kwargs.items() if k != "interpret"}

    def call_check(name: str) -> str | None:
        if name != "pallas_gpu":
            return None
        mod = IMPLS[name].load()
        return mod.call_unsupported(h.shape[0], h.shape[1], n, itemsize=mod.itemsize(h, *arrays), **sizes, **blocks)

    return call_check


def matmul_add(h: jax.Array, w: jax.Array, residual: jax.Array, *, impl: str = "auto", **kwargs) -> jax.Array:
    """``residual + h @ w``: h [M, K], w [K, N], residual [M, N] -> [M, N] in the residual's dtype; the product
    is rounded to h's dtype before the add (as a Linear layer followed by the add).

    ``kwargs`` go to the Pallas kernel only: a block configuration (``split_k``, ``block_k``, ``block_n``,
    ``num_warps``, ``num_stages``) and ``interpret``."""
    if h.ndim != 2 or w.ndim != 2 or h.shape[1] != w.shape[0] or residual.shape != (h.shape[0], w.shape[1]):
        raise ValueError(f"matmul_add needs h [M, K], w [K, N], residual [M, N]; got {h.shape}, {w.shape}, "
                         f"{residual.shape}")
    call_check = _pallas_check(h, (w,), w.shape[1], kwargs)
    config = (tuple(h.shape), tuple(w.shape), str(h.dtype))
    name, mod = _dispatch.select("matmul_add", IMPLS, ORDER, impl, config=config, call_check=call_check)
    return mod.matmul_add(h, w, residual, **(kwargs if name != "reference" else {}))


def matmul_swiglu(h: jax.Array, w_gate: jax.Array, w_up: jax.Array, *, impl: str = "auto", **kwargs) -> jax.Array:
    """``silu(h @ w_gate) * (h @ w_up)``: h [M, K], w_gate = w_up [K, N] -> [M, N] in h's dtype (each product and
    silu rounded to it, as the MLP computes them). ``kwargs`` as :func:`matmul_add` (no ``split_k``)."""
    if h.ndim != 2 or w_gate.ndim != 2 or h.shape[1] != w_gate.shape[0] or w_up.shape != w_gate.shape:
        raise ValueError(f"matmul_swiglu needs h [M, K], w_gate = w_up [K, N]; got {h.shape}, {w_gate.shape}, "
                         f"{w_up.shape}")
    call_check = _pallas_check(h, (w_gate, w_up), w_gate.shape[1], kwargs, weights=2)
    config = ("swiglu", tuple(h.shape), tuple(w_gate.shape), str(h.dtype))
    name, mod = _dispatch.select("matmul_swiglu", IMPLS, ORDER, impl, config=config, call_check=call_check)
    return mod.matmul_swiglu(h, w_gate, w_up, **(kwargs if name != "reference" else {}))


def matmul_concat(h: jax.Array, weights, *, impl: str = "auto", **kwargs) -> jax.Array:
    """``h @ w`` for each of ``weights`` [K, N_i], side by side: h [M, K] -> [M, sum N_i] in h's dtype (each product
    rounded to it, as separate Linear layers), without concatenating the weights (the attention's query, key and
    value projections of a decode step in one call). ``kwargs`` as :func:`matmul_add`."""
    weights = tuple(weights)
    if h.ndim != 2 or not weights or any(w.ndim != 2 or w.shape[0] != h.shape[1] for w in weights):
        raise ValueError(f"matmul_concat needs h [M, K] and weights [K, N_i]; got {h.shape}, "
                         f"{[w.shape for w in weights]}")
    widths = tuple(w.shape[1] for w in weights)
    call_check = _pallas_check(h, weights, sum(widths), kwargs, widths=widths)
    config = ("concat", tuple(h.shape), widths, str(h.dtype))
    name, mod = _dispatch.select("matmul_concat", IMPLS, ORDER, impl, config=config, call_check=call_check)
    return mod.matmul_concat(h, weights, **(kwargs if name != "reference" else {}))
