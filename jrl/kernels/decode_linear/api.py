"""Decode-step matmul dispatcher: ``residual + h @ w`` for a few rows.

| name         | where                                  | what                                                   |
|--------------|----------------------------------------|--------------------------------------------------------|
| `reference`  | anywhere                               | XLA's matmul, then the add (the truth)                 |
| `pallas_gpu` | NVIDIA GPU (interpret mode elsewhere)  | one Triton kernel: split-K matmul with the add fused   |

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


def matmul_add(h: jax.Array, w: jax.Array, residual: jax.Array, *, impl: str = "auto", **kwargs) -> jax.Array:
    """``residual + h @ w``: h [M, K], w [K, N], residual [M, N] -> [M, N] in the residual's dtype; the product
    is rounded to h's dtype before the add (as a Linear layer followed by the add).

    ``kwargs`` go to the Pallas kernel only: a block configuration (``split_k``, ``block_k``, ``block_n``,
    ``num_warps``, ``num_stages``) and ``interpret``."""
    if h.ndim != 2 or w.ndim != 2 or h.shape[1] != w.shape[0] or residual.shape != (h.shape[0], w.shape[1]):
        raise ValueError(f"matmul_add needs h [M, K], w [K, N], residual [M, N]; got {h.shape}, {w.shape}, "
                         f"{residual.shape}")
    blocks = {k: v for k, v in kwargs.items() if k != "interpret"}

    def call_check(name: str) -> str | None:
        return IMPLS[name].load().call_unsupported(h.shape[0], *w.shape, **blocks) if name == "pallas_gpu" else None

    config = (tuple(h.shape), tuple(w.shape), str(h.dtype))
    name, mod = _dispatch.select("matmul_add", IMPLS, ORDER, impl, config=config, call_check=call_check)
    return mod.matmul_add(h, w, residual, **(kwargs if name != "reference" else {}))
