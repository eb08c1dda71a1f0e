"""Per-token logprobs and entropy from hidden states without materializing [N, V] logits."""

from jrl.kernels.logprobs.api import token_logprobs

__all__ = ["token_logprobs"]
