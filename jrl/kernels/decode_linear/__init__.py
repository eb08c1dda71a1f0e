"""A decode step's output projections (a few rows against a whole weight matrix) fused with the residual add
after them. See :mod:`.api`."""

from jrl.kernels.decode_linear.api import IMPLS, ORDER, matmul_add

__all__ = ["IMPLS", "ORDER", "matmul_add"]
