"""Policy-loss pieces (docs/algorithms/grpo.md §3–§6, §11, §12.3): masks, ratios, clipped surrogate, k3 KL, normalisers.

All functions are pure and jit-able on arrays of static shape ``[B, T]`` (B sequences, T padded
completion tokens); ``advantages`` is one value per sequence, ``[B]``.

**Aggregation rule** (docs/algorithms/grpo.md §5 "jrl rule", §12.3). Every ``loss_type`` is written as

    L = Σ_{i,t} ℓ_it · m_it · c_i / Z

where the registered loss-type function returns ``(c [B], Z)``. ``Z`` comes from
:class:`Normalizers` computed **once per optimizer step on the global batch** by
:func:`step_normalizers`, so summing ``L`` over micro-batches (and averaging nothing anywhere else)
gives a gradient that does not depend on how the step was split:

| loss_type | c_i            | Z                                  |
|-----------|----------------|------------------------------------|
| grpo      | 1 / max(1, n_i) | N_seq                             |
| bnpo      | 1              | max(1, Σ local m) · num_micro_batches (a per-micro-batch token mean, §5) |
| dr_grpo   | 1              | N_seq · L_max                      |
| dapo      | 1              | N_tok                              |

``N_tok`` = Σ m and ``N_seq`` = the number of sequences with at least one loss token, both counted
after **all** data masks (completion × tool × truncation; docs/algorithms/grpo.md §21 open point 11); OPSM and
entropy masks are weights and do not change them. ``Z`` is clamped to ≥ 1.
When no normalisers are passed the micro-batch is taken to be the whole step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.losses.registry import LOSS_TYPES, register_loss_type, register_objective

LOG_RATIO_MAX = 20.0
"""Upper clamp on log-ratios before ``exp`` (ρ ≤ e^20 ≈ 4.9e8): keeps ρ, its gradient and ρ·0 finite.

At such ratios the clipped branch (A > 0) or δ (A < 0) is the only sane regime; the clamp only
removes the overflow (exp(89) = inf in float32) that would otherwise turn into inf·0 = NaN.
"""

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")


def to_float(x: jax.Array) -> jax.Array:
    """``x`` as a float array of at least float32 precision (bf16 → f32; f64 stays f64 under x64)."""
    x = jnp.asarray(x)
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


# ----------------------------------------------------------------------------------------------
# masks (§11)


def loss_mask(
    completion_mask: jax.Array,
    tool_mask: jax.Array | None = None,
    truncated: jax.Array | None = None,
    *,
    mask_truncated_completions: bool = False,
) -> jax.Array:
    """m = completion_mask × tool_mask, with truncated completions zeroed if asked (§11). Float [B, T]."""
    m = to_float(completion_mask)
    if tool_mask is not None:
        m = m * to_float(tool_mask)
    if mask_truncated_completions:
        if truncated is None:
            raise ValueError(
                "mask_truncated_completions=True needs `truncated` ([B] bool: the completion has no EOS); "
                "pass it or set mask_truncated_completions=False"
            )
        m = m * (1.0 - to_float(truncated))[:, None]
    return m


def sequence_lengths(mask: jax.Array) -> jax.Array:
    """n_i = Σ_t m_it, [B]."""
    return mask.sum(axis=-1)


# ----------------------------------------------------------------------------------------------
# normalisers (§5, §12.3)


class Normalizers(NamedTuple):
    """Global counts of one optimizer step; pass the same object to every micro-batch's loss."""

    num_sequences: jax.Array
    """N_seq: sequences with at least one loss token in the whole step (all micro-batches, devices)."""
    num_tokens: jax.Array
    """N_tok: Σ m over the whole step, after every data mask (open point 11)."""
    num_micro_batches: jax.Array
    """Number of micro-batches the step is split into; only ``bnpo`` uses it (its /GA)."""


def step_normalizers(mask: jax.Array, num_micro_batches: int = 1) -> Normalizers:
    """Normalisers of a whole step from its loss mask ``[..., T]`` (any leading batch dims)."""
    mask = to_float(mask)
    n = mask.sum(axis=-1)
    return Normalizers(
        num_sequences=(n > 0).sum().astype(mask.dtype),
        num_tokens=n.sum(),
        num_micro_batches=jnp.asarray(num_micro_batches, mask.dtype),
    )


@register_loss_type("grpo")
def _grpo_norm(mask, normalizers: Normalizers, max_completion_length: int):
    """Per-sequence token mean, then mean over the step's sequences (length-biased)."""
    c = 1.0 / jnp.maximum(1.0, sequence_lengths(mask))
    return c, jnp.maximum(1.0, normalizers.num_sequences)


@register_loss_type("bnpo")
def _bnpo_norm(mask, normalizers: Normalizers, max_completion_length: int):
    """Token mean inside the micro-batch, divided by the micro-batch count (depends on the split, §5)."""
    return jnp.ones(mask.shape[:1], mask.dtype), jnp.maximum(1.0, mask.sum()) * normalizers.num_micro_batches


@register_loss_type("dr_grpo")
def _dr_grpo_norm(mask, normalizers: Normalizers, max_completion_length: int):
    """Sum over tokens divided by the constant N_seq · L_max (no length normalisation)."""
    return jnp.ones(mask.shape[:1], mask.dtype), jnp.maximum(1.0, normalizers.num_sequences) * max_completion_length


@register_loss_type("dapo")
def _dapo_norm(mask, normalizers: Normalizers, max_completion_length: int):
    """Token mean over the whole step (global token count)."""
    return jnp.ones(mask.shape[:1], mask.dtype), jnp.maximum(1.0, normalizers.num_tokens)


def aggregation_weights(
    loss_type: str,
    mask: jax.Array,
    normalizers: Normalizers | None = None,
    max_completion_length: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """(c [B], Z) of ``loss_type`` for this micro-batch; defaults: local normalisers and L_max = T."""
    mask = to_float(mask)
    if normalizers is None:
        normalizers = step_normalizers(mask)
    if max_completion_length is None:
        max_completion_length = mask.shape[-1]
    return LOSS_TYPES.get(loss_type)(mask, normalizers, max_completion_length)


def aggregate_loss(
    per_token_loss: jax.Array,
    mask: jax.Array,
    loss_type: str,
    normalizers: Normalizers | None = None,
    max_completion_length: int | None = None,
) -> jax.Array:
    """Σ ℓ · m · c_i / Z for the registered ``loss_type`` (docs/algorithms/grpo.md §5 jrl rule)."""
    mask = to_float(mask)
    c, z = aggregation_weights(loss_type, mask, normalizers, max_completion_length)
    return jnp.sum(jnp.where(mask > 0, per_token_loss * mask * c[:, None], 0.0)) / z


# ----------------------------------------------------------------------------------------------
# ratios (§3)


def masked_log_ratio(logprobs: jax.Array, old_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """logπθ − logπold at loss tokens, exactly 0 elsewhere (garbage or NaN at padding is dropped)."""
    return jnp.where(mask > 0, logprobs - old_logprobs, 0.0)


def policy_ratio(
    logprobs: jax.Array,
    old_logprobs: jax.Array,
    mask: jax.Array,
    level: str = "token",
) -> tuple[jax.Array, jax.Array]:
    """The PPO ratio ρ (policy vs old) broadcast to ``[B, T]``, and its log.

    - ``token`` (§3.1): ρ_t = exp(logπθ_t − logπold_t);
    - ``sequence`` (GSPO, §3.2): ρ_i = exp(Σ_t m (logπθ − logπold) / max(1, n_i)), same for all tokens;
    - ``sequence_token`` (GSPO-token, §3.3): s_t = sg(ρ_i) · exp(logπθ_t − sg(logπθ_t)), value ρ_i,
      gradient per token.

    Log-ratios are clamped above at :data:`LOG_RATIO_MAX` before ``exp``.
    """
    mask = to_float(mask)
    d = masked_log_ratio(logprobs, old_logprobs, mask)
    if level == "token":
        log_rho = jnp.minimum(d, LOG_RATIO_MAX)
        return jnp.exp(log_rho), log_rho
    if level not in ("sequence", "sequence_token"):
        raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}")
    seq = jnp.minimum(d.sum(-1) / jnp.maximum(1.0, sequence_lengths(mask)), LOG_RATIO_MAX)
    log_rho = jnp.broadcast_to(seq[:, None], mask.shape)
    if level == "sequence":
        return jnp.exp(log_rho), log_rho
    lp = jnp.where(mask > 0, logprobs, 0.0)
    tok = lp - jax.lax.stop_gradient(lp)  # value 0, gradient 1 per token
    log_rho = jax.lax.stop_gradient(log_rho) + tok
    return jax.lax.stop_gradient(jnp.exp(seq))[:, None] * jnp.exp(tok), log_rho


# ----------------------------------------------------------------------------------------------
# surrogate (§4) and KL (§6)


def clipped_surrogate(
    ratio: jax.Array,
    advantages: jax.Array,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None = None,
) -> jax.Array:
    """ℓ_t = −min(ρ'·A, clip(ρ, 1 − ε_low, 1 + ε_high)·A), ρ' = min(ρ, δ) if δ is set (§4). [B, T]."""
    a = to_float(advantages)
    if a.ndim == 1:
        a = a[:, None]
    unclipped = (ratio if delta is None else jnp.minimum(ratio, delta)) * a
    clipped = jnp.clip(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high) * a
    return -jnp.minimum(unclipped, clipped)


@register_objective("ppo_clip")
def ppo_clip_objective(ratio: jax.Array, logprobs: jax.Array, advantages: jax.Array, config, mask=None) -> jax.Array:
    """The PPO clipped surrogate of GRPO / DAPO / GSPO (:func:`clipped_surrogate` with the config's ε, δ)."""
    del logprobs, mask  # the ratio carries the gradient; per token
    return clipped_surrogate(ratio, advantages, config.epsilon_low, config.effective_epsilon_high, config.delta)


def k3_kl(logprobs: jax.Array, ref_logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """k3 estimator KL_t = exp(Δ) − Δ − 1, Δ = logπref − logπθ (§6); 0 off the mask. [B, T].

    ``exp`` sees min(Δ, :data:`LOG_RATIO_MAX`) so a wildly off reference cannot overflow.
    """
    delta = jnp.where(to_float(mask) > 0, ref_logprobs - logprobs, 0.0)
    return jnp.exp(jnp.minimum(delta, LOG_RATIO_MAX)) - delta - 1.0


def clip_indicators(
    ratio: jax.Array, advantages: jax.Array, epsilon_low: float, epsilon_high: float
) -> tuple[jax.Array, jax.Array]:
    """(low, high) bool [B, T]: low = ρ < 1−ε_low ∧ A < 0; high = ρ > 1+ε_high ∧ A > 0 (§10)."""
    a = to_float(advantages)
    if a.ndim == 1:
        a = a[:, None]
    low = (ratio < 1.0 - epsilon_low) & (a < 0)
    high = (ratio > 1.0 + epsilon_high) & (a > 0)
    return low, high
