"""The typed GRPO-family algorithm config (names and defaults from docs/algorithms/grpo.md §18, decisions from §21).

Only knobs the losses, advantages and IS correction read live here; generation, sync, replay and
async knobs belong to the trainer and rollout configs. Names follow TRL/axolotl where one exists,
with the ``vllm_`` prefix dropped from the sampler-IS knobs because jrl's correction applies to
every rollout backend (embedded JAX sampler or vLLM).

The config is frozen and hashable, so it can be a static argument of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

# Importing the implementing modules registers the built-in names that validation checks against.
from jrl.losses import advantages as _advantages
from jrl.losses import importance as _importance  # noqa: F401  (registers IS modes)
from jrl.losses import policy as _policy
from jrl.losses.registry import ADVANTAGE_ESTIMATORS, IS_MODES, LOSS_TYPES, OBJECTIVES
from jrl.validation import invalid, is_real


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
    """GRPO / BNPO / Dr.GRPO / DAPO / GSPO objective, advantages and sampler correction."""

    # --- rewards and advantages (§1) ---
    num_generations: int = 8
    """G: completions per prompt; the G completions of a prompt are consecutive rows."""
    advantage_estimator: str = "grpo"
    """Registered advantage estimator: ``grpo`` (group-relative, §1.2/§1.3) or ``rloo`` (§1.4)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Std that divides the centred reward: group std, batch std, or none (Dr. GRPO). Booleans are
    rejected (§21 open point 4). Ignored by ``rloo`` and by ``normalize_then_sum``."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """How K reward functions combine: weighted sum then normalise (GRPO), or per-function group
    normalisation, weighted sum, then batch normalisation (GDPO, §1.3, open point 5)."""
    reward_weights: tuple[float, ...] | None = None
    """w_k, one per reward function; None means all 1."""

    # --- policy loss (§3–§5) ---
    objective: str = "ppo_clip"
    """Registered per-token surrogate: ``ppo_clip`` (GRPO / DAPO / GSPO clipped ratio), ``cispo`` (capped,
    gradient-stopped IS weight times logπ; :mod:`jrl.losses.cispo`), ``sapo`` (sigmoid-gated ratio;
    :mod:`jrl.losses.sapo`) or ``vespo`` (gamma-weighted sequence REINFORCE; :mod:`jrl.losses.vespo`).
    docs/algorithms/grpo.md §4 maps each to TRL's ``loss_type`` and parameters."""
    loss_type: str = "dapo"
    """Registered aggregation: ``grpo``, ``bnpo``, ``dr_grpo`` or ``dapo`` (§5; normalisers §12.3)."""
    max_completion_length: int | None = None
    """L_max, the Dr. GRPO normaliser; None means the padded length T of the loss arrays."""
    epsilon: float = 0.2
    """ε_low: lower clip bound 1 − ε."""
    epsilon_high: float | None = None
    """ε_high: upper clip bound 1 + ε_high; None means = ``epsilon`` (DAPO clip-higher uses 0.28). With
    ``objective='cispo'`` it is the absolute cap ε_max of the IS weight, as in TRL (None: 5.0)."""
    delta: float | None = None
    """Two-sided GRPO cap δ on the unclipped branch, min(ρ, δ)·A (§4); must be > 1. None: off."""
    sapo_temperature_pos: float = 1.0
    """``objective='sapo'``: gate temperature τ for tokens with A > 0 (TRL's default)."""
    sapo_temperature_neg: float = 1.05
    """``objective='sapo'``: gate temperature τ for tokens with A ≤ 0 (TRL's default)."""
    vespo_k_pos: float = 2.0
    """``objective='vespo'``: gamma shape k for sequences with A ≥ 0."""
    vespo_lambda_pos: float = 3.0
    """``objective='vespo'``: gamma rate λ for sequences with A ≥ 0."""
    vespo_k_neg: float = 3.0
    """``objective='vespo'``: gamma shape k for sequences with A < 0."""
    vespo_lambda_neg: float = 2.0
    """``objective='vespo'``: gamma rate λ for sequences with A < 0."""
    importance_sampling_level: Literal["token", "sequence", "sequence_token"] = "token"
    """PPO ratio level: per token (§3.1), per sequence (GSPO, §3.2) or GSPO-token (§3.3)."""

    # --- KL (§6) ---
    beta: float = 0.0
    """KL coefficient β of the k3 KL against the reference; 0 disables it (no ref log-probs needed)."""
    use_bias_correction_kl: bool = False
    """Multiply the per-token KL by the policy/old ratio ρ (§6)."""

    # --- masks (§9, §11) ---
    mask_truncated_completions: bool = False
    """Drop completions without EOS from the loss and every normaliser (§11, open point 11)."""
    top_entropy_quantile: float = 1.0
    """q: keep only tokens whose entropy is in the top q fraction (§9); 1.0 keeps all."""

    # --- sampler-vs-trainer correction (§7, §8) ---
    importance_sampling_correction: bool = True
    """Weight the loss by r = π_old / π_sampler when sampler log-probs are given (§7)."""
    importance_sampling_mode: str = "token_truncate"
    """Registered IS mode: ``token_truncate``, ``token_mask``, ``sequence_truncate``, ``sequence_mask``."""
    importance_sampling_cap: float = 3.0
    """C: truncate to min(r, C), or weight 0 above C in mask modes (§7.2); must be ≥ 1."""
    is_ratio_floor: float | None = None
    """Optional lower bound on r: truncate modes clamp up to it, mask modes weigh 0 below it
    (open point 1). ``1 / importance_sampling_cap`` gives axolotl's symmetric variant. None: off."""
    off_policy_mask_threshold: float | None = None
    """OPSM: drop negative-advantage sequences whose mean sampler-vs-policy log-ratio exceeds this
    (§8); 0.5 is a reasonable start. None: off."""

    # --- pipeline signal and logging ---
    skip_zero_advantage_batches: bool = True
    """Skip micro-batches without learning signal on the host, using per-group flags from raw
    rewards (:func:`jrl.losses.group_has_signal`), never ``A == 0`` (§14.8, open point 13)."""
    metrics: Literal["basic", "full"] = "full"
    """Metric level (open point 9): ``full`` adds entropy, ``ess_frac`` and new/old log-prob stats."""

    # ------------------------------------------------------------------------------------------

    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def effective_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss needs per-token entropies (entropy mask or the ``entropy`` metric)."""
        return self.top_entropy_quantile < 1.0 or self.metrics == "full"

    def __post_init__(self) -> None:  # noqa: C901 - one check per field, in field order
        g = self.num_generations
        if not isinstance(g, int) or isinstance(g, bool) or g < 1:
            raise invalid("GRPOConfig", "num_generations", g, "set the group size G, e.g. 8", why="it must be an int >= 1")
        if self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise invalid("GRPOConfig", "advantage_estimator", self.advantage_estimator, f"use one of {ADVANTAGE_ESTIMATORS.names()}", why="no such estimator is registered")
        if isinstance(self.scale_rewards, bool) or self.scale_rewards not in _advantages.SCALE_REWARDS:
            raise invalid("GRPOConfig", "scale_rewards", self.scale_rewards, f"use one of {_advantages.SCALE_REWARDS} (True meant 'group', False meant 'none')", why="booleans are not accepted" if isinstance(self.scale_rewards, bool) else "unknown value")
        if self.multi_objective_aggregation not in _advantages.AGGREGATIONS:
            raise invalid("GRPOConfig", "multi_objective_aggregation", self.multi_objective_aggregation, f"use one of {_advantages.AGGREGATIONS}", why="unknown value")
        if self.advantage_estimator == "rloo":
            if g < 2:
                raise invalid("GRPOConfig", "num_generations", g, "set num_generations >= 2", why="rloo needs a leave-one-out baseline")
            if self.multi_objective_aggregation != "sum_then_normalize":
                raise invalid("GRPOConfig", "multi_objective_aggregation", self.multi_objective_aggregation, "set multi_objective_aggregation='sum_then_normalize' or use advantage_estimator='grpo'", why="rloo works on the weighted reward sum")
        if self.reward_weights is not None:
            w = tuple(self.reward_weights) if isinstance(self.reward_weights, (list, tuple)) else None
            if not w or not all(is_real(x) for x in w):
                raise invalid("GRPOConfig", "reward_weights", self.reward_weights, "give one float per reward function, or None for all 1.0", why="it must be a non-empty sequence of finite numbers")
            object.__setattr__(self, "reward_weights", tuple(float(x) for x in w))
        if self.objective not in OBJECTIVES:
            raise invalid("GRPOConfig", "objective", self.objective, f"use one of {OBJECTIVES.names()}",
                          why="no such objective is registered")
        if self.loss_type not in LOSS_TYPES:
            raise invalid("GRPOConfig", "loss_type", self.loss_type, f"use one of {LOSS_TYPES.names()}", why="no such loss type is registered")
        m = self.max_completion_length
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise invalid("GRPOConfig", "max_completion_length", m, "set the generation limit", why="it must be an int >= 1 or None")
        if not is_real(self.epsilon) or not 0.0 <= self.epsilon < 1.0:
            raise invalid("GRPOConfig", "epsilon", self.epsilon, "use e.g. 0.2", why="it must be in [0, 1) so that 1 - epsilon > 0")
        if self.epsilon_high is not None and (not is_real(self.epsilon_high) or self.epsilon_high < 0.0):
            raise invalid("GRPOConfig", "epsilon_high", self.epsilon_high, "use e.g. 0.28, or None", why="it must be >= 0 or None")
        if self.delta is not None and (not is_real(self.delta) or self.delta <= 1.0):
            raise invalid("GRPOConfig", "delta", self.delta, "use a value above 1 + epsilon_high (e.g. 2.0), or None", why="the cap on the unclipped ratio must be > 1")
        self._check_objective_fields()
        if self.importance_sampling_level not in _policy.IMPORTANCE_SAMPLING_LEVELS:
            raise invalid("GRPOConfig", "importance_sampling_level", self.importance_sampling_level, f"use one of {_policy.IMPORTANCE_SAMPLING_LEVELS}", why="unknown value")
        if not is_real(self.beta) or self.beta < 0.0:
            raise invalid("GRPOConfig", "beta", self.beta, "use 0.0 (no KL) or e.g. 0.04", why="it must be a finite number >= 0")
        for name in (
            "use_bias_correction_kl",
            "mask_truncated_completions",
            "importance_sampling_correction",
            "skip_zero_advantage_batches",
        ):
            if not isinstance(getattr(self, name), bool):
                raise invalid("GRPOConfig", name, getattr(self, name), "use True or False", why="it must be a bool")
        q = self.top_entropy_quantile
        if not is_real(q) or not 0.0 < q <= 1.0:
            raise invalid("GRPOConfig", "top_entropy_quantile", q, "use 1.0 (off) or e.g. 0.2", why="it must be in (0, 1]")
        if self.importance_sampling_mode not in IS_MODES:
            raise invalid("GRPOConfig", "importance_sampling_mode", self.importance_sampling_mode, f"use one of {IS_MODES.names()}", why="no such mode is registered")
        cap = self.importance_sampling_cap
        if not is_real(cap) or cap < 1.0:
            raise invalid("GRPOConfig", "importance_sampling_cap", cap, "use e.g. 3.0", why="the cap C must be a finite number >= 1")
        f = self.is_ratio_floor
        if f is not None and (not is_real(f) or not 0.0 < f <= 1.0):
            raise invalid("GRPOConfig", "is_ratio_floor", f, "use 1 / importance_sampling_cap, or None", why="the floor must be in (0, 1] or None")
        t = self.off_policy_mask_threshold
        if t is not None and not is_real(t):
            raise invalid("GRPOConfig", "off_policy_mask_threshold", t, "use e.g. 0.5, or None", why="it must be a finite number or None")
        if self.metrics not in ("basic", "full"):
            raise invalid("GRPOConfig", "metrics", self.metrics, "use 'basic' or 'full'", why="unknown level")

    def _check_objective_fields(self) -> None:
        """Each objective's own parameters: valid under it, left at their defaults under the others."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for owner, names in OBJECTIVE_FIELDS.items():
            for name in names:
                value = getattr(self, name)
                if self.objective != owner and value != defaults[name]:
                    raise invalid("GRPOConfig", name, value,
                                  f"leave it at {defaults[name]!r} or set objective='{owner}'",
                                  why=f"only objective='{owner}' reads it (objective={self.objective!r})")
                positive = name.startswith(("sapo_temperature", "vespo_lambda"))
                if not is_real(value) or value < 0.0 or (positive and value == 0.0):
                    raise invalid("GRPOConfig", name, value, f"use e.g. {defaults[name]!r}",
                                  why="it must be a finite number " + ("> 0" if positive else ">= 0"))
        if self.delta is not None and self.objective != "ppo_clip":
            raise invalid("GRPOConfig", "delta", self.delta, "leave it None",
                          why=f"only objective='ppo_clip' reads it (objective={self.objective!r})")
        if self.objective == "vespo" and self.importance_sampling_level != "token":
            raise invalid("GRPOConfig", "importance_sampling_level", self.importance_sampling_level, "use 'token'",
                          why="vespo weighs each sequence by its own product of token ratios")
        if self.objective == "cispo" and self.epsilon_high is not None and self.epsilon_high < 1.0:
            warnings.warn(
                f"GRPOConfig.epsilon_high={self.epsilon_high} with objective='cispo' caps the IS weight at "
                f"{self.epsilon_high}, below 1, so every on-policy token is scaled down: CISPO's cap is absolute "
                "(TRL's epsilon_high, ScaleRL's epsilon_max, e.g. 5.0), not ppo_clip's 1 + epsilon_high",
                UserWarning, stacklevel=3)


#: The parameters read by one objective only (refused under the others).
OBJECTIVE_FIELDS = {
    "sapo": ("sapo_temperature_pos", "sapo_temperature_neg"),
    "vespo": ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"),
}
