"""GRPOConfig defaults and validation, and the name registries."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jrl.losses import (
    ADVANTAGE_ESTIMATORS,
    IS_MODES,
    LOSS_TYPES,
    GRPOConfig,
    LossInputs,
    get_importance_sampling_mode,
    get_loss_type,
    grpo_loss,
    register_loss_type,
)
from jrl.losses.registry import Registry


def test_defaults_follow_the_reference():
    c = GRPOConfig()
    assert (c.epsilon, c.epsilon_high, c.effective_epsilon_high, c.epsilon_low) == (0.2, None, 0.2, 0.2)
    assert c.beta == 0.0 and c.delta is None and c.objective == "ppo_clip"
    assert c.scale_rewards == "group" and c.multi_objective_aggregation == "sum_then_normalize"
    assert c.importance_sampling_level == "token"
    assert c.importance_sampling_correction is True
    assert (c.importance_sampling_mode, c.importance_sampling_cap, c.is_ratio_floor) == ("token_truncate", 3.0, None)
    assert c.off_policy_mask_threshold is None and c.top_entropy_quantile == 1.0
    assert c.mask_truncated_completions is False and c.use_bias_correction_kl is False
    assert c.skip_zero_advantage_batches is True
    assert c.loss_type == "dapo" and c.advantage_estimator == "grpo"
    assert GRPOConfig(epsilon=0.2, epsilon_high=0.28).effective_epsilon_high == 0.28


def test_frozen_hashable_and_normalises_weights():
    c = GRPOConfig(reward_weights=[1, 0.5])
    assert c.reward_weights == (1.0, 0.5)
    assert hash(c) == hash(GRPOConfig(reward_weights=(1.0, 0.5)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.beta = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    "field, value, fix",
    [
        ("num_generations", 0, "group size"),
        ("num_generations", True, "group size"),
        ("scale_rewards", True, "True meant 'group'"),
        ("scale_rewards", "std", "'group', 'batch', 'none'"),
        ("multi_objective_aggregation", "mean", "normalize_then_sum"),
        ("advantage_estimator", "ppo", "'grpo', 'reinforce', 'rloo'"),
        ("loss_type", "clip_cov", "'bnpo', 'dapo', 'dr_grpo', 'grpo'"),
        ("reward_weights", (), "one float per reward function"),
        ("reward_weights", (1.0, float("nan")), "one float per reward function"),
        ("max_completion_length", 0, "generation limit"),
        ("epsilon", 1.0, "0.2"),
        ("epsilon_high", -0.1, "0.28"),
        ("delta", 1.0, "1 + epsilon_high"),
        ("importance_sampling_level", "segment", "sequence_token"),
        ("objective", "ppo", "'cispo', 'ppo_clip'"),
        ("beta", -0.1, "0.04"),
        ("use_bias_correction_kl", 1, "True or False"),
        ("top_entropy_quantile", 0.0, "1.0 (off)"),
        ("importance_sampling_mode", "token_clip", "'sequence_mask', 'sequence_truncate', 'token_mask', 'token_truncate'"),
        ("importance_sampling_cap", 0.5, "3.0"),
        ("is_ratio_floor", 2.0, "1 / importance_sampling_cap"),
        ("off_policy_mask_threshold", float("inf"), "0.5"),
        ("metrics", "all", "'basic' or 'full'"),
    ],
)
def test_validation_names_field_value_and_fix(field, value, fix):
    with pytest.raises(ValueError) as e:
        GRPOConfig(**{field: value})
    msg = str(e.value)
    assert f"GRPOConfig.{field}={value!r}" in msg and "Fix:" in msg and fix in msg, msg


def test_cross_field_validation():
    with pytest.raises(ValueError, match="num_generations >= 2"):
        GRPOConfig(advantage_estimator="rloo", num_generations=1)
    with pytest.raises(ValueError, match="sum_then_normalize"):
        GRPOConfig(advantage_estimator="rloo", multi_objective_aggregation="normalize_then_sum")


def test_registry_lists_names_on_error():
    assert set(LOSS_TYPES.names()) >= {"grpo", "bnpo", "dr_grpo", "dapo"}
    assert set(ADVANTAGE_ESTIMATORS.names()) >= {"grpo", "rloo"}
    assert set(IS_MODES.names()) >= {"token_truncate", "token_mask", "sequence_truncate", "sequence_mask"}
    with pytest.raises(KeyError, match="registered: 'bnpo', 'dapo', 'dr_grpo', 'grpo'"):
        get_loss_type("nope")
    with pytest.raises(KeyError, match="importance_sampling_mode"):
        get_importance_sampling_mode("nope")


def test_registering_a_loss_type_makes_it_selectable():
    reg = Registry("thing", "thing")
    reg.register("a")(len)
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a")(abs)
    reg.register("a", override=True)(abs)
    assert reg.get("a") is abs

    @register_loss_type("test_token_sum")
    def _token_sum(mask, normalizers, max_completion_length):
        return jnp.ones(mask.shape[:1], mask.dtype), jnp.asarray(1.0, mask.dtype)

    try:
        cfg = GRPOConfig(loss_type="test_token_sum")
        lp = jnp.zeros((2, 3))
        inp = LossInputs(advantages=jnp.array([1.0, -2.0]), completion_mask=jnp.ones((2, 3)), logprobs=lp)
        loss, _ = grpo_loss(inp, cfg)
        np.testing.assert_allclose(float(loss), -(3 * 1.0 + 3 * -2.0))
    finally:
        LOSS_TYPES._entries.pop("test_token_sum")
