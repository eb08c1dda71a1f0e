"""Rollout engines: the embedded JAX sampler and the external vLLM server, behind one protocol."""

from jrl.rollout.base import RolloutBatch, RolloutEngine, SamplingParams

__all__ = ["RolloutBatch", "RolloutEngine", "SamplingParams"]
