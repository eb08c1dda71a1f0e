"""A decode step's projections (a few rows against a whole weight matrix) fused with what follows them: the
residual add after an output projection, SwiGLU after the MLP's gate and up projections. See :mod:`.api`."""

from jrl.kernels.decode_linear.api import IMPLS, ORDER, matmul_add, matmul_concat, matmul_swiglu

__all__ = ["IMPLS", "ORDER", "matmul_add", "matmul_concat", "matmul_swiglu"]
