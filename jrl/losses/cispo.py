"""CISPO (clipped IS-weight policy optimisation; MiniMax-M1 report, arXiv:2506.13585, §3.1).

PPO's clip zeroes the gradient of every token whose ratio left the trust region, which drops rare,
high-information tokens (reflection words) after their first update. CISPO keeps every token's
gradient and clips the importance weight instead, stopping its gradient:

    ℓ_t = −sg(clip(ρ_t, 1 − ε_low, 1 + ε_high)) · A · logπθ(y_t),

so ∇ℓ_t = −clip(ρ_t)·A·∇logπθ: a REINFORCE gradient reweighted by a bounded, constant IS weight. The
report clips only from above (its ε_low is effectively unbounded); set ``GRPOConfig.epsilon`` near 1
for that, e.g. ``GRPOConfig(objective="cispo", epsilon=0.99, epsilon_high=4.0)``. Aggregation
(``loss_type``), masks, the sampler IS correction and the KL term apply as for ``ppo_clip``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.losses.policy import to_float
from jrl.losses.registry import register_objective


@register_objective("cispo")
def cispo_objective(ratio: jax.Array, logprobs: jax.Array, advantages: jax.Array, config) -> jax.Array:
    """Per-token CISPO loss [B, T] from the ratio ρ, logπθ [B, T] and the advantages [B]."""
    a = to_float(advantages)
    if a.ndim == 1:
        a = a[:, None]
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - config.epsilon_low, 1.0 + config.effective_epsilon_high))
    return -weight * a * logprobs
