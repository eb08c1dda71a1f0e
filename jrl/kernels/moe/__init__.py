"""MoE grouped matmul (with gradients and LoRA on experts), token permutation and the experts' activation."""

from jrl.kernels.moe.api import available_impls, gmm, gmm_lora, tgmm
from jrl.kernels.moe.routing import Permutation, permute, unpermute
from jrl.kernels.moe.rows import swiglu

__all__ = ["Permutation", "available_impls", "gmm", "gmm_lora", "permute", "swiglu", "tgmm", "unpermute"]
