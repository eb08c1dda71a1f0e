"""Sampler IS weights (docs/algorithms/grpo.md §7, open points 1 and 14), OPSM (§8) and the entropy mask (§9)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses_reference_np as ref
from jrl.losses import (
    GRPOConfig,
    LossInputs,
    entropy_keep,
    entropy_threshold,
    grpo_loss,
    importance_weights,
    opsm_keep,
)
from losses_testutil import random_batch, ref_kwargs, to_inputs

MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def _hand_case():
    # three sequences of two tokens; token ratios r = exp(old − samp)
    r = np.array([[2.0, 2.0], [0.5, 3.0], [0.5, 0.5]])
    old = np.log(r)
    return old, np.zeros_like(old), np.ones_like(old)


@pytest.mark.parametrize(
    "mode, floor, want_tokens",
    [
        ("token_truncate", None, [[2.0, 2.0], [0.5, 2.0], [0.5, 0.5]]),
        ("token_truncate", 0.75, [[2.0, 2.0], [0.75, 2.0], [0.75, 0.75]]),
        ("token_mask", None, [[2.0, 2.0], [0.5, 0.0], [0.5, 0.5]]),
        ("token_mask", 0.75, [[2.0, 2.0], [0.0, 0.0], [0.0, 0.0]]),
        # sequence ratios: 4.0, 1.5, 0.25
        ("sequence_truncate", None, [[2.0, 2.0], [1.5, 1.5], [0.25, 0.25]]),
        ("sequence_truncate", 0.5, [[2.0, 2.0], [1.5, 1.5], [0.5, 0.5]]),
        ("sequence_mask", None, [[0.0, 0.0], [1.5, 1.5], [0.25, 0.25]]),
        ("sequence_mask", 0.5, [[0.0, 0.0], [1.5, 1.5], [0.0, 0.0]]),
    ],
)
def test_is_modes_hand_computed(mode, floor, want_tokens):
    """Cap C = 2. A masked unit weighs 0, never 1/C (open point 1); truncation is one-sided by default."""
    old, samp, m = _hand_case()
    with jax.enable_x64(True):
        w = importance_weights(jnp.asarray(old), jnp.asarray(samp), jnp.asarray(m), mode=mode, cap=2.0, floor=floor)
    np.testing.assert_allclose(np.asarray(w.weights), want_tokens, rtol=1e-12)
    ref_w, _ = ref.is_weights_ref(old, samp, m, mode, 2.0, floor)
    np.testing.assert_allclose(np.asarray(w.weights), ref_w, rtol=1e-12)
    assert w.unit_ratio.shape == ((3, 2) if mode.startswith("token") else (3, 1))


@pytest.mark.parametrize("floor", [None, 1 / 3])
@pytest.mark.parametrize("mode", MODES)
def test_is_modes_in_the_loss_match_reference(mode, floor):
    batch = random_batch(seed=11)
    cfg = GRPOConfig(num_generations=2, importance_sampling_mode=mode, importance_sampling_cap=1.5, is_ratio_floor=floor)
    with jax.enable_x64(True):
        got = float(grpo_loss(to_inputs(batch), cfg)[0])
    want, _, _ = ref.loss_ref(cfg, **ref_kwargs(batch))
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)


def test_missing_sampler_logprobs_count_as_zero_difference():
    old = jnp.array([[-1.0, -2.0, -3.0]])
    samp = jnp.array([[jnp.nan, -1.0, jnp.nan]])
    w = importance_weights(old, samp, jnp.ones((1, 3)), mode="token_truncate", cap=3.0)
    np.testing.assert_allclose(np.asarray(w.weights), [[1.0, np.exp(-1.0), 1.0]], rtol=1e-6)
    w = importance_weights(old, samp, jnp.ones((1, 3)), mode="sequence_mask", cap=3.0)
    np.testing.assert_allclose(np.asarray(w.weights), [[np.exp(-1.0)] * 3], rtol=1e-6)


def test_is_weights_carry_no_gradient():
    old, samp = jnp.array([[-1.0, -2.0]]), jnp.array([[-1.5, -1.0]])
    g = jax.grad(lambda o: importance_weights(o, samp, jnp.ones((1, 2))).weights.sum())(old)
    assert np.all(np.asarray(g) == 0.0)


@pytest.mark.parametrize("mode, want", [("sequence_mask", 0.0), ("sequence_truncate", 3.0)])
def test_long_sequence_cannot_overflow(mode, want):
    """Open point 14: 4096 tokens with d = 0.1 each (Σd = 409.6, e^409.6 = inf in float32)."""
    t = 4096
    lp = jnp.full((2, t), -1.0, jnp.float32)
    inp = LossInputs(
        advantages=jnp.array([1.0, -1.0]),
        completion_mask=jnp.ones((2, t)),
        logprobs=lp,
        old_logprobs=lp,
        sampler_logprobs=lp - 0.1,
    )
    cfg = GRPOConfig(num_generations=2, importance_sampling_mode=mode, importance_sampling_level="sequence")
    w = importance_weights(lp, lp - 0.1, jnp.ones((2, t)), mode=mode, cap=3.0)
    np.testing.assert_allclose(np.asarray(w.weights), want)
    (loss, met), g = jax.value_and_grad(lambda x: grpo_loss(inp._replace(logprobs=x), cfg), has_aux=True)(lp)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(g)))
    assert all(np.isfinite(float(v)) for v in met.values())
    assert float(met["sampling/importance_sampling_ratio/frac_masked"]) == (1.0 if want == 0.0 else 0.0)


# ---------------------------------------------------------------------------------------------
# OPSM


def test_opsm_drops_only_negative_advantage_off_policy_sequences():
    lp = jnp.zeros((4, 2))
    samp = jnp.array([[1.0, 1.0], [1.0, 1.0], [0.2, 0.2], [jnp.nan, jnp.nan]])
    old = jnp.array([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [2.0, 2.0]])
    adv = jnp.array([-1.0, 1.0, -1.0, -1.0])
    m = jnp.ones((4, 2))
    filled = jnp.where(jnp.isnan(samp), old, samp)  # the loss's fallback for missing sampler log-probs
    np.testing.assert_array_equal(np.asarray(opsm_keep(lp, filled, adv, m, 0.5)), [False, True, True, False])
    # In the loss: dropped sequences get no policy gradient, and the metric counts them.
    cfg = GRPOConfig(num_generations=2, off_policy_mask_threshold=0.5, importance_sampling_correction=False)
    inp = LossInputs(advantages=adv, completion_mask=m, logprobs=lp, old_logprobs=old, sampler_logprobs=samp)
    g, met = jax.grad(lambda x: grpo_loss(inp._replace(logprobs=x), cfg), has_aux=True)(lp)
    g = np.asarray(g)
    assert np.all(g[[0, 3]] == 0.0) and np.all(g[[1, 2]] != 0.0)
    assert float(met["opsm/frac_masked"]) == 0.5


def test_opsm_without_sampler_uses_old_logprobs():
    lp = jnp.zeros((2, 3))
    old = jnp.array([[1.0, 1.0, 1.0], [0.1, 0.1, 0.1]])
    cfg = GRPOConfig(num_generations=2, off_policy_mask_threshold=0.5)
    inp = LossInputs(advantages=jnp.array([-1.0, -1.0]), completion_mask=jnp.ones((2, 3)), logprobs=lp, old_logprobs=old)
    _, met = grpo_loss(inp, cfg)
    assert float(met["opsm/frac_masked"]) == 0.5


@pytest.mark.parametrize("thr", [0.0, 0.2])
def test_opsm_in_the_loss_matches_reference(thr):
    batch = random_batch(seed=12)
    cfg = GRPOConfig(num_generations=2, off_policy_mask_threshold=thr, loss_type="grpo")
    with jax.enable_x64(True):
        got, met = grpo_loss(to_inputs(batch), cfg)
    want, _, ex = ref.loss_ref(cfg, **ref_kwargs(batch))
    np.testing.assert_allclose(float(got), want, rtol=1e-10, atol=1e-12)
    m = ref.loss_mask_ref(batch["cm"], batch["tool"])
    nonempty = m.sum(1) > 0
    np.testing.assert_allclose(float(met["opsm/frac_masked"]), np.mean(~ex["opsm_keep"][nonempty]))


# ---------------------------------------------------------------------------------------------
# entropy mask


@pytest.mark.parametrize("q", [0.2, 0.5, 0.9])
def test_entropy_threshold_is_the_masked_quantile(q):
    batch = random_batch(seed=13, b=5, t=7)
    m = ref.loss_mask_ref(batch["cm"], batch["tool"])
    with jax.enable_x64(True):
        thr = float(entropy_threshold(jnp.asarray(batch["ent"]), jnp.asarray(m), q))
    vals = [batch["ent"][i, j] for i, j in zip(*np.nonzero(m))]
    np.testing.assert_allclose(thr, ref.quantile_linear(vals, 1 - q), rtol=1e-12)
    kept = np.asarray(entropy_keep(jnp.asarray(batch["ent"]), thr))[m > 0]
    assert abs(kept.mean() - q) <= 1.0 / len(vals) + 1e-12
    assert float(entropy_threshold(jnp.ones((2, 3)), jnp.zeros((2, 3)), q)) == -np.inf


def test_entropy_mask_in_the_loss():
    batch = random_batch(seed=14)
    cfg = GRPOConfig(num_generations=2, top_entropy_quantile=0.4, loss_type="dr_grpo")
    with jax.enable_x64(True):
        inp = to_inputs(batch, sampler_logprobs=None)
        local = float(grpo_loss(inp, cfg)[0])
        glob = float(grpo_loss(inp, cfg, entropy_threshold=jnp.asarray(1.3))[0])
        g = np.asarray(jax.grad(lambda x: grpo_loss(inp._replace(logprobs=x), cfg, entropy_threshold=jnp.asarray(1.3))[0])(inp.logprobs))
    np.testing.assert_allclose(local, ref.loss_ref(cfg, **ref_kwargs(batch, samp=None))[0], rtol=1e-10)
    np.testing.assert_allclose(glob, ref.loss_ref(cfg, **ref_kwargs(batch, samp=None), ent_thr=1.3)[0], rtol=1e-10)
    assert np.all(g[batch["ent"] < 1.3] == 0.0)
    with pytest.raises(ValueError, match="needs entropies"):
        grpo_loss(to_inputs(batch, jnp.float32, entropy=None), cfg)


def test_cap_log_space_matches_linear_space_near_the_cap():
    """Mask keeps r ≤ C and drops r > C (TRL's rule), decided in log space."""
    c = 3.0
    with jax.enable_x64(True):
        old = jnp.log(jnp.array([[c * (1 - 1e-9), c * (1 + 1e-9)]]))
        w = importance_weights(old, jnp.zeros((1, 2)), jnp.ones((1, 2)), mode="token_mask", cap=c)
    np.testing.assert_allclose(np.asarray(w.weights), [[c * (1 - 1e-9), 0.0]], rtol=1e-12)
    w = importance_weights(jnp.log(jnp.array([[10.0]])), jnp.zeros((1, 1)), jnp.ones((1, 1)), cap=c)
    assert math.isclose(float(w.weights[0, 0]), c, rel_tol=1e-6)
