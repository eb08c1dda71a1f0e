"""SAPO and VESPO, selected by name, against float64 NumPy references of their published formulas (which TRL's
``loss_type="sapo"`` / ``"vespo"`` implement with the same defaults): value and gradient on fresh random inputs,
and their config fields refused under other objectives."""

import numpy as np
import pytest
from losses_testutil import loss_and_grad

from jrl.losses import OBJECTIVES, GRPOConfig


def _inputs(seed, b=6, t=9):
    rng = np.random.default_rng(seed)
    lp = -rng.gamma(1.0, 1.0, (b, t)) - 0.01
    old = lp + rng.normal(0.0, 0.4, (b, t))
    adv = rng.normal(0.0, 1.0, b)
    adv[0] = 0.0  # A = 0 takes the negative branch in SAPO, the non-negative one in VESPO
    cm = (np.arange(t)[None] < rng.integers(1, t + 1, b)[:, None]).astype(np.float64)
    return lp, old, adv, cm


def sapo_ref(lp, old, adv, cm, tau_pos, tau_neg):
    """ℓ = −(4/τ)·σ(τ(ρ−1))·A with τ by the sign of A; DAPO aggregation. (loss, d loss / d lp) in float64."""
    rho = np.exp(lp - old)
    tau = np.where(adv > 0, tau_pos, tau_neg)[:, None]
    sig = 1.0 / (1.0 + np.exp(-tau * (rho - 1.0)))
    z = max(cm.sum(), 1.0)
    per_token = -(4.0 / tau) * sig * adv[:, None]
    grad = -4.0 * sig * (1.0 - sig) * rho * adv[:, None] * cm / z  # d/dlp of ρ is ρ
    return float((per_token * cm).sum() / z), grad


def vespo_ref(lp, old, adv, cm, k_pos, lam_pos, k_neg, lam_neg):
    """φ(w) = exp(λ + k log w − λ w), log w = clamp(Σ_t clamp(log ρ_t, ±20)·m, log 1e-8, 20); ℓ = −sg(φ)·A·logπ;
    DAPO aggregation. (loss, d loss / d lp) in float64."""
    log_w = np.clip((np.clip(lp - old, -20, 20) * cm).sum(-1), np.log(1e-8), 20.0)
    k = np.where(adv >= 0, k_pos, k_neg)
    lam = np.where(adv >= 0, lam_pos, lam_neg)
    phi = np.exp(lam + k * log_w - lam * np.exp(log_w))[:, None]
    z = max(cm.sum(), 1.0)
    per_token = -phi * adv[:, None] * lp
    return float((per_token * cm).sum() / z), -phi * adv[:, None] * cm / z


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("temps", [(1.0, 1.05), (2.5, 0.7)])
def test_sapo_matches_float64_reference(seed, temps):
    lp, old, adv, cm = _inputs(seed)
    cfg = GRPOConfig(objective="sapo", loss_type="dapo", sapo_temperature_pos=temps[0], sapo_temperature_neg=temps[1],
                     importance_sampling_correction=False, metrics="basic")
    want, want_grad = sapo_ref(lp, old, adv, cm, *temps)
    got, grad = loss_and_grad(cfg, lp, old, adv, cm)
    assert np.isfinite(got)
    assert abs(got - want) <= 1e-12 * max(1.0, abs(want))
    np.testing.assert_allclose(grad, want_grad, rtol=1e-10, atol=1e-15)


def test_sapo_on_policy_gradient_is_the_policy_gradient():
    lp, _, adv, cm = _inputs(4)
    cfg = GRPOConfig(objective="sapo", importance_sampling_correction=False, metrics="basic")
    _, grad = loss_and_grad(cfg, lp, lp, adv, cm)  # ρ = 1: σ' = 1/4, so ∇ℓ = −A·m / Σm
    np.testing.assert_allclose(grad, -adv[:, None] * cm / cm.sum(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("params", [(2.0, 3.0, 3.0, 2.0), (1.0, 1.5, 4.0, 4.0)])
def test_vespo_matches_float64_reference(seed, params):
    lp, old, adv, cm = _inputs(seed)
    names = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
    cfg = GRPOConfig(objective="vespo", loss_type="dapo", importance_sampling_correction=False, metrics="basic",
                     **dict(zip(names, params)))
    want, want_grad = vespo_ref(lp, old, adv, cm, *params)
    got, grad = loss_and_grad(cfg, lp, old, adv, cm)
    assert np.isfinite(got) and np.all(np.isfinite(grad))
    assert abs(got - want) <= 1e-12 * max(1.0, abs(want))
    np.testing.assert_allclose(grad, want_grad, rtol=1e-10, atol=1e-15)


def test_defaults_are_trls():
    cfg = GRPOConfig()
    assert (cfg.sapo_temperature_pos, cfg.sapo_temperature_neg) == (1.0, 1.05)
    assert (cfg.vespo_k_pos, cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg) == (2.0, 3.0, 3.0, 2.0)
    assert {"sapo", "vespo"} <= set(OBJECTIVES.names())


@pytest.mark.parametrize("field, value, objective", [
    ("sapo_temperature_pos", 2.0, "ppo_clip"), ("sapo_temperature_neg", 2.0, "vespo"),
    ("vespo_k_pos", 1.0, "sapo"), ("vespo_lambda_neg", 1.0, "cispo")])
def test_an_objectives_fields_are_refused_under_another(field, value, objective):
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{field}={value}.*only objective="):
        GRPOConfig(objective=objective, **{field: value})


@pytest.mark.parametrize("field", ["sapo_temperature_pos", "vespo_lambda_pos"])
def test_zero_temperature_or_rate_is_refused(field):
    objective = field.split("_")[0]
    with pytest.raises(ValueError, match=rf"GRPOConfig\.{field}=0\.0.*> 0"):
        GRPOConfig(objective=objective, **{field: 0.0})


def test_vespo_refuses_sequence_level_ratios():
    with pytest.raises(ValueError, match=r"importance_sampling_level='sequence'.*vespo"):
        GRPOConfig(objective="vespo", importance_sampling_level="sequence")
