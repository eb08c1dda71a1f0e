"""Advantages, signal flags and reward metrics against float64 NumPy references (docs/algorithms/grpo.md §1, §13.1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses_reference_np as ref
from jrl.losses import (
    GRPOConfig,
    advantages_from_config,
    compute_advantages,
    group_has_signal,
    group_zero_std,
    reward_metrics,
    rloo_advantages,
    sequence_has_signal,
)

G = 4


def _rewards(seed=0, n=12, k=3, nan_frac=0.15):
    rng = np.random.default_rng(seed)
    r = rng.normal(size=(n, k))
    r[rng.random((n, k)) < nan_frac] = np.nan
    r[0:G, 0] = 1.0  # a function constant in group 0
    r[G : 2 * G, 1] = np.nan  # a function that returned None for a whole group
    r[2 * G + 1, :] = np.nan  # a completion with no reward at all
    return r


W = (1.0, 0.5, 2.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_sum_then_normalize_matches_reference(scale):
    r = _rewards()
    with jax.enable_x64(True):
        got = compute_advantages(jnp.asarray(r), group_size=G, reward_weights=W, scale_rewards=scale)
        assert got.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(got), ref.adv_sum_then_normalize(r, G, W, scale), rtol=1e-12, atol=1e-12)


def test_normalize_then_sum_matches_reference():
    r = _rewards(seed=1)
    with jax.enable_x64(True):
        got = compute_advantages(jnp.asarray(r), group_size=G, reward_weights=W, aggregation="normalize_then_sum")
    np.testing.assert_allclose(np.asarray(got), ref.adv_normalize_then_sum(r, G, W), rtol=1e-12, atol=1e-12)


def test_normalize_then_sum_ignores_scale_rewards():
    r = _rewards(seed=2)
    outs = [
        compute_advantages(jnp.asarray(r), group_size=G, aggregation="normalize_then_sum", scale_rewards=s)
        for s in ("group", "batch", "none")
    ]
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(outs[0], outs[2])


def test_rloo_matches_explicit_leave_one_out():
    r = _rewards(seed=3)
    with jax.enable_x64(True):
        got = compute_advantages(jnp.asarray(r), group_size=G, estimator="rloo", reward_weights=W)
        direct = rloo_advantages(jnp.asarray(r), group_size=G, reward_weights=W)
    np.testing.assert_allclose(np.asarray(got), ref.adv_rloo(r, G, W), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(got, direct)


def test_group_size_one_gives_zero_std():
    r = np.array([[1.0], [2.0], [5.0]])
    with jax.enable_x64(True):
        for scale, expect in (("group", np.zeros(3)), ("none", np.zeros(3))):
            got = compute_advantages(jnp.asarray(r), group_size=1, scale_rewards=scale)
            np.testing.assert_allclose(np.asarray(got), expect, atol=0)
        gdpo = compute_advantages(jnp.asarray(r), group_size=1, aggregation="normalize_then_sum")
        np.testing.assert_allclose(np.asarray(gdpo), ref.adv_normalize_then_sum(r, 1), atol=1e-12)
        assert np.all(np.asarray(group_zero_std(jnp.asarray(r), group_size=1)))
    with pytest.raises(ValueError, match="num_generations >= 2"):
        rloo_advantages(jnp.asarray(r), group_size=1)


def test_all_nan_completion_sums_to_zero():
    r = np.array([[1.0, np.nan], [np.nan, np.nan], [0.0, 2.0], [3.0, np.nan]])
    with jax.enable_x64(True):
        got = compute_advantages(jnp.asarray(r), group_size=2, scale_rewards="none")
    np.testing.assert_allclose(np.asarray(got), [0.5, -0.5, -0.5, 0.5])


def test_zero_std_flags_and_frac_match_reference():
    rng = np.random.default_rng(4)
    r = rng.integers(0, 2, size=(6 * G, 2)).astype(float)
    r[0:G] = [1.0, 0.0]
    r[G : 2 * G] = [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.5, 0.5]]  # constant combined reward
    r[2 * G : 3 * G] = 0.1  # constant, inexact in float32 means
    got = group_zero_std(jnp.asarray(r, jnp.float32), group_size=G)
    np.testing.assert_array_equal(np.asarray(got), ref.zero_std_groups(r, G))
    assert bool(got[0]) and bool(got[1]) and bool(got[2])
    m = reward_metrics(jnp.asarray(r, jnp.float32), group_size=G)
    np.testing.assert_allclose(float(m["frac_reward_zero_std"]), np.mean(ref.zero_std_groups(r, G)))


def test_frac_reward_zero_std_is_independent_of_mode():
    """Open point 12: one definition (group std of the combined raw reward) whatever the mode."""
    r = _rewards(seed=5)
    flags = group_zero_std(jnp.asarray(r), group_size=G, reward_weights=W)
    np.testing.assert_array_equal(np.asarray(flags), ref.zero_std_groups(r, G, W))


def test_group_has_signal_sum_then_normalize():
    r = np.array([[1.0], [1.0], [0.0], [1.0], [0.3], [0.3]])
    got = group_has_signal(jnp.asarray(r), group_size=2)
    np.testing.assert_array_equal(np.asarray(got), [False, True, False])
    np.testing.assert_array_equal(np.asarray(sequence_has_signal(got, 2)), [0, 0, 1, 1, 0, 0])


def test_group_has_signal_gdpo_cancellation():
    """Combined reward constant, but GDPO's per-function normalisation still gives a signal."""
    r = np.array([[1.0, 0.0, 0.0], [0.0, 0.5, 0.5], [1.0, 1.0, np.nan], [1.0, 1.0, np.nan]])
    sum_flags = group_has_signal(jnp.asarray(r), group_size=2)
    gdpo_flags = group_has_signal(jnp.asarray(r), group_size=2, aggregation="normalize_then_sum")
    np.testing.assert_array_equal(np.asarray(sum_flags), [False, False])
    np.testing.assert_array_equal(np.asarray(gdpo_flags), [True, False])
    with jax.enable_x64(True):
        a = compute_advantages(jnp.asarray(r), group_size=2, aggregation="normalize_then_sum")
    assert abs(float(a[0])) > 0.1  # the signal is real
    # A zero-weight function cannot carry a signal.
    no_w = group_has_signal(jnp.asarray(r), group_size=2, reward_weights=(0.0, 0.0, 0.0), aggregation="normalize_then_sum")
    np.testing.assert_array_equal(np.asarray(no_w), [False, False])


def test_gdpo_zero_variance_group_is_tiny_but_flagged():
    """§1.3 / open point 13: GDPO zero-variance groups are ≈0 but flagged by raw rewards, not A == 0."""
    rng = np.random.default_rng(6)
    r = rng.normal(size=(8 * G, 2)).astype(np.float32)
    r[0:G] = [0.3, 0.7]
    a = compute_advantages(jnp.asarray(r), group_size=G, aggregation="normalize_then_sum")
    assert np.all(np.abs(np.asarray(a[:G])) < 1e-5)
    flags = group_has_signal(jnp.asarray(r), group_size=G, aggregation="normalize_then_sum")
    assert not bool(flags[0]) and bool(np.all(np.asarray(flags[1:])))


def test_reward_metrics_match_reference():
    r = _rewards(seed=7)
    r[:, 2] = np.nan  # a function that never returned a value
    names = ("acc", "fmt", "len")
    with jax.enable_x64(True):
        got = reward_metrics(jnp.asarray(r), group_size=G, reward_weights=W, reward_names=names)
    want = ref.reward_metrics_ref(r, G, W, list(names))
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_allclose(float(got[k]), v, rtol=1e-12, atol=1e-12, err_msg=k)
    assert np.isnan(float(got["rewards/len/mean"]))


def test_from_config_and_errors():
    r = _rewards(seed=8)
    cfg = GRPOConfig(num_generations=G, reward_weights=W, scale_rewards="batch")
    np.testing.assert_allclose(
        np.asarray(advantages_from_config(jnp.asarray(r, jnp.float32), cfg)),
        ref.adv_sum_then_normalize(r, G, W, "batch"),
        rtol=1e-5,
        atol=1e-5,
    )
    with pytest.raises(ValueError, match="multiple of group_size"):
        compute_advantages(jnp.ones((5, 1)), group_size=2)
    with pytest.raises(ValueError, match="one weight per function"):
        compute_advantages(jnp.ones((4, 2)), group_size=2, reward_weights=(1.0,))
    with pytest.raises(ValueError, match="scale_rewards"):
        compute_advantages(jnp.ones((4, 1)), group_size=2, scale_rewards="groups")
    with pytest.raises(KeyError, match="registered: 'grpo', 'reinforce', 'rloo'"):
        compute_advantages(jnp.ones((4, 1)), group_size=2, estimator="ppo")


def test_jit_and_vmap():
    r = np.stack([_rewards(seed=s) for s in range(3)])  # [M, N, K]
    f = jax.jit(compute_advantages, static_argnames=("group_size", "estimator", "scale_rewards", "aggregation"))
    for agg in ("sum_then_normalize", "normalize_then_sum"):
        batched = jax.vmap(lambda x: f(x, group_size=G, reward_weights=W, aggregation=agg))(jnp.asarray(r, jnp.float32))
        for i in range(3):
            want = f(jnp.asarray(r[i], jnp.float32), group_size=G, reward_weights=W, aggregation=agg)
            np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(want), rtol=1e-6, atol=1e-6)
