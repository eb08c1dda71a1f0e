"""The typed EBFT (energy-based fine-tuning) config: :class:`EBFTConfig`, the ``ebft`` section of a
:class:`~jrl.train.TrainConfig`.

EBFT rewards each sampled continuation for matching the ground-truth continuation in the feature
space of a frozen copy of the model (alignment) and penalises it for resembling its siblings
(diversity). ``TrainConfig.algorithm`` picks the mode: ``ebft_structured`` (prompt → completion data on
the GRPO pipeline) or ``ebft_strided`` (raw documents, many short generated blocks per document); both
sample at the ``rollout`` section's temperature / top-p / top-k.

Whitening note (``whitening_scope="group"``, the default and axolotl's estimator): the whitening
matrix of a group is estimated from that group's n generations only, so the whitened generations
are orthonormal whenever n ≤ the feature size. The diversity term is then ≈0 (``diversity_coef``
is almost inert) and the alignments of a group satisfy Σ_j cos_j² = 1, so the mean alignment (×2)
is at most 2/√n. ``whitening_scope="batch"`` estimates one ridge-regularised whitening from the
centred covariance of every generation of the step, which keeps diversity informative and the
reward scale independent of n. Its whitened vectors are not unit vectors (their squared norms approach
the covariance rank), so the raw-dot-product diversity term can outweigh the bounded cosine alignment:
on the tiny arithmetic model, batch scope with ``diversity_coef=1`` and ``whitening_ridge=1e-3`` drove
the policy to noise (entropy 0.15 → 2.2 in 200 steps); use a much smaller ``diversity_coef`` with it.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Literal

from jrl.losses import ADVANTAGE_ESTIMATORS
from jrl.validation import check_bool, check_choice, check_int, check_real, invalid, is_real

EMBED_METHODS = ("last_token", "mean_pooling", "completion_mean", "concat")
CONCAT_SPANS = ("sequence", "completion")
WHITENING_SCOPES = ("group", "batch")


@dataclasses.dataclass(frozen=True)
class EBFTConfig:
    """Feature network, pooling, whitening, reward, advantage and loss knobs of an EBFT run."""

    # --- features (reference §3, §4) ---
    feature_layers: tuple[float, ...] = (0.25, 0.5, 0.75)
    """Layer depths as fractions of ``num_hidden_layers``: layer ⌊f·L⌋ of the hidden-state tuple
    (0.0 = the embedding output, 1.0 = the final, normed hidden state)."""
    embed_method: Literal["last_token", "mean_pooling", "completion_mean", "concat"] = "last_token"
    """Pooling of each layer's hidden states into one vector: the last real token, the mean over real
    tokens, the mean over completion tokens, or the hidden states at the 1/4, 1/2, 3/4 token
    positions concatenated."""
    per_layer_norm: bool = True
    """L2-normalise each pooled layer vector before concatenating the layers, so every layer weighs
    the same (the cosine of the concatenation is the mean of the per-layer cosines). False reproduces
    axolotl, where the largest-norm layer dominates."""
    concat_span: Literal["sequence", "completion"] = "sequence"
    """Token span whose quartiles ``embed_method='concat'`` reads: the whole sequence (axolotl) or only
    the completion."""

    # --- whitening (reference §5) ---
    use_whitening: bool = False
    """Whiten the embeddings before the rewards (else L2-normalise them). See the module docstring for
    what group-scope whitening does to the diversity term."""
    whitening_scope: Literal["group", "batch"] = "group"
    """``group``: per prompt group, the SVD whitening of that group's generations (axolotl; diversity ≈0,
    Σ cos² = 1 per group); ``batch``: (Σ̂ + ridge·I)^(-1/2) with Σ̂ the centred covariance of all
    generations of the step."""
    whitening_ridge: float = 1e-3
    """Ridge λ added to the batch covariance (``whitening_scope='batch'`` only)."""

    # --- rewards and loss (reference §6, §7) ---
    alignment_coef: float = 1.0
    """α: weight of 2·cos(generated, ground truth) in the reward."""
    diversity_coef: float = 1.0
    """β_div: weight of 2·(mean dot product with the sibling samples) subtracted from the reward."""
    ce_coef: float = 0.0
    """γ: weight of cross-entropy on the ground-truth completion tokens added to the loss (0 = pure
    feature matching; 0.03 is the paper's recommended balance)."""
    advantage_estimator: str | None = None
    """Advantages from the rewards of one group, an ``ADVANTAGE_ESTIMATORS`` name shared with GRPO:
    ``grpo`` (r − mean)/(std + 1e-4), ``rloo`` (r minus the mean of the others) or ``reinforce`` (r
    itself). None: ``grpo`` for ``ebft_structured``, ``rloo`` for ``ebft_strided``."""

    # --- structured mode (reference §8) ---
    adaptive_max_tokens: bool = True
    """Structured: cap each step's generation length at max(⌊longest ground truth of the batch in tokens ×
    ``gt_length_multiplier``⌋, ``adaptive_min_tokens``), never above ``rollout.max_new_tokens`` (the
    train step's static completion length, to which completions are always padded)."""
    gt_length_multiplier: float = 1.5
    """Structured: multiplier of the ground-truth length for ``adaptive_max_tokens``."""
    adaptive_min_tokens: int = 64
    """Structured: floor of the adaptive generation limit (axolotl uses 64)."""
    gt_column: str = "solution"
    """Structured: data column holding each prompt's ground-truth completion text (tokenised without
    special tokens and cut to ``rollout.max_new_tokens`` tokens; ``ebft/gt_truncated_frac`` logs how often)."""

    # --- strided mode (reference §9) ---
    stride: int = 8
    """Strided: tokens between consecutive block anchors."""
    context_length: int = 8
    """Strided: document tokens before the anchor that a generated block attends to directly."""
    generate_max_len: int = 8
    """Strided: tokens generated per block."""
    n_samples_per_prompt: int = 4
    """Strided: rollouts per document (per block). 1 needs ``advantage_estimator='reinforce'`` and
    ``diversity_coef=0`` set explicitly."""
    rl_coef: float = 1.0
    """Strided: weight of the REINFORCE loss."""
    min_completion_prefix: int = 0
    """Strided, structured data: minimum completion tokens before the first anchor."""

    def estimator(self, default: str) -> str:
        """The advantage estimator in effect: ``advantage_estimator``, else the algorithm's ``default``."""
        return self.advantage_estimator or default

    def __post_init__(self) -> None:
        layers = self.feature_layers
        if isinstance(layers, list):
            layers = tuple(layers)
            object.__setattr__(self, "feature_layers", layers)
        if not isinstance(layers, tuple) or not layers or not all(is_real(f) and 0.0 <= f <= 1.0 for f in layers):
            raise invalid("EBFTConfig", "feature_layers", self.feature_layers,
                          "give a non-empty tuple of fractions in [0, 1], e.g. (0.25, 0.5, 0.75)")
        check_choice(self, "embed_method", EMBED_METHODS)
        check_choice(self, "concat_span", CONCAT_SPANS)
        check_bool(self, "per_layer_norm", "use_whitening", "adaptive_max_tokens")
        check_choice(self, "whitening_scope", WHITENING_SCOPES)
        check_real(self, "whitening_ridge", gt=0, fix="use a finite number > 0, e.g. 1e-3")
        for name in ("alignment_coef", "diversity_coef", "ce_coef", "rl_coef"):
            check_real(self, name, ge=0, fix="use a finite number >= 0")
        if self.alignment_coef == 0 and self.diversity_coef == 0:
            raise invalid("EBFTConfig", "alignment_coef", self.alignment_coef,
                          "with diversity_coef=0 too the reward is always 0; set alignment_coef > 0")
        if self.advantage_estimator is not None and self.advantage_estimator not in ADVANTAGE_ESTIMATORS:
            raise invalid("EBFTConfig", "advantage_estimator", self.advantage_estimator,
                          f"use one of {ADVANTAGE_ESTIMATORS.names()}, or None for the algorithm's default "
                          "('group_norm' is now 'grpo')")
        check_real(self, "gt_length_multiplier", ge=0.1, fix="use a number >= 0.1, e.g. 1.5")
        if not isinstance(self.gt_column, str) or not self.gt_column:
            raise invalid("EBFTConfig", "gt_column", self.gt_column, "name the data column holding the ground-truth completion")
        for name in ("adaptive_min_tokens", "stride", "context_length", "generate_max_len", "n_samples_per_prompt"):
            check_int(self, name, lo=1)
        check_int(self, "min_completion_prefix", lo=0)
        if self.n_samples_per_prompt == 1 and (self.advantage_estimator != "reinforce" or self.diversity_coef != 0):
            raise invalid("EBFTConfig", "n_samples_per_prompt", 1,
                          "one sample per document has no baseline and no siblings; set "
                          "advantage_estimator='reinforce' and diversity_coef=0 explicitly, or use >= 2 samples")
        if self.use_whitening and self.whitening_scope == "group" and self.diversity_coef != 0:
            warnings.warn(
                f"EBFTConfig: use_whitening=True with whitening_scope='group' makes each group's whitened "
                f"samples orthonormal, so the diversity term is ~0 and diversity_coef={self.diversity_coef} "
                "has almost no effect; use whitening_scope='batch' for an informative diversity term, or "
                "diversity_coef=0 to silence this warning", UserWarning, stacklevel=3)
