"""Sampler-trainer agreement: the logprobs the sampler reports equal the logprobs of the same tokens under
the same weights recomputed by a full forward pass at the sampling temperature (float32, |diff| <= 1e-4),
both by a plain ``model(...)`` + log_softmax and by the train step's own scoring function."""

import numpy as np
import pytest
from rollout_testlib import PAD, full_forward_logprobs, random_prompts, tiny_model

from jrl.rollout import SamplingParams
from jrl.rollout.jax_engine import JaxRolloutEngine

TEMPERATURE = 0.7


def _rollout(kind):
    model = tiny_model(kind, seed=3)
    prompts = random_prompts(np.random.default_rng(2), [4, 11, 2])
    params = SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, stop_token_ids=(5, 9, 17, 30))
    batch = JaxRolloutEngine(model, pad_id=PAD, prompt_bucket=16).generate(prompts, params, num_generations=2, seed=7)
    mask = batch.completion_mask.astype(bool)
    assert mask.any() and (~mask).any(), "the rollout should hold both stopped and running rows"
    return model, batch, mask


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_sampler_logprobs_match_full_forward(kind):
    model, batch, mask = _rollout(kind)
    reference = full_forward_logprobs(model, batch, TEMPERATURE)
    got = batch.sampling_logprobs
    assert np.isfinite(got).all() and (got[mask] < 0).all()
    assert np.abs(got - reference)[mask].max() <= 1e-4
    # At temperature 1 the same tokens score differently: the check above is sensitive to the temperature.
    assert np.abs(got - full_forward_logprobs(model, batch, 1.0))[mask].max() > 1e-2


def test_sampler_logprobs_match_train_step_scoring():
    from jrl.train.algorithms.grpo import build_step_batch, completion_logprobs

    model, batch, mask = _rollout("llama")
    step_batch = build_step_batch(batch, np.zeros(len(mask), np.float32), pad_id=0,
                                  completion_length=batch.completion_ids.shape[1])
    trainer, _ = completion_logprobs(model, step_batch, temperature=TEMPERATURE)
    trainer = np.asarray(trainer)[:, :mask.shape[1]]
    assert np.abs(batch.sampling_logprobs - trainer)[mask].max() <= 1e-4
