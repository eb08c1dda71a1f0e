"""Per-token logprobs and entropy from hidden states without materializing [N, V] logits."""

from jrl.kernels.logprobs.api import available_impls, token_logprobs

__all__ = ["available_impls", "token_logprobs"]
