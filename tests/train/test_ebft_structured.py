"""EBFT structured mode: config validation and dispatch, the adaptive generation limit, feature-matching
rewards through the frozen feature network (full fine-tune copy and LoRA base), the ground-truth
cross-entropy term, and a short run on the arithmetic task with exact resume."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_testlib import max_rel_err, random_step_batch, read_metrics_log

from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig, cross_entropy_loss
from jrl.models.features import feature_layer_indices
from jrl.models.lora import LoraConfig, LoRAParam, lora_layers
from jrl.train.config import ModelSpec, OptimConfig, RolloutConfig, TrainConfig, load_config_file
from jrl.train.algorithms import ALGORITHMS
from jrl.train.algorithms.ebft_structured import EBFTExperience, EBFTStructured, adaptive_max_new_tokens, pack_rows
from jrl.train.algorithms.grpo import GRPO
from jrl.train.algorithms.grpo_update import completion_logprobs
from jrl.train.ebft_config import EBFTConfig
from jrl.rewards.functions import RewardSpec
from jrl.train.trainer import Trainer

EBFT_METRICS = ("ebft/alignment", "ebft/diversity", "ebft/reward", "ebft/cfm_loss", "ebft/alignment_sumsq",
                "ebft/gt_truncated_frac", "ebft/max_new_tokens")


def _cfg(model_dir, out, **kw) -> TrainConfig:
    ebft = kw.pop("ebft", EBFTConfig(feature_layers=(0.5, 1.0), adaptive_min_tokens=4))
    cfg = TrainConfig(
        model=ModelSpec(path=str(model_dir)), data=DataConfig(prompts_per_batch=2, max_prompt_length=64, seed=1),
        algorithm="ebft_structured", rollout=RolloutConfig(max_new_tokens=8, temperature=1.0), ebft=ebft,
        algo=GRPOConfig(num_generations=4, loss_type="grpo"),
        optim=OptimConfig(learning_rate=3e-3, micro_batch_size=4), output_dir=str(out), max_steps=4, save_every=2,
        seed=5)
    return dataclasses.replace(cfg, **kw)


# ---------------------------------------------------------------------------------------------
# config


def test_config_validation_and_defaults():
    assert EBFTConfig().estimator("grpo") == "grpo"
    assert EBFTConfig(advantage_estimator="rloo").estimator("grpo") == "rloo"
    assert EBFTConfig(feature_layers=[0.5]).feature_layers == (0.5,)
    bad = [
        (dict(feature_layers=()), "feature_layers"),
        (dict(feature_layers=(0.5, 1.2)), "feature_layers"),
        (dict(embed_method="max"), "embed_method"),
        (dict(concat_span="prompt"), "concat_span"),
        (dict(whitening_scope="global"), "whitening_scope"),
        (dict(whitening_ridge=0.0), "whitening_ridge"),
        (dict(diversity_coef=-1.0), "diversity_coef"),
        (dict(alignment_coef=0.0, diversity_coef=0.0), "alignment_coef"),
        (dict(advantage_estimator="group_norm"), "advantage_estimator"),
        (dict(gt_length_multiplier=0.0), "gt_length_multiplier"),
        (dict(gt_column=""), "gt_column"),
        (dict(stride=0), "stride"),
        (dict(adaptive_min_tokens=0), "adaptive_min_tokens"),
        (dict(n_samples_per_prompt=1), "n_samples_per_prompt"),
        (dict(n_samples_per_prompt=1, advantage_estimator="reinforce"), "n_samples_per_prompt"),
        (dict(n_samples_per_prompt=1, diversity_coef=0.0), "n_samples_per_prompt"),
        (dict(use_whitening="yes"), "use_whitening"),
    ]
    for kw, field in bad:
        with pytest.raises(ValueError, match=f"EBFTConfig.{field}="):
            EBFTConfig(**kw)
    EBFTConfig(n_samples_per_prompt=1, advantage_estimator="reinforce", diversity_coef=0.0)  # explicit: fine
    with pytest.warns(UserWarning, match="diversity_coef"):
        EBFTConfig(use_whitening=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EBFTConfig(use_whitening=True, diversity_coef=0.0)
        EBFTConfig(use_whitening=True, whitening_scope="batch")


def test_train_config_dispatch_and_rewards(tiny_model_dir, tmp_path):
    cfg = _cfg(tiny_model_dir, tmp_path / "x")  # reward specs are not read by ebft
    assert cfg.reward_weights == (1.0,)
    assert ALGORITHMS.get(cfg.algorithm) is EBFTStructured
    assert ALGORITHMS.get(dataclasses.replace(cfg, algorithm="grpo", ebft=EBFTConfig()).algorithm) is GRPO
    with pytest.raises(ValueError, match="TrainConfig.rewards=.*algorithm='ebft_structured' does not use it"):
        dataclasses.replace(cfg, rewards=(RewardSpec(path="jrl.data.tasks.arithmetic:exact_match"),))
    with pytest.raises(ValueError, match="TrainConfig.rewards"):
        dataclasses.replace(cfg, algorithm="grpo", ebft=EBFTConfig(), rewards=())
    with pytest.raises(ValueError, match="TrainConfig.ebft=.*algorithm='grpo' does not use it"):
        dataclasses.replace(cfg, algorithm="grpo")
    with pytest.raises(ValueError, match="TrainConfig.ebft.stride=3 .*algorithm='ebft_structured'"):
        dataclasses.replace(cfg, ebft=dataclasses.replace(cfg.ebft, stride=3))


def test_shipped_config_loads():
    root = Path(__file__).resolve().parents[2]
    cfg = load_config_file(root / "configs" / "ebft.py")
    assert cfg.algorithm == "ebft_structured"
    layers = json.loads((root / cfg.model.path / "config.json").read_text())["num_hidden_layers"]
    assert feature_layer_indices(cfg.ebft.feature_layers, layers) == (1, 2)  # middle and final hidden state


def test_adaptive_limit_and_row_packing():
    assert adaptive_max_new_tokens([10, 19, 3], 1.5, floor=4, cap=64) == 28
    assert adaptive_max_new_tokens([10, 19, 3], 1.5, floor=64, cap=256) == 64
    assert adaptive_max_new_tokens([10, 19, 3], 1.5, floor=4, cap=16) == 16
    assert adaptive_max_new_tokens([], 1.5, floor=4, cap=16) == 4
    ids, mask, c_ids, c_mask = pack_rows([[1, 2], [3]], [[7], [8, 9, 10]], pad_id=0, prompt_length=3,
                                         completion_length=4)
    np.testing.assert_array_equal(ids, [[0, 1, 2, 7, 0, 0, 0], [0, 0, 3, 8, 9, 10, 0]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(c_mask, [[1, 0, 0, 0], [1, 1, 1, 0]])
    np.testing.assert_array_equal(c_ids, ids[:, 3:])
    with pytest.raises(ValueError, match="more than 2"):
        pack_rows([[1]], [[1, 2, 3]], pad_id=0, prompt_length=1, completion_length=2)


# ---------------------------------------------------------------------------------------------
# rewards through the feature network


def _completions(trainer, prompt_batch, seed=0, keep=7):
    """Per group: sample 0 = the first ``keep`` ground-truth tokens + EOS, the rest random bytes + EOS."""
    rng = np.random.default_rng(seed)
    eos = trainer.tokenizer.eos_token_id
    out = []
    for gt in trainer.algorithm.ground_truth_ids(prompt_batch):
        out.append(gt[:keep] + [eos])
        out += [list(map(int, rng.integers(32, 127, rng.integers(1, 8)))) + [eos] for _ in range(3)]
    return out


def _completion_rewards(trainer, batch):
    algo = trainer.algorithm
    return algo.rewards(_completions(trainer, batch), batch, algo.ground_truth_ids(batch), trainer.learner)[0]


def test_ground_truth_completion_gets_the_top_reward(tiny_model_dir, tmp_path):
    ebft = EBFTConfig(feature_layers=(0.5, 1.0), diversity_coef=0.0, adaptive_min_tokens=4, gt_length_multiplier=1.0)
    cfg = _cfg(tiny_model_dir, tmp_path / "r", ebft=ebft, rollout=RolloutConfig(max_new_tokens=24))
    trainer = Trainer(cfg, progress=False)
    algo = trainer.algorithm
    try:
        batch = next(trainer.loader)
        gts = algo.ground_truth_ids(batch)
        assert algo.sampling_params(batch).max_new_tokens == max(len(x) for x in gts) < 24  # adaptive
        rewards, metrics = algo.rewards(_completions(trainer, batch, keep=24), batch, gts, trainer.learner)
        assert rewards.shape == (8, 1)
        r = rewards.reshape(2, 4)
        # the generated side drops the EOS stop token: sample 0 is the ground truth itself, cos = 1
        np.testing.assert_allclose(r[:, 0], 2.0, atol=1e-5)
        assert np.all(r[:, 1:] < 2.0 - 1e-3)
        assert metrics["ebft/gt_truncated_frac"] == 0.0
        assert metrics["ebft/max_new_tokens"] == max(len(x) for x in gts)
        for k in EBFT_METRICS:
            assert np.isfinite(metrics[k]), k
        adv = algo.advantages(rewards)
        assert adv.shape == (8,) and np.all(np.argmax(adv.reshape(2, 4), axis=1) == 0)
        np.testing.assert_allclose(adv.reshape(2, 4).mean(1), 0.0, atol=1e-5)  # grpo: centred
    finally:
        trainer.close()


def test_feature_network_is_frozen_full_and_lora(tiny_model_dir, tmp_path):
    """Full fine-tune: a frozen copy of the initial weights scores, so training the policy does not
    change the rewards of fixed completions. LoRA: the base weights with adapters off, so the rewards
    equal the full-fine-tune trainer's at initialisation whatever the adapters hold."""
    full = Trainer(_cfg(tiny_model_dir, tmp_path / "f", max_steps=2, save_every=0), progress=False)
    batch = next(full.loader)
    before = _completion_rewards(full, batch)
    full.train()
    full.close()
    assert max_rel_err(full.learner.params, full.algorithm.feature_params) > 1e-4  # the policy moved ...
    np.testing.assert_array_equal(_completion_rewards(full, batch), before)  # ... the rewards did not

    lora = Trainer(_cfg(tiny_model_dir, tmp_path / "l", lora=LoraConfig(rank=2, alpha=4.0)), progress=False)
    try:
        assert lora.algorithm.feature_params is None
        model = lora.learner.model
        rng = np.random.default_rng(0)
        for layer in lora_layers(model).values():
            layer.lora_b.set_value(jnp.asarray(rng.standard_normal(layer.lora_b.shape), jnp.float32))
        lora.learner.params = nnx.state(model, LoRAParam)
        assert max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(lora.learner.params)) > 0.1
        got = _completion_rewards(lora, batch)
        np.testing.assert_allclose(got, before, rtol=1e-5, atol=1e-6)
    finally:
        lora.close()


def test_ground_truth_cross_entropy_gradient(tiny_model_dir, tmp_path):
    """With no policy-gradient signal the update's gradient is ce_coef x the gradient of the mean NLL of
    the ground-truth tokens (+ EOS) given the prompt, independent of the micro-batch split."""
    ebft = EBFTConfig(feature_layers=(1.0,), ce_coef=0.5, adaptive_min_tokens=4)
    trainer = Trainer(_cfg(tiny_model_dir, tmp_path / "ce", ebft=ebft, optim=OptimConfig(micro_batch_size=1)),
                      progress=False)
    algo = trainer.algorithm
    try:
        batch = next(trainer.loader)
        gt = algo.ground_truth_batch(batch, algo.ground_truth_ids(batch))
        assert gt.completion_ids.shape == (2, 8)
        learner = trainer.learner

        def ce(p):
            m = nnx.merge(learner.graphdef, p, learner.frozen)
            lp, _ = completion_logprobs(m, jax.tree.map(jnp.asarray, gt), temperature=1.0)
            return cross_entropy_loss(lp, gt.completion_mask)

        value, want = jax.value_and_grad(ce)(learner.params)
        dummy = random_step_batch(seed=1, n=8)._replace(has_signal=np.zeros(8, bool))
        terms = [algo.update_policy.policy_term(learner, dummy), *algo.loss_terms(learner, EBFTExperience(dummy, gt))]
        acc, collected, skipped = learner.accumulate(terms)
        assert skipped == 8  # every policy micro-batch skipped: only the CE term remains
        assert sum(collected["ebft/ce_loss"]) == pytest.approx(float(value), rel=1e-5)
        assert max_rel_err(acc, jax.tree.map(lambda g: 0.5 * g, want)) <= 1e-5
    finally:
        trainer.close()


# ---------------------------------------------------------------------------------------------
# the loop


def test_run_logs_metrics_and_resumes_exactly(tiny_model_dir, tmp_path):
    from jrl.train.trainer import train

    ebft = EBFTConfig(feature_layers=(0.5, 1.0), ce_coef=0.1, adaptive_min_tokens=4, use_whitening=True,
                      diversity_coef=0.0)
    straight = train(_cfg(tiny_model_dir, tmp_path / "a", ebft=ebft), progress=False)
    assert [r["step"] for r in straight] == [1, 2, 3, 4]
    for row in straight:
        assert 1 <= row["ebft/whiten_rank"] <= 4  # at most n = 4 samples per group
        for k in EBFT_METRICS + ("ebft/ce_loss", "ebft/whiten_rank", "loss", "reward/mean", "grad_norm"):
            assert np.isfinite(row[k]), (k, row[k])
        assert -2.0 <= row["ebft/alignment"] <= 2.0
        assert row["reward/mean"] == pytest.approx(row["ebft/reward"], abs=1e-6)
    # Interrupted after the step-2 checkpoint, resumed to step 4: the same log (constant learning rate).
    train(_cfg(tiny_model_dir, tmp_path / "b", ebft=ebft, max_steps=2), progress=False)
    train(_cfg(tiny_model_dir, tmp_path / "b", ebft=ebft, resume=True), progress=False)
    a, b = read_metrics_log(tmp_path / "a"), read_metrics_log(tmp_path / "b")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b
    # The GRPO pipeline's options hold for EBFT too: a prefetching producer with no staleness
    # allowed (the adaptive limit is computed in its thread) reproduces the synchronous run.
    rollout = RolloutConfig(max_new_tokens=8, temperature=1.0, prefetch_depth=1, max_staleness=0)
    train(_cfg(tiny_model_dir, tmp_path / "c", ebft=ebft, rollout=rollout), progress=False)
    c = read_metrics_log(tmp_path / "c")
    assert [{k: v for k, v in r.items() if not k.startswith("async/")} for r in c] == \
        [{k: v for k, v in r.items() if not k.startswith("async/")} for r in a]
