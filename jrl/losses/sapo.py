"""SAPO (soft adaptive policy optimisation; arXiv:2511.20347): a smooth gate in place of PPO's hard clip.

    ℓ_t = −(4 / τ) · σ(τ (ρ_t − 1)) · A,    τ = τ_pos if A > 0 else τ_neg

On policy (ρ = 1) the gradient is the plain policy gradient, −A·∇ρ (σ'(0) = 1/4); as ρ leaves 1 the gate's
slope decays smoothly instead of dropping to zero at 1 ± ε, so tokens just outside the trust region still
teach a little and far-off ones almost nothing. A larger τ narrows the gate; τ_neg > τ_pos damps negative
updates (which the report found less stable) faster. The same formula and defaults as TRL's
``loss_type="sapo"`` (``sapo_temperature_pos`` 1.0, ``sapo_temperature_neg`` 1.05).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.losses.policy import to_float
from jrl.losses.registry import register_objective


@register_objective("sapo")
def sapo_objective(ratio: jax.Array, logprobs: jax.Array, advantages: jax.Array, config, mask=None) -> jax.Array:
    """Per-token SAPO loss [B, T] from the ratio ρ [B, T] (or [B, 1]) and the advantages [B]."""
    del logprobs, mask  # the ratio carries the gradient; per token
    a = to_float(advantages)
    if a.ndim == 1:
        a = a[:, None]
    tau = jnp.where(a > 0, config.sapo_temperature_pos, config.sapo_temperature_neg)
    return -jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau) * a
