"""The top-level GRPO-family loss: one micro-batch in, ``(loss, metrics)`` out (docs/algorithms/grpo.md §10).

:func:`grpo_loss` takes either per-token log-probs ``[B, T]`` already computed at temperature τ, or
hidden states ``[B, T, H]`` + the lm head ``[H, V]`` + target ids ``[B, T]``, in which case it calls
:func:`jrl.kernels.logprobs.token_logprobs` (fused / chunked kernel, logits / τ, optional entropy),
so a faster kernel plugs in without touching the loss. ``hidden[:, t]`` must be the state that
predicts ``completion_ids[:, t]``.

Order of operations (§10), per token, with m the loss mask (§11):

1. logπθ (and entropy H) at τ;
2. ρ (token / sequence / sequence_token) against logπold (``old_logprobs``, or sg(logπθ) when
   absent: on-policy, ρ ≡ 1, §2.4); ℓ from the registered ``objective``: ``ppo_clip``
   ℓ = −min(ρ'·A, clip(ρ)·A) (§4), or ``cispo``;
3. ℓ ← ℓ · keep_OPSM (§8; sampler log-probs, falling back to logπold where missing);
4. ℓ ← ℓ · 1[H ≥ threshold] (§9; threshold from the global batch when passed in);
5. ℓ ← ℓ · r, the sampler IS weight (§7; only with ``sampler_logprobs`` and the correction on);
6. ℓ ← ℓ + β · KL_k3 (× ρ with ``use_bias_correction_kl``) (§6);
7. loss = Σ ℓ · m · c_i / Z for ``loss_type`` (§5, normalisers §12.3).

Everything is a pure function of arrays with static shapes: ``jax.jit(grpo_loss,
static_argnames="config")`` works, and so does ``jax.vmap`` over a leading micro-batch axis.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jrl.kernels.logprobs import token_logprobs
from jrl.losses import importance, metrics, policy
from jrl.losses.config import GRPOConfig
from jrl.losses.policy import Normalizers, to_float
from jrl.losses.registry import OBJECTIVES


class LossInputs(NamedTuple):
    """One micro-batch. B sequences, T completion tokens; all optional fields may be None."""

    advantages: jax.Array
    """A_i, [B] (from :func:`jrl.losses.compute_advantages` on the whole generation batch)."""
    completion_mask: jax.Array
    """[B, T], 1 up to and including the first EOS (§11)."""
    logprobs: jax.Array | None = None
    """logπθ of the completion tokens at temperature τ, [B, T], with gradient. Or give ``hidden``."""
    hidden: jax.Array | None = None
    """[B, T, H] final hidden states; used with ``lm_head`` and ``completion_ids`` instead of ``logprobs``."""
    lm_head: jax.Array | None = None
    """[H, V] output projection for the hidden-state path."""
    completion_ids: jax.Array | None = None
    """[B, T] int sampled token ids (targets of the hidden-state path). Padding must hold valid ids
    in [0, V) (e.g. the pad id); their log-probs are masked out."""
    old_logprobs: jax.Array | None = None
    """logπold [B, T] from deferred scoring (§2.4); None means on-policy, old = sg(logπθ)."""
    ref_logprobs: jax.Array | None = None
    """logπref [B, T]; required when β ≠ 0."""
    sampler_logprobs: jax.Array | None = None
    """logπsamp [B, T] reported by the sampler, NaN where missing; enables IS and OPSM."""
    entropy: jax.Array | None = None
    """H [B, T] for the logprobs path (entropy mask, ``entropy`` metric); the hidden path computes it."""
    tool_mask: jax.Array | None = None
    """[B, T], 0 on tool/environment-inserted tokens (§11); None means all 1."""
    truncated: jax.Array | None = None
    """[B] bool, the completion has no EOS; needed with ``mask_truncated_completions``."""


def policy_logprobs(
    inputs: LossInputs, *, temperature: float = 1.0, with_entropy: bool = False
) -> tuple[jax.Array, jax.Array | None]:
    """(logπθ [B, T], H [B, T] or None) from the log-prob inputs or via the logprob kernel."""
    if (inputs.logprobs is None) == (inputs.hidden is None):
        raise ValueError("LossInputs needs exactly one of `logprobs` [B, T] or `hidden` [B, T, H] (+ lm_head, completion_ids)")
    if inputs.logprobs is not None:
        return inputs.logprobs, inputs.entropy
    if inputs.lm_head is None or inputs.completion_ids is None:
        raise ValueError("the hidden-state path needs `lm_head` [H, V] and `completion_ids` [B, T]")
    b, t, h = inputs.hidden.shape
    lp, ent = token_logprobs(
        inputs.hidden.reshape(b * t, h),
        inputs.lm_head,
        inputs.completion_ids.reshape(b * t),
        temperature=temperature,
        with_entropy=with_entropy,
    )
    return lp.reshape(b, t), None if ent is None else ent.reshape(b, t)


def _check_shapes(inputs: LossInputs, lp: jax.Array) -> None:
    b, t = inputs.completion_mask.shape
    if lp.shape != (b, t):
        raise ValueError(f"logprobs have shape {lp.shape}, completion_mask {inputs.completion_mask.shape}; they must match")
    if inputs.advantages.shape != (b,):
        raise ValueError(f"advantages must be one per sequence, shape ({b},), got {inputs.advantages.shape}")
    for name in ("old_logprobs", "ref_logprobs", "sampler_logprobs", "tool_mask"):
        x = getattr(inputs, name)
        if x is not None and x.shape != (b, t):
            raise ValueError(f"{name} has shape {x.shape}, expected ({b}, {t})")


def grpo_loss(
    inputs: LossInputs,
    config: GRPOConfig,
    normalizers: Normalizers | None = None,
    entropy_threshold: jax.Array | None = None,
    *,
    temperature: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO-family loss of one micro-batch and its metrics (names in :mod:`jrl.losses.metrics`).

    Args:
      inputs: the micro-batch, see :class:`LossInputs`.
      config: the algorithm knobs (static under ``jax.jit``).
      normalizers: global counts of the optimizer step from :func:`jrl.losses.step_normalizers`
        on the whole step's loss mask; None treats this micro-batch as the whole step. Summing the
        returned losses over the step's micro-batches gives the step loss (§12.3).
      entropy_threshold: the §9 threshold from :func:`jrl.losses.entropy_threshold` on the global
        batch; None computes it from this micro-batch. Only used when ``top_entropy_quantile < 1``.
    """
    cfg = config
    need_entropy = cfg.needs_entropy
    lp, ent = policy_logprobs(inputs, temperature=temperature, with_entropy=need_entropy)
    _check_shapes(inputs, lp)
    lp = to_float(lp)
    m = policy.loss_mask(
        inputs.completion_mask,
        inputs.tool_mask,
        inputs.truncated,
        mask_truncated_completions=cfg.mask_truncated_completions,
    )
    adv = jax.lax.stop_gradient(to_float(inputs.advantages))
    old = jax.lax.stop_gradient(lp if inputs.old_logprobs is None else to_float(inputs.old_logprobs))
    eps_low, eps_high = cfg.epsilon_low, cfg.effective_epsilon_high

    # 2. ratio and the registered objective (``ppo_clip``: the clipped surrogate)
    rho, log_rho = policy.policy_ratio(lp, old, m, cfg.importance_sampling_level)
    per_token = OBJECTIVES.get(cfg.objective)(rho, lp, adv, cfg, mask=m)
    out: dict[str, jax.Array] = {}

    samp = None if inputs.sampler_logprobs is None else to_float(inputs.sampler_logprobs)
    # 3. OPSM
    if cfg.off_policy_mask_threshold is not None:
        samp_filled = old if samp is None else jnp.where(jnp.isnan(samp), old, samp)
        keep = importance.opsm_keep(lp, samp_filled, adv, m, cfg.off_policy_mask_threshold)
        per_token = per_token * keep[:, None].astype(per_token.dtype)
        out.update(metrics.opsm_metrics(mask=m, keep=keep))
    # 4. entropy mask
    if cfg.top_entropy_quantile < 1.0:
        if ent is None:
            raise ValueError("top_entropy_quantile < 1 needs entropies: pass LossInputs.entropy or use the hidden path")
        thr = importance.entropy_threshold(ent, m, cfg.top_entropy_quantile) if entropy_threshold is None else entropy_threshold
        per_token = per_token * importance.entropy_keep(ent, thr).astype(per_token.dtype)
    # 5. sampler IS weight
    if cfg.importance_sampling_correction and samp is not None:
        isw = importance.importance_weights(
            old,
            samp,
            m,
            mode=cfg.importance_sampling_mode,
            cap=cfg.importance_sampling_cap,
            floor=cfg.is_ratio_floor,
        )
        per_token = per_token * isw.weights
        out.update(
            metrics.sampler_metrics(
                mask=m, old_logprobs=old, sampler_logprobs=samp, unit_ratio=isw.unit_ratio, unit_mask=isw.unit_mask
            )
        )
    # 6. KL to the reference
    kl = None
    if cfg.beta != 0.0:
        if inputs.ref_logprobs is None:
            raise ValueError("beta != 0 needs LossInputs.ref_logprobs (log-probs under the reference model)")
        kl = policy.k3_kl(lp, jax.lax.stop_gradient(to_float(inputs.ref_logprobs)), m)
        per_token = per_token + cfg.beta * (kl * rho if cfg.use_bias_correction_kl else kl)
    # 7. aggregation
    if cfg.max_completion_length is not None and cfg.max_completion_length < m.shape[-1]:
        raise ValueError(
            f"GRPOConfig.max_completion_length={cfg.max_completion_length} is below the padded length "
            f"T={m.shape[-1]} of the loss arrays; raise it or pad to at most max_completion_length"
        )
    loss = policy.aggregate_loss(per_token, m, cfg.loss_type, normalizers, cfg.max_completion_length)

    out.update(
        metrics.policy_metrics(
            mask=m,
            ratio=rho,
            log_ratio=log_rho,
            advantages=adv,
            epsilon_low=eps_low,
            epsilon_high=eps_high,
            level=cfg.importance_sampling_level,
            logprobs=lp,
            old_logprobs=old,
            entropy=ent,
            ref_kl=kl,
            full=cfg.metrics == "full",
        )
    )
    return loss, out


def has_learning_signal(sequence_has_signal: jax.Array, mask: jax.Array) -> jax.Array:
    """Scalar bool: some sequence with a loss token belongs to a group with signal (§14.8).

    ``sequence_has_signal`` [B] comes from :func:`jrl.losses.group_has_signal` (raw rewards) via
    :func:`jrl.losses.sequence_has_signal`; the trainer skips a micro-batch on the host when False.
    """
    return jnp.any(sequence_has_signal & (jnp.asarray(mask).sum(-1) > 0))
