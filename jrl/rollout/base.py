"""The contract every rollout backend (embedded JAX sampler, external vLLM server) implements."""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled."""

    max_new_tokens: int = 32
    """Most tokens generated per completion (a completion that reaches it without a stop token is
    marked truncated)."""
    temperature: float = 1.0
    """Softmax temperature; the reported sampling logprobs are taken at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability mass reaches ``top_p``."""
    top_k: int = 0
    """Keep only the ``top_k`` most likely tokens (0 = no limit)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion (included in the completion and its mask)."""

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.temperature > 0:
            raise ValueError(
                f"SamplingParams.temperature={self.temperature} must be > 0 (use a small value such as 1e-4 "
                "for near-greedy sampling)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 disables top-k)")


@dataclasses.dataclass
class RolloutBatch:
    """Completions for ``P`` prompts x ``G`` generations, grouped per prompt (rows ``p*G .. p*G+G-1``).

    All arrays are host NumPy arrays with ``N = P * G`` rows.
    """

    prompt_ids: np.ndarray
    """[N, Lp] int32, left-padded prompt token ids."""
    prompt_mask: np.ndarray
    """[N, Lp] int32, 1 for prompt tokens, 0 for padding."""
    completion_ids: np.ndarray
    """[N, Lc] int32, right-padded completion token ids (padding holds a valid id, e.g. pad)."""
    completion_mask: np.ndarray
    """[N, Lc] int32, 1 up to and including the stop token, 0 after."""
    sampling_logprobs: np.ndarray
    """[N, Lc] float32 logprob of each sampled token under the sampler at the sampling temperature
    (NaN where the backend did not report one)."""
    truncated: np.ndarray
    """[N] bool, True where the completion hit ``max_new_tokens`` without a stop token."""
    policy_version: int = 0
    """Version of the weights that generated the batch (for staleness and IS bookkeeping)."""


@runtime_checkable
class RolloutEngine(Protocol):
    """A source of completions with sampling logprobs for the current policy."""

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, num_generations: int,
                 seed: int) -> RolloutBatch:
        """Sample ``num_generations`` completions for each prompt (unpadded token-id lists)."""
        ...

    def sync_weights(self, model, version: int) -> None:
        """Make the engine sample from ``model``'s current weights, tagged ``version``."""
        ...
