"""MoE grouped matmul (with gradients and LoRA on experts) and token permutation."""

from jrl.kernels.moe.api import available_impls, gmm, gmm_lora, tgmm
from jrl.kernels.moe.routing import Permutation, permute, unpermute

__all__ = ["Permutation", "available_impls", "gmm", "gmm_lora", "permute", "tgmm", "unpermute"]
