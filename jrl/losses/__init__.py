"""GRPO-family objectives as pure, jit-able functions of arrays (docs/algorithms/grpo.md §1–§13).

- :mod:`~jrl.losses.advantages`: rewards [N, K] (NaN = None) → advantages [N], signal flags, reward metrics;
- :mod:`~jrl.losses.policy`: masks, PPO ratios (token / GSPO / GSPO-token), clipped surrogate, k3 KL,
  loss-type aggregation with step-global normalisers;
- :mod:`~jrl.losses.importance`: sampler IS weights (4 modes), OPSM, entropy mask;
- :mod:`~jrl.losses.metrics`: metric dicts and their names;
- :mod:`~jrl.losses.registry`: name → function tables for ``objective``, ``loss_type``,
  ``advantage_estimator`` and ``importance_sampling_mode``;
- :mod:`~jrl.losses.cispo`, :mod:`~jrl.losses.sapo`, :mod:`~jrl.losses.vespo`: the CISPO, SAPO and VESPO objectives
  (one registered unit each);
- :mod:`~jrl.losses.config`: :class:`GRPOConfig`;
- :mod:`~jrl.losses.ebft`: EBFT pooling, whitening, feature-matching rewards, advantages and losses;
- :mod:`~jrl.losses.grpo`: :func:`grpo_loss`, the micro-batch loss that ties them together.
"""

from jrl.losses.advantages import (
    advantages_from_config,
    combined_rewards,
    compute_advantages,
    group_has_signal,
    group_relative_advantages,
    group_zero_std,
    reward_metrics,
    rloo_advantages,
    sequence_has_signal,
)
from jrl.losses.config import GRPOConfig
from jrl.losses.ebft import (
    cross_entropy_loss,
    ebft_advantages,
    embed_layers,
    feature_rewards,
    l2_normalize,
    pool_hidden,
    reinforce_loss,
    whiten,
)
from jrl.losses.grpo import LossInputs, grpo_loss, has_learning_signal, policy_logprobs
from jrl.losses.importance import (
    ISWeights,
    entropy_keep,
    entropy_threshold,
    importance_weights,
    opsm_keep,
    sampler_log_ratio,
)
from jrl.losses.metrics import (
    completion_metrics,
    metric_reduction,
    opsm_metrics,
    policy_metrics,
    sampler_metrics,
)
from jrl.losses.policy import (
    Normalizers,
    aggregate_loss,
    aggregation_weights,
    clip_indicators,
    clipped_surrogate,
    k3_kl,
    loss_mask,
    policy_ratio,
    step_normalizers,
)
from jrl.losses import cispo as _cispo  # noqa: F401  (registers the ``cispo`` objective)
from jrl.losses import sapo as _sapo  # noqa: F401  (registers the ``sapo`` objective)
from jrl.losses import vespo as _vespo  # noqa: F401  (registers the ``vespo`` objective)
from jrl.losses.registry import (
    ADVANTAGE_ESTIMATORS,
    IS_MODES,
    LOSS_TYPES,
    OBJECTIVES,
    get_advantage_estimator,
    get_importance_sampling_mode,
    get_loss_type,
    register_advantage_estimator,
    register_importance_sampling_mode,
    register_loss_type,
    register_objective,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "IS_MODES",
    "LOSS_TYPES",
    "OBJECTIVES",
    "GRPOConfig",
    "ISWeights",
    "LossInputs",
    "Normalizers",
    "advantages_from_config",
    "aggregate_loss",
    "aggregation_weights",
    "clip_indicators",
    "clipped_surrogate",
    "combined_rewards",
    "completion_metrics",
    "compute_advantages",
    "cross_entropy_loss",
    "ebft_advantages",
    "embed_layers",
    "entropy_keep",
    "entropy_threshold",
    "feature_rewards",
    "get_advantage_estimator",
    "get_importance_sampling_mode",
    "get_loss_type",
    "group_has_signal",
    "group_relative_advantages",
    "group_zero_std",
    "grpo_loss",
    "has_learning_signal",
    "importance_weights",
    "k3_kl",
    "l2_normalize",
    "loss_mask",
    "metric_reduction",
    "opsm_keep",
    "opsm_metrics",
    "policy_logprobs",
    "policy_metrics",
    "policy_ratio",
    "pool_hidden",
    "register_advantage_estimator",
    "register_importance_sampling_mode",
    "register_loss_type",
    "register_objective",
    "reinforce_loss",
    "reward_metrics",
    "rloo_advantages",
    "sampler_log_ratio",
    "sampler_metrics",
    "sequence_has_signal",
    "step_normalizers",
    "whiten",
]
