"""Metrics (docs/algorithms/grpo.md §13) against float64 NumPy references, their names and reductions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses_reference_np as ref
from jrl.losses import GRPOConfig, LossInputs, completion_metrics, grpo_loss, metric_reduction
from losses_testutil import random_batch, to_inputs

POLICY_BASIC = {
    "advantage",
    "advantage_std",
    "max_advantage",
    "min_advantage",
    "clip_ratio/low_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_mean",
    "clip_ratio/high_max",
    "clip_ratio/region_mean",
    "clipped_ratio_fraction",
    "ratio_new_old",
    "ratio_new_old_sum",
    "ratio_new_old_squared_sum",
    "kl_new_old",
    "num_tokens",
}
FULL_EXTRA = {"ess_frac", "new_logprobs", "old_logprobs", "entropy"}
SAMPLER = {
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/max",
    "sampling/importance_sampling_ratio/frac_masked",
    "sampling/frac_missing_logprobs",
}


def _batch(seed):
    b = random_batch(seed=seed, b=5, t=6)
    b["old"] = b["lp"] + np.random.default_rng(seed).normal(0, 0.5, b["lp"].shape)  # some ratios clip
    return b


@pytest.mark.parametrize(
    "kw",
    [
        dict(importance_sampling_level="token", metrics="full", beta=0.1),
        dict(importance_sampling_level="token", metrics="basic", mask_truncated_completions=True),
        dict(importance_sampling_level="sequence", metrics="full", epsilon=0.05, epsilon_high=0.1),
        dict(importance_sampling_level="sequence_token", metrics="full", epsilon=0.05, beta=0.1),
    ],
)
def test_policy_metrics_match_reference(kw):
    batch = _batch(seed=20)
    cfg = GRPOConfig(num_generations=2, importance_sampling_correction=False, **kw)
    with jax.enable_x64(True):
        _, got = grpo_loss(to_inputs(batch), cfg)
    want = ref.policy_metrics_ref(
        cfg, **{k: batch[k] for k in ("lp", "adv", "cm", "old", "ref", "ent", "tool", "trunc")}
    )
    expected = POLICY_BASIC | ({"kl"} if cfg.beta else set()) | (FULL_EXTRA if cfg.metrics == "full" else set())
    assert set(got) == expected
    assert set(want) == expected
    for k, v in want.items():
        np.testing.assert_allclose(float(got[k]), v, rtol=1e-10, atol=1e-12, err_msg=k)
    # the clip metrics are not all trivially zero in this batch
    assert float(got["clip_ratio/region_mean"]) > 0 and float(got["clipped_ratio_fraction"]) > 0


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_sampler_metrics_match_reference(mode):
    batch = _batch(seed=21)
    cfg = GRPOConfig(num_generations=2, importance_sampling_mode=mode, importance_sampling_cap=1.3, metrics="basic")
    with jax.enable_x64(True):
        _, got = grpo_loss(to_inputs(batch), cfg)
    want = ref.sampler_metrics_ref(cfg, old=batch["old"], samp=batch["samp"], cm=batch["cm"], tool=batch["tool"])
    assert set(got) == POLICY_BASIC | SAMPLER
    for k, v in want.items():
        np.testing.assert_allclose(float(got[k]), v, rtol=1e-10, atol=1e-12, err_msg=k)
    if mode.endswith("mask"):
        assert float(got["sampling/importance_sampling_ratio/frac_masked"]) > 0


def test_all_metric_names_with_everything_on():
    batch = _batch(seed=22)
    cfg = GRPOConfig(num_generations=2, beta=0.1, off_policy_mask_threshold=0.5, top_entropy_quantile=0.5)
    with jax.enable_x64(True):
        _, got = grpo_loss(to_inputs(batch), cfg)
    assert set(got) == POLICY_BASIC | FULL_EXTRA | SAMPLER | {"kl", "opsm/frac_masked"}
    assert all(v.shape == () for v in got.values())
    assert 0.0 < float(got["ess_frac"]) <= 1.0


def test_metrics_on_an_empty_micro_batch_are_finite_zeros():
    cfg = GRPOConfig(num_generations=2, beta=0.1, off_policy_mask_threshold=0.5, top_entropy_quantile=0.5)
    z = jnp.zeros((3, 4))
    inp = LossInputs(
        advantages=jnp.zeros(3),
        completion_mask=z,
        logprobs=z - 1,
        old_logprobs=z,
        ref_logprobs=z,
        sampler_logprobs=z + jnp.nan,
        entropy=z,
    )
    loss, got = grpo_loss(inp, cfg)
    assert float(loss) == 0.0
    for k, v in got.items():
        assert np.isfinite(float(v)), k
        assert float(v) == 0.0, k


def test_ratio_metrics_at_ratio_one():
    batch = _batch(seed=23)
    cfg = GRPOConfig(num_generations=2)
    with jax.enable_x64(True):
        _, got = grpo_loss(to_inputs(batch, old_logprobs=None, sampler_logprobs=None), cfg)
    n_tok = ref.loss_mask_ref(batch["cm"], batch["tool"]).sum()
    assert float(got["ratio_new_old"]) == 1.0 and float(got["kl_new_old"]) == 0.0
    assert float(got["ratio_new_old_sum"]) == n_tok == float(got["ratio_new_old_squared_sum"])
    assert float(got["ess_frac"]) == 1.0 and float(got["clip_ratio/region_mean"]) == 0.0


def test_completion_metrics_match_reference():
    cm = np.array([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]], float)
    trunc = np.array([False, True, False, True])
    got = completion_metrics(jnp.asarray(cm), jnp.asarray(trunc))
    want = ref.completion_metrics_ref(cm, trunc)
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(float(got[k]), v, rtol=1e-7, err_msg=k)
    jitted = jax.jit(jax.vmap(completion_metrics))(jnp.asarray(cm)[None], jnp.asarray(trunc)[None])
    for k, v in want.items():
        np.testing.assert_allclose(float(jitted[k][0]), v, rtol=1e-7, err_msg=k)
    none_term = completion_metrics(jnp.asarray(cm), jnp.ones(4, bool))
    assert float(none_term["completions/min_terminated_length"]) == 0.0
    assert float(none_term["completions/clipped_ratio"]) == 1.0


def test_metric_reduction():
    assert metric_reduction("num_tokens") == "sum"
    assert metric_reduction("clip_ratio/low_min") == "min"
    assert metric_reduction("clip_ratio/high_max") == "max"
    assert metric_reduction("sampling/importance_sampling_ratio/max") == "max"
    assert metric_reduction("min_advantage") == "min"
    assert metric_reduction("rewards/acc/mean") == "mean"
    assert metric_reduction("clip_ratio/region_mean") == "mean"
