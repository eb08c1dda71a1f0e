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
    from jrl.train.algorithms.grpo_update import build_step_batch, completion_logprobs

    model, batch, mask = _rollout("llama")
    step_batch = build_step_batch(batch, np.zeros(len(mask), np.float32), pad_id=0,
                                  completion_length=batch.completion_ids.shape[1])
    trainer, _ = completion_logprobs(model, step_batch, temperature=TEMPERATURE)
    trainer = np.asarray(trainer)[:, :mask.shape[1]]
    assert np.abs(batch.sampling_logprobs - trainer)[mask].max() <= 1e-4


def test_lora_sampler_logprobs_match_the_unmerged_forward():
    """The sampler decodes with the adapters merged into its copy of the weights; the trainer scores with
    separate adapters. Both give the same logprobs, and the adapters change them."""
    import jax

    from jrl.models.lora import LoraConfig, apply_lora, lora_disabled, lora_layers

    model = apply_lora(tiny_model("llama", seed=3), LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj",
                                                                                                     "down_proj")))
    for i, layer in enumerate(lora_layers(model).values()):
        layer.lora_b.set_value(jax.random.normal(jax.random.key(i), layer.lora_b.shape) * 0.3)
    prompts = random_prompts(np.random.default_rng(5), [6, 3, 9])
    params = SamplingParams(max_new_tokens=8, temperature=TEMPERATURE, stop_token_ids=(5, 9))
    batch = JaxRolloutEngine(model, pad_id=PAD, prompt_bucket=16).generate(prompts, params, num_generations=2, seed=1)
    mask = batch.completion_mask.astype(bool)
    assert np.abs(batch.sampling_logprobs - full_forward_logprobs(model, batch, TEMPERATURE))[mask].max() <= 1e-4
    with lora_disabled(model):
        base = full_forward_logprobs(model, batch, TEMPERATURE)
    assert np.abs(batch.sampling_logprobs - base)[mask].max() > 1e-2


def test_row_counts_share_one_program_per_power_of_two():
    from jrl.rollout.jax_engine import _generate, row_bucket

    assert [row_bucket(r) for r in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert row_bucket(3, shards=8) == 8 and row_bucket(12, shards=8) == 16
    engine = JaxRolloutEngine(tiny_model("llama", seed=1), pad_id=PAD, prompt_bucket=16)
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    rng = np.random.default_rng(0)
    before = _generate._cache_size()
    for prompts, generations in ((3, 2), (4, 2), (5, 1)):
        batch = engine.generate(random_prompts(rng, [5] * prompts), params, num_generations=generations, seed=0)
        assert batch.completion_ids.shape == (prompts * generations, 4)
    # 3 x 2 and 4 x 2 rows run as 8 rows continuing 4 prefilled prompts (one program); 5 x 1 as 8 rows prefilled
    # as rows (a second program): programs are bounded by (row bucket, prompt-count bucket) pairs
    assert _generate._cache_size() - before == 2
