"""Rollout engines (the embedded JAX sampler, an external vLLM server) behind one protocol, their registry
and the weight-sync transports of the vLLM engine."""

from jrl.rollout import jax_engine as _jax_engine  # noqa: F401  (registers the ``jax`` engine)
from jrl.rollout import vllm_engine as _vllm_engine  # noqa: F401  (registers the ``vllm`` engine)
from jrl.rollout.base import ROLLOUT_ENGINES, RolloutBatch, RolloutEngine, SamplingParams
from jrl.rollout.weight_sync import WEIGHT_TRANSPORTS

__all__ = ["ROLLOUT_ENGINES", "WEIGHT_TRANSPORTS", "RolloutBatch", "RolloutEngine", "SamplingParams"]
