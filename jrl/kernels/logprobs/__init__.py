"""Per-token logprobs and entropy from hidden states without materializing [N, V] logits, and the
loss-fused LM head (:func:`fused_head_loss`)."""

from jrl.kernels.logprobs.api import available_impls, token_logprobs
from jrl.kernels.logprobs.fused_loss import fused_head_loss

__all__ = ["available_impls", "fused_head_loss", "token_logprobs"]
