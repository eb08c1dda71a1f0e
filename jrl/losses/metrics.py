"""GRPO metrics (docs/algorithms/grpo.md §13) as flat dicts of scalar arrays with stable names.

Conventions: m is the loss mask (completion × tool × truncation), n_i = Σ_t m_it,
w_it = m_it / max(1, n_i), ``num_docs`` = max(1, #{i : n_i > 0}); a "masked mean" is
Σ m·x / max(1, Σ m); every quantity is over the arrays passed in (one micro-batch), without
gradient; an empty selection gives 0 (min/max included) instead of ±inf or NaN.

Names (grouped by the function that emits them; ``[full]`` = only with ``metrics="full"``):

:func:`jrl.losses.advantages.reward_metrics` (§13.1; re-exported here)
    ``reward``, ``reward_std``, ``frac_reward_zero_std``, ``rewards/<name>/mean``, ``rewards/<name>/std``

:func:`policy_metrics` (§13.1–§13.2)
    ``advantage`` (Σ w·A / num_docs), ``advantage_std`` (std of A over non-empty sequences),
    ``max_advantage``, ``min_advantage`` (over loss tokens),
    ``clip_ratio/low_mean``, ``clip_ratio/low_min``, ``clip_ratio/high_mean``,
    ``clip_ratio/high_max``, ``clip_ratio/region_mean`` (masked means of the §10 indicators; at
    sequence level a plain mean over sequences, as TRL; ``low_min`` / ``high_max`` equal the local
    means and are reduced with min / max across micro-batches and processes),
    ``clipped_ratio_fraction`` (Σ w·1[ρ < 1−ε_low ∨ ρ > 1+ε_high] / num_docs, no sign-of-A condition),
    ``ratio_new_old`` (Σ w·ρ / num_docs), ``ratio_new_old_sum`` (Σ m·ρ),
    ``ratio_new_old_squared_sum`` (Σ m·ρ²), ``kl_new_old`` (Σ w·(ρ − log ρ − 1) / num_docs),
    ``num_tokens`` (Σ m), ``kl`` (masked mean of the k3 KL to the reference; only when β ≠ 0),
    [full] ``ess_frac`` ((Σ m ρ)² / (N_tok · Σ m ρ²), jrl's ESS, open point 9),
    [full] ``new_logprobs``, ``old_logprobs`` (Σ w·logπ / num_docs),
    [full] ``entropy`` (masked mean of H; when entropies are available)

:func:`sampler_metrics` (§13.3; only when the sampler IS correction runs)
    ``sampling/sampling_logp_difference/mean``, ``.../max`` (|logπold − logπsamp| over loss tokens
    with a sampler log-prob), ``sampling/importance_sampling_ratio/min``, ``.../mean``, ``.../max``
    (r after truncation/masking, over loss tokens or, in sequence modes, non-empty sequences),
    ``sampling/importance_sampling_ratio/frac_masked`` (fraction of those weights equal to 0),
    ``sampling/frac_missing_logprobs`` (fraction of loss tokens whose sampler log-prob was NaN)

:func:`opsm_metrics` (§8, §13.3; only when OPSM is on)
    ``opsm/frac_masked`` (fraction of non-empty sequences dropped)

:func:`completion_metrics` (§13.4)
    ``completions/mean_length``, ``completions/min_length``, ``completions/max_length``,
    ``completions/mean_terminated_length``, ``completions/min_terminated_length``,
    ``completions/max_terminated_length``, ``completions/clipped_ratio``

The pipeline metrics of §13.4 (``skipped_zero_adv_batches``, replay, re-roll, memory) belong to the
trainer. :func:`metric_reduction` says how to combine a metric across micro-batches / processes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jrl.losses.advantages import reward_metrics
from jrl.losses.policy import clip_indicators

__all__ = [
    "completion_metrics",
    "metric_reduction",
    "opsm_metrics",
    "policy_metrics",
    "reward_metrics",
    "sampler_metrics",
]

_SUM = {"num_tokens", "ratio_new_old_sum", "ratio_new_old_squared_sum"}
_MIN = {
    "clip_ratio/low_min",
    "min_advantage",
    "sampling/importance_sampling_ratio/min",
    "completions/min_length",
    "completions/min_terminated_length",
}
_MAX = {
    "clip_ratio/high_max",
    "max_advantage",
    "sampling/sampling_logp_difference/max",
    "sampling/importance_sampling_ratio/max",
    "completions/max_length",
    "completions/max_terminated_length",
}


def metric_reduction(name: str) -> str:
    """How to combine ``name`` across micro-batches / processes: ``"sum"``, ``"min"``, ``"max"`` or ``"mean"``."""
    if name in _SUM:
        return "sum"
    if name in _MIN:
        return "min"
    if name in _MAX:
        return "max"
    return "mean"


def _sg(x):
    return None if x is None else jax.lax.stop_gradient(x)


def _safe_div(a, b):
    return jnp.where(b > 0, a / jnp.where(b > 0, b, 1.0), 0.0)


def _masked_mean(x, m):
    return jnp.sum(x * m) / jnp.maximum(1.0, jnp.sum(m))


def _masked_min(x, m):
    return jnp.where(jnp.any(m > 0), jnp.min(jnp.where(m > 0, x, jnp.inf)), 0.0)


def _masked_max(x, m):
    return jnp.where(jnp.any(m > 0), jnp.max(jnp.where(m > 0, x, -jnp.inf)), 0.0)


def _masked_std(x, m):
    """Bessel-corrected std of x over m > 0 (1-D); 0 for fewer than two entries."""
    cnt = jnp.sum(m)
    mean = jnp.sum(x * m) / jnp.maximum(1.0, cnt)
    var = jnp.sum(m * (x - mean) ** 2) / jnp.maximum(1.0, cnt - 1)
    return jnp.where(cnt > 1, jnp.sqrt(var), 0.0)


def policy_metrics(
    *,
    mask: jax.Array,
    ratio: jax.Array,
    log_ratio: jax.Array,
    advantages: jax.Array,
    epsilon_low: float,
    epsilon_high: float,
    level: str = "token",
    logprobs: jax.Array | None = None,
    old_logprobs: jax.Array | None = None,
    entropy: jax.Array | None = None,
    ref_kl: jax.Array | None = None,
    full: bool = True,
) -> dict[str, jax.Array]:
    """Policy, ratio and advantage metrics (§13.1–13.2); see the module docstring for names."""
    mask, ratio, log_ratio = _sg(mask), _sg(ratio), _sg(log_ratio)
    a = _sg(advantages)
    n = mask.sum(-1)
    has = (n > 0).astype(mask.dtype)
    num_docs = jnp.maximum(1.0, has.sum())
    w = mask / jnp.maximum(1.0, n)[:, None]

    def doc_mean(x):  # Σ w·x / num_docs: per-sequence mean, then mean over sequences
        return jnp.sum(w * x) / num_docs

    avg = (lambda x: _masked_mean(x, mask)) if level == "token" else doc_mean
    low, high = (x.astype(mask.dtype) for x in clip_indicators(ratio, a, epsilon_low, epsilon_high))
    outside = ((ratio < 1.0 - epsilon_low) | (ratio > 1.0 + epsilon_high)).astype(mask.dtype)
    a_tok = jnp.broadcast_to(a[:, None], mask.shape)
    rho_sum, rho_sq_sum, n_tok = jnp.sum(mask * ratio), jnp.sum(mask * ratio**2), jnp.sum(mask)
    out = {
        "advantage": doc_mean(a_tok),
        "advantage_std": _masked_std(a, has),
        "max_advantage": _masked_max(a_tok, mask),
        "min_advantage": _masked_min(a_tok, mask),
        "clip_ratio/low_mean": avg(low),
        "clip_ratio/low_min": avg(low),
        "clip_ratio/high_mean": avg(high),
        "clip_ratio/high_max": avg(high),
        "clip_ratio/region_mean": avg(jnp.maximum(low, high)),
        "clipped_ratio_fraction": doc_mean(outside),
        "ratio_new_old": doc_mean(ratio),
        "ratio_new_old_sum": rho_sum,
        "ratio_new_old_squared_sum": rho_sq_sum,
        "kl_new_old": doc_mean(ratio - log_ratio - 1.0),
        "num_tokens": n_tok,
    }
    if ref_kl is not None:
        out["kl"] = _masked_mean(_sg(ref_kl), mask)
    if full:
        out["ess_frac"] = _safe_div(rho_sum**2, n_tok * rho_sq_sum)
        if logprobs is not None:
            out["new_logprobs"] = doc_mean(jnp.where(mask > 0, _sg(logprobs), 0.0))
        if old_logprobs is not None:
            out["old_logprobs"] = doc_mean(jnp.where(mask > 0, _sg(old_logprobs), 0.0))
        if entropy is not None:
            out["entropy"] = _masked_mean(jnp.where(mask > 0, _sg(entropy), 0.0), mask)
    return out


def sampler_metrics(
    *,
    mask: jax.Array,
    old_logprobs: jax.Array,
    sampler_logprobs: jax.Array,
    unit_ratio: jax.Array,
    unit_mask: jax.Array,
) -> dict[str, jax.Array]:
    """Sampler-mismatch metrics (§7.3, §13.3) from the IS weights of :mod:`jrl.losses.importance`."""
    mask = _sg(mask)
    missing = jnp.isnan(sampler_logprobs) & (mask > 0)
    present = jnp.where(missing, 0.0, mask)
    diff = jnp.where(present > 0, jnp.abs(_sg(old_logprobs) - sampler_logprobs), 0.0)
    um = unit_mask.astype(mask.dtype)
    r = _sg(unit_ratio)
    return {
        "sampling/sampling_logp_difference/mean": _masked_mean(diff, present),
        "sampling/sampling_logp_difference/max": _masked_max(diff, present),
        "sampling/importance_sampling_ratio/min": _masked_min(r, um),
        "sampling/importance_sampling_ratio/mean": _masked_mean(r, um),
        "sampling/importance_sampling_ratio/max": _masked_max(r, um),
        "sampling/importance_sampling_ratio/frac_masked": _masked_mean((r == 0).astype(mask.dtype), um),
        "sampling/frac_missing_logprobs": _masked_mean(missing.astype(mask.dtype), mask),
    }


def opsm_metrics(*, mask: jax.Array, keep: jax.Array) -> dict[str, jax.Array]:
    """``opsm/frac_masked``: fraction of sequences with ≥ 1 loss token that OPSM dropped (§8)."""
    has = (_sg(mask).sum(-1) > 0).astype(mask.dtype)
    return {"opsm/frac_masked": _masked_mean((~keep).astype(mask.dtype), has)}


def completion_metrics(completion_mask: jax.Array, truncated: jax.Array) -> dict[str, jax.Array]:
    """Completion-length metrics (§13.4) from ``completion_mask`` [N, T] and ``truncated`` [N] (no EOS)."""
    cm = jnp.asarray(completion_mask)
    lengths = cm.astype(jnp.promote_types(cm.dtype, jnp.float32)).sum(-1)
    term = (~jnp.asarray(truncated, bool)).astype(lengths.dtype)
    ones = jnp.ones_like(lengths)
    return {
        "completions/mean_length": lengths.mean(),
        "completions/min_length": lengths.min(),
        "completions/max_length": lengths.max(),
        "completions/mean_terminated_length": _masked_mean(lengths, term),
        "completions/min_terminated_length": _masked_min(lengths, term),
        "completions/max_terminated_length": _masked_max(lengths, term),
        "completions/clipped_ratio": _masked_mean(1.0 - term, ones),
    }
