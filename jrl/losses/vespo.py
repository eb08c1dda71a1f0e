"""VESPO: a sequence's policy-gradient weighted by a gamma-shaped function of its importance weight.

Each sequence's importance weight w = Π_t ρ_t (in log space: Σ_t log ρ_t over its tokens, clamped to
[log 1e-8, 20]) sets a constant, gradient-stopped weight on the whole sequence's REINFORCE term:

    φ(w) = e^λ · w^k · e^(−λ w)      (φ(1) = 1 for any k, λ; the mode sits at w = k / λ)
    ℓ_t = −sg(φ(w)) · A · logπθ(y_t)

with (k, λ) = (k_pos, λ_pos) for A ≥ 0 and (k_neg, λ_neg) for A < 0. φ vanishes as w → 0 and decays
exponentially as w grows, so sequences far off the sampling policy in either direction stop teaching without a
hard cut. Formula, clamps and defaults (k_pos 2, λ_pos 3, k_neg 3, λ_neg 2) as TRL's ``loss_type="vespo"``.
One difference: TRL folds the sampler-vs-trainer IS ratio into w; jrl applies its ``importance_sampling_mode``
correction afterwards, as for every objective (set ``importance_sampling_correction=False`` to leave it out).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jrl.losses.policy import LOG_RATIO_MAX, to_float
from jrl.losses.registry import register_objective

LOG_WEIGHT_MIN = math.log(1e-8)
"""Lower clamp on log w (the sequence's importance weight)."""


def gamma_weight(log_ratio: jax.Array, mask: jax.Array, advantages: jax.Array, config) -> jax.Array:
    """φ(w) [B, 1] of each sequence from its per-token log-ratios [B, T] (masked by ``mask``)."""
    log_w = jnp.sum(jnp.clip(log_ratio, -LOG_RATIO_MAX, LOG_RATIO_MAX) * mask, axis=-1, keepdims=True)
    log_w = jnp.clip(log_w, LOG_WEIGHT_MIN, LOG_RATIO_MAX)
    nonneg = advantages >= 0
    k = jnp.where(nonneg, config.vespo_k_pos, config.vespo_k_neg)
    lam = jnp.where(nonneg, config.vespo_lambda_pos, config.vespo_lambda_neg)
    phi = jnp.exp(lam + k * log_w - lam * jnp.exp(log_w))
    return jnp.nan_to_num(phi, nan=0.0, posinf=0.0, neginf=0.0)


@register_objective("vespo")
def vespo_objective(ratio: jax.Array, logprobs: jax.Array, advantages: jax.Array, config, mask=None) -> jax.Array:
    """Per-token VESPO loss [B, T] from the per-token ratio ρ [B, T], logπθ [B, T], the advantages [B] and the
    loss mask [B, T] (which tokens make up each sequence's weight)."""
    if mask is None:
        raise ValueError("the vespo objective needs the loss mask (each sequence's weight sums its tokens)")
    a = to_float(advantages)
    if a.ndim == 1:
        a = a[:, None]
    phi = jax.lax.stop_gradient(gamma_weight(jnp.log(ratio), to_float(mask), a, config))
    return -phi * a * logprobs
