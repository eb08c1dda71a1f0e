"""The CISPO objective, selected by name, against a float64 NumPy reference written as TRL computes
``loss_type="cispo"`` (an absolute cap ε_max on the gradient-stopped IS weight, no lower clip; value and gradient),
and the check that warns when a cap looks like ppo_clip's ``1 + ε`` convention."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from losses_testutil import loss_and_grad

from jrl.losses import OBJECTIVES, GRPOConfig, LossInputs, grpo_loss

# TRL: GRPOConfig(loss_type="cispo", epsilon_high=5.0) -> jrl: the same cap in the same field.
CFG = dict(objective="cispo", loss_type="dapo", epsilon_high=5.0, importance_sampling_correction=False,
           metrics="basic")


def trl_cispo(lp, old, adv, cm, epsilon_high):
    """(loss, d loss / d lp) in float64 as TRL: ``clamp(coef_1, max=epsilon_high).detach() * A * logp``, negated,
    aggregated DAPO-style Σ ℓ m / Σ m."""
    w = np.minimum(np.exp(lp - old), epsilon_high)
    z = max(cm.sum(), 1.0)
    per_token = -w * adv[:, None] * lp
    return float((per_token * cm).sum() / z), -w * adv[:, None] * cm / z


def _inputs(seed):
    rng = np.random.default_rng(seed)
    b, t = 5, 7
    lp = -rng.gamma(1.0, 1.0, (b, t)) - 0.01
    old = lp + rng.normal(0.0, 1.2, (b, t))  # ratios from ~0.03 to ~30: both below 1 - ε and above the cap
    adv = rng.normal(0.0, 1.0, b)
    cm = (np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]).astype(np.float64)
    return lp, old, adv, cm


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_matches_trl_in_float64(seed):
    lp, old, adv, cm = _inputs(seed)
    assert (np.exp(lp - old) > 5.0).any() and (np.exp(lp - old) < 0.8).any()  # both sides exercised
    want, want_grad = trl_cispo(lp, old, adv, cm, 5.0)
    got, grad = loss_and_grad(GRPOConfig(**CFG), lp, old, adv, cm)
    assert np.isfinite(got)
    assert abs(got - want) <= 1e-12 * max(1.0, abs(want))
    np.testing.assert_allclose(grad, want_grad, rtol=1e-12, atol=1e-15)


def test_cispo_default_cap_is_five():
    lp, old, adv, cm = _inputs(3)
    want, _ = trl_cispo(lp, old, adv, cm, 5.0)
    got, _ = loss_and_grad(GRPOConfig(**{**CFG, "epsilon_high": None}), lp, old, adv, cm)
    assert abs(got - want) <= 1e-12 * max(1.0, abs(want))


def test_cispo_keeps_the_gradient_of_clipped_tokens_that_ppo_clip_drops():
    """A token far above the trust region with A > 0: PPO's clip zeroes its gradient, CISPO keeps it, capped."""
    lp, old = jnp.asarray([[-0.5]]), jnp.asarray([[-2.5]])  # ratio e^2 ≈ 7.4: above 1.28 and above the cap 5
    inputs = dict(advantages=jnp.asarray([1.0]), completion_mask=jnp.ones((1, 1)), old_logprobs=old)
    grads = {}
    for name, extra in (("ppo_clip", dict(epsilon_high=0.28)), ("cispo", {})):
        cfg = GRPOConfig(**{**CFG, "objective": name, **extra})
        grads[name] = float(jax.grad(lambda x, c=cfg: grpo_loss(LossInputs(logprobs=x, **inputs), c)[0])(lp)[0, 0])
    assert grads["ppo_clip"] == 0.0
    assert grads["cispo"] == pytest.approx(-5.0)
    assert "cispo" in OBJECTIVES and "ppo_clip" in OBJECTIVES


def test_a_ppo_style_cap_warns_and_names_the_convention():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        GRPOConfig(objective="cispo", epsilon_high=0.28)
        GRPOConfig(objective="cispo", epsilon_high=4.0)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert len(messages) == 1 and "epsilon_high=0.28" in messages[0] and "absolute" in messages[0]


def test_delta_is_refused_outside_ppo_clip():
    with pytest.raises(ValueError, match=r"GRPOConfig\.delta=2\.0.*only objective='ppo_clip'"):
        GRPOConfig(objective="cispo", delta=2.0)
