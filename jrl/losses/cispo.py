"""CISPO (clipped IS-weight policy optimisation; MiniMax-M1 report, arXiv:2506.13585, §3.1).

PPO's clip zeroes the gradient of every token whose ratio left the trust region, which drops rare,
high-information tokens (reflection words) after their first update. CISPO keeps every token's
gradient and caps the importance weight instead, stopping its gradient:

    ℓ_t = −sg(min(ρ_t, ε_max)) · A · logπθ(y_t),

so ∇ℓ_t = −min(ρ_t, ε_max)·A·∇logπθ: a REINFORCE gradient reweighted by a bounded, constant IS weight. As in
the report, ScaleRL (ε_max = 4-5) and TRL (``loss_type="cispo"``), the cap is absolute and there is no lower
clip: ``GRPOConfig.epsilon_high`` is ε_max here (default :data:`DEFAULT_MAX_WEIGHT` when None), not the ``1 + ε``
of ``ppo_clip``, and ``epsilon`` only sets the clip-ratio metrics. Aggregation (``loss_type``; TRL always uses
``dapo``), masks, the sampler IS correction and the KL term apply as for ``ppo_clip``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.losses.policy import to_float
from jrl.losses.registry import register_objective

DEFAULT_MAX_WEIGHT = 5.0
"""ε_max when ``GRPOConfig.epsilon_high`` is None (TRL's documented recommendation for CISPO)."""


def max_weight(config) -> float:
    """The cap ε_max on the IS weight under ``config``."""
    return DEFAULT_MAX_WEIGHT if config.epsilon_high is None else float(config.epsilon_high)


@register_objective("cispo")
def cispo_objective(ratio: jax.Array, logprobs: jax.Array, advantages: jax.Array, config, mask=None) -> jax.Array:
    """Per-token CISPO loss [B, T] from the ratio ρ, logπθ [B, T] and the advantages [B]."""
    del mask  # per token
    a = to_float(advantages)
    if a.ndim == 1:
        a = a[:, None]
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, max_weight(config)))
    return -weight * a * logprobs
