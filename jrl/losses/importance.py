"""Sampler-vs-trainer correction (docs/algorithms/grpo.md §7), OPSM (§8) and entropy-based token masking (§9).

Two ratios exist and must not be confused (§7.2): the PPO ratio ρ (policy being trained vs old,
:func:`jrl.losses.policy.policy_ratio`) and the sampler ratio r (old vs sampler) here. r is a
constant weight (no gradient) applied as ℓ ← ℓ · r (§10 step 5).

**IS modes** (registered by name; ``GRPOConfig.importance_sampling_mode``). With
d_t = (logπold_t − logπsamp_t) · m_t, computed in log space:

| mode                | log r                 | weight                                                   |
|---------------------|-----------------------|----------------------------------------------------------|
| ``token_truncate``    | d_t                   | exp(min(log r, log C)), and max(·, log floor) if a floor is set |
| ``token_mask``        | d_t                   | exp(log r) if log floor ≤ log r ≤ log C, else **0**       |
| ``sequence_truncate`` | Σ_t d_t (one per seq) | as token_truncate, broadcast over the sequence           |
| ``sequence_mask``     | Σ_t d_t               | as token_mask, broadcast over the sequence               |

Decisions (docs/algorithms/grpo.md §21 open point 1, 14): a masked token or sequence weighs 0 (not axolotl's 1/C),
nothing is clamped after masking; truncation is one-sided min(r, C) as in TRL and the TIS
literature unless ``is_ratio_floor`` is set (``floor = 1/C`` gives axolotl's symmetric variant);
sequence modes decide on Σd against log C before exponentiating, so a long sequence cannot give
inf (and inf · 0 = NaN). Sampler log-probs that are NaN (missing) count as d = 0.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.losses.policy import to_float
from jrl.losses.registry import IS_MODES, register_importance_sampling_mode


class ISWeights(NamedTuple):
    """Result of an IS mode."""

    weights: jax.Array
    """r broadcast to tokens, [B, T] (constant, no gradient)."""
    unit_ratio: jax.Array
    """r per unit for statistics: [B, T] for token modes, [B, 1] for sequence modes."""
    unit_mask: jax.Array
    """Which units count in statistics: loss tokens, or sequences with ≥ 1 loss token."""


def sampler_log_ratio(
    old_logprobs: jax.Array, sampler_logprobs: jax.Array, mask: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(d, missing): d_t = (logπold − logπsamp)·m with missing (NaN) sampler entries as d = 0 (§7.2)."""
    mask = to_float(mask)
    missing = jnp.isnan(sampler_logprobs) & (mask > 0)
    d = jnp.where((mask > 0) & ~missing, to_float(old_logprobs) - to_float(sampler_logprobs), 0.0)
    return jax.lax.stop_gradient(d), missing


def _truncate(log_r: jax.Array, cap: float, floor: float | None) -> jax.Array:
    log_r = jnp.minimum(log_r, math.log(cap))
    if floor is not None:
        log_r = jnp.maximum(log_r, math.log(floor))
    return jnp.exp(log_r)


def _mask(log_r: jax.Array, cap: float, floor: float | None) -> jax.Array:
    keep = log_r <= math.log(cap)
    if floor is not None:
        keep = keep & (log_r >= math.log(floor))
    return jnp.where(keep, jnp.exp(jnp.minimum(log_r, math.log(cap))), 0.0)


def _token(fn, d, mask, cap, floor) -> ISWeights:
    r = fn(d, cap, floor)
    return ISWeights(r, r, mask > 0)


def _sequence(fn, d, mask, cap, floor) -> ISWeights:
    r = fn(d.sum(-1, keepdims=True), cap, floor)  # [B, 1]: a sum of log-ratios, not a mean (§7.1)
    return ISWeights(jnp.broadcast_to(r, d.shape), r, mask.sum(-1, keepdims=True) > 0)


@register_importance_sampling_mode("token_truncate")
def token_truncate(d, mask, *, cap: float, floor: float | None = None) -> ISWeights:
    return _token(_truncate, d, mask, cap, floor)


@register_importance_sampling_mode("token_mask")
def token_mask(d, mask, *, cap: float, floor: float | None = None) -> ISWeights:
    return _token(_mask, d, mask, cap, floor)


@register_importance_sampling_mode("sequence_truncate")
def sequence_truncate(d, mask, *, cap: float, floor: float | None = None) -> ISWeights:
    return _sequence(_truncate, d, mask, cap, floor)


@register_importance_sampling_mode("sequence_mask")
def sequence_mask(d, mask, *, cap: float, floor: float | None = None) -> ISWeights:
    return _sequence(_mask, d, mask, cap, floor)


def importance_weights(
    old_logprobs: jax.Array,
    sampler_logprobs: jax.Array,
    mask: jax.Array,
    *,
    mode: str = "token_truncate",
    cap: float = 3.0,
    floor: float | None = None,
) -> ISWeights:
    """Sampler IS weights of the registered ``mode`` (§7); no gradient flows through them."""
    mask = to_float(mask)
    d, _ = sampler_log_ratio(old_logprobs, sampler_logprobs, mask)
    out = IS_MODES.get(mode)(d, mask, cap=cap, floor=floor)
    return ISWeights(*(jax.lax.stop_gradient(x) for x in out))


# ----------------------------------------------------------------------------------------------
# OPSM (§8)


def opsm_keep(
    logprobs: jax.Array,
    sampler_logprobs: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    threshold: float,
) -> jax.Array:
    """[B] bool: keep_i = (A_i ≥ 0) ∨ (kl_i ≤ threshold), kl_i = Σ m (logπsamp − sg logπθ) / max(1, n_i).

    Only negative-advantage sequences whose mean sampler-vs-policy log-ratio exceeds the threshold
    are dropped (DeepSeek-V3.2, §8). ``sampler_logprobs`` must already be filled where missing
    (the loss uses logπold there, §8); ``logprobs`` must be at the sampling temperature like every
    other log-prob (open point 2).
    """
    mask = to_float(mask)
    diff = jnp.where(mask > 0, sampler_logprobs - jax.lax.stop_gradient(logprobs), 0.0)
    kl = diff.sum(-1) / jnp.maximum(1.0, mask.sum(-1))
    return (to_float(advantages) >= 0) | (kl <= threshold)


# ----------------------------------------------------------------------------------------------
# entropy mask (§9)


def entropy_threshold(entropy: jax.Array, mask: jax.Array, top_entropy_quantile: float) -> jax.Array:
    """The (1 − q)-quantile (linear interpolation, as torch.quantile) of H over loss tokens.

    docs/algorithms/grpo.md §9: jrl takes it over the global batch, so the trainer calls this once per step on the
    whole batch and passes the result to every micro-batch; 0 loss tokens give −inf (keep all).
    """
    h = jnp.where(to_float(mask) > 0, to_float(entropy), jnp.nan).reshape(-1)
    q = jnp.nanquantile(h, 1.0 - top_entropy_quantile)
    return jnp.where(jnp.isnan(q), -jnp.inf, q)


def entropy_keep(entropy: jax.Array, threshold: jax.Array) -> jax.Array:
    """[B, T] bool: H_t ≥ threshold (§9)."""
    return jax.lax.stop_gradient(to_float(entropy)) >= threshold
