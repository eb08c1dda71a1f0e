"""The CISPO objective, selected by name, against a float64 NumPy reference (value and gradient)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.losses import OBJECTIVES, GRPOConfig, LossInputs, grpo_loss

CFG = dict(objective="cispo", loss_type="dapo", epsilon=0.2, epsilon_high=0.28, importance_sampling_correction=False,
           metrics="basic")


def cispo_ref(lp, old, adv, cm, eps_low, eps_high):
    """(loss, d loss / d lp) in float64: ℓ_t = −clip(exp(lp − old), 1 − ε_low, 1 + ε_high)·A·lp (the weight a
    constant), DAPO aggregation Σ ℓ m / Σ m."""
    w = np.clip(np.exp(lp - old), 1.0 - eps_low, 1.0 + eps_high)
    z = max(cm.sum(), 1.0)
    per_token = -w * adv[:, None] * lp
    return float((per_token * cm).sum() / z), -w * adv[:, None] * cm / z


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cispo_matches_float64_reference(seed):
    rng = np.random.default_rng(seed)
    b, t = 5, 7
    lp = -rng.gamma(1.0, 1.0, (b, t)) - 0.01
    old = lp + rng.normal(0.0, 0.5, (b, t))  # many ratios outside [0.8, 1.28]
    adv = rng.normal(0.0, 1.0, b)
    cm = (np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]).astype(np.float64)
    cfg = GRPOConfig(**CFG)
    want, want_grad = cispo_ref(lp, old, adv, cm, 0.2, 0.28)

    def loss(x):
        inputs = LossInputs(advantages=jnp.asarray(adv), completion_mask=jnp.asarray(cm), logprobs=x,
                            old_logprobs=jnp.asarray(old))
        return grpo_loss(inputs, cfg)[0]

    with jax.enable_x64(True):
        got, grad = jax.value_and_grad(loss)(jnp.asarray(lp))
    assert np.isfinite(float(got))
    assert abs(float(got) - want) <= 1e-12 * max(1.0, abs(want))
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-12, atol=1e-15)


def test_cispo_keeps_the_gradient_of_clipped_tokens_that_ppo_clip_drops():
    """A token far above the trust region with A > 0: PPO's clip zeroes its gradient, CISPO does not."""
    lp, old = jnp.asarray([[-0.5]]), jnp.asarray([[-2.0]])  # ratio e^1.5 ≈ 4.5 > 1.28
    inputs = dict(advantages=jnp.asarray([1.0]), completion_mask=jnp.ones((1, 1)), old_logprobs=old)
    grads = {}
    for name in ("ppo_clip", "cispo"):
        cfg = GRPOConfig(**{**CFG, "objective": name})
        grads[name] = float(jax.grad(lambda x, c=cfg: grpo_loss(LossInputs(logprobs=x, **inputs), c)[0])(lp)[0, 0])
    assert grads["ppo_clip"] == 0.0
    assert grads["cispo"] == pytest.approx(-1.28)
    assert "cispo" in OBJECTIVES and "ppo_clip" in OBJECTIVES
