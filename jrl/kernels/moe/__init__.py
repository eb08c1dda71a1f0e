"""MoE grouped matmul and token permutation."""

from jrl.kernels.moe.api import gmm
from jrl.kernels.moe.routing import Permutation, permute, unpermute

__all__ = ["Permutation", "gmm", "permute", "unpermute"]
