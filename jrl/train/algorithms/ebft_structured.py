"""EBFT structured mode: GRPO on prompt → completion data with a feature-matching reward
(docs/algorithms/ebft.md §8).

Per step, on top of the GRPO machinery (:class:`~jrl.train.algorithms.grpo.PolicyUpdate`):

1. generation limit: with ``adaptive_max_tokens`` the batch's limit is max(⌊longest ground truth ×
   ``gt_length_multiplier``⌋, ``adaptive_min_tokens``), capped by ``rollout.max_new_tokens``. The train step
   needs static shapes, so completions are still padded to ``rollout.max_new_tokens``: the limit only
   shortens generation.
2. rewards: the generated side (prompt + completion, without its stop token) and the ground-truth side
   (the same prompt + the ``gt_column`` text tokenised without special tokens, cut to
   ``rollout.max_new_tokens`` tokens; once per group) go through the frozen feature network
   (:func:`jrl.models.features.feature_layers`): with LoRA the policy's own base weights with the adapters
   off, with full fine-tuning a frozen copy of the initial weights. Pooled and concatenated
   (:func:`jrl.losses.embed_layers`), whitened or normalised, they give the rewards and the ``ebft/*``
   metrics (:func:`jrl.losses.feature_rewards`) as one reward column ``ebft``.
3. advantages: :func:`jrl.losses.ebft_advantages` per group with ``EBFTConfig.estimator`` (default
   ``grpo``); the update is the GRPO surrogate of ``algo``.
4. with ``ce_coef > 0`` the update has a second loss term: ``ce_coef`` × the cross-entropy of the
   ground-truth completion (+ EOS when it fits) given the prompt, logged as ``ebft/ce_loss``.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl.data.pipeline import left_pad
from jrl.losses import GRPOConfig, ebft_advantages, embed_layers, feature_rewards, metric_reduction
from jrl.models.features import feature_layer_indices, feature_layers
from jrl.rollout.base import RolloutBatch, SamplingParams
from jrl.train.algorithms.base import ALGORITHMS
from jrl.sources.scored import rollout_metrics
from jrl.train.algorithms.grpo import check_grpo_config, grpo_pipeline
from jrl.train.algorithms.group_sampler import completion_token_lists
from jrl.train.algorithms.grpo_update import PROMPT_PAD_MULTIPLE, StepBatch, build_step_batch, completion_logprobs, \
    row_has_signal
from jrl.train.learner import LossTerm


def adaptive_max_new_tokens(gt_lengths, multiplier: float, *, floor: int, cap: int) -> int:
    """The batch's generation limit: min(cap, max(⌊max(gt_lengths) × multiplier⌋, floor)) (capped by the
    static completion length)."""
    longest = max((int(n) for n in gt_lengths), default=0)
    return int(min(cap, max(int(np.floor(longest * multiplier)), floor)))


def pack_rows(prompts: list[list[int]], completions: list[list[int]], *, pad_id: int, prompt_length: int,
              completion_length: int) -> tuple[np.ndarray, ...]:
    """(input_ids, attention_mask [R, Lp + T], completion_ids, completion_mask [R, T]) int32: each prompt
    left-padded to ``prompt_length``, each completion right-padded to ``completion_length``."""
    p_ids, p_mask = left_pad(prompts, pad_id, length=prompt_length)
    c_ids = np.full((len(completions), completion_length), pad_id, np.int32)
    c_mask = np.zeros_like(c_ids)
    for i, c in enumerate(completions):
        if len(c) > completion_length:
            raise ValueError(f"completion {i} has {len(c)} tokens, more than {completion_length}")
        c_ids[i, :len(c)], c_mask[i, :len(c)] = c, 1
    return np.concatenate([p_ids, c_ids], 1), np.concatenate([p_mask, c_mask], 1), c_ids, c_mask


_feature_rewards = jax.jit(feature_rewards, static_argnames=(
    "alignment_coef", "diversity_coef", "use_whitening", "whitening_scope", "whitening_ridge"))


@dataclasses.dataclass(frozen=True)
class SequenceEmbedding:
    """``model, (input_ids, mask, prompt_lengths) -> [B, E]``: pooled feature-network embeddings."""

    layers: tuple[int, ...]
    method: str
    per_layer_norm: bool
    concat_span: str

    def __call__(self, model, rows, aux=None):
        input_ids, mask, prompt_lengths = rows
        hidden = feature_layers(model, input_ids, layers=self.layers, disable_lora=False, attention_mask=mask)
        return embed_layers(hidden, mask, self.method, per_layer_norm=self.per_layer_norm,
                            prompt_lengths=prompt_lengths, concat_span=self.concat_span)


@dataclasses.dataclass(frozen=True)
class GroundTruthCrossEntropy:
    """``coef`` × the cross-entropy (temperature 1) of ground-truth completions; ``aux`` = the step's
    ground-truth token count, so the micro-batch terms sum to the mean over the step."""

    coef: float
    impl: str

    def __call__(self, model, batch: StepBatch, total_tokens):
        lp, _ = completion_logprobs(model, batch, temperature=1.0, impl=self.impl)
        ce = -jnp.sum(lp * batch.completion_mask) / total_tokens
        return self.coef * ce, {"ebft/ce_loss": ce}


class EBFTExperience(NamedTuple):
    """The experience of a structured EBFT step."""

    policy: StepBatch
    """The generated completions with their feature-matching advantages."""
    ground_truth: StepBatch | None
    """Prompt + ground-truth completion rows of the cross-entropy term (None when ``ce_coef == 0``)."""


def _reduction(name: str) -> str:
    return "sum" if name in ("loss", "ebft/ce_loss") else metric_reduction(name)


def ebft_progress_postfix(metrics: dict[str, float]) -> dict[str, str]:
    """An EBFT step's progress-bar fields (structured and strided alike), each with the direction it should move."""
    return {"align": f"{metrics['ebft/alignment']:+.3f} ↑", "cfm": f"{metrics['ebft/cfm_loss']:.3f} ↓",
            "reward": f"{metrics['ebft/reward']:+.3f} ↑", "loss": f"{metrics['loss']:.4f}"}


@ALGORITHMS.register("ebft_structured")
class EBFTStructured:
    """GRPO with EBFT's feature-matching reward (see the module docstring)."""

    config_type = GRPOConfig
    sections = ("ebft",)
    check_config = staticmethod(check_grpo_config)
    ignores = ("rewards", "env", "scoring", "replay", "reroll", "eval_every", "eval", "docs_per_step", "ebft.stride",
               "ebft.context_length", "ebft.generate_max_len", "ebft.n_samples_per_prompt", "ebft.rl_coef",
               "ebft.min_completion_prefix")
    progress_desc = "ebft"
    plot_keys = ("reward/mean", "loss")
    summary_keys = ("ebft/alignment", "ebft/cfm_loss", "ebft/reward")
    capabilities = frozenset()
    engine_needs = frozenset()
    samples_field = "algo.num_generations"

    def __init__(self, cfg, policy, learner):
        self.ebft, self.data_source = cfg.ebft, cfg.data.source
        self.tokenizer, self.pad_id = policy.tokenizer, policy.pad_id
        self.algo, self.sampling, self.update_policy = grpo_pipeline(cfg, policy, learner)
        e = self.ebft
        self.embedding = SequenceEmbedding(
            feature_layer_indices(e.feature_layers, learner.model.config.num_hidden_layers), e.embed_method,
            e.per_layer_norm, e.concat_span)
        self.cross_entropy = GroundTruthCrossEntropy(float(e.ce_coef), cfg.logprobs_impl)
        # Full fine-tune: the feature network is a frozen copy of the initial weights (the pretrained ones,
        # also on resume). LoRA: the live base weights with the adapters switched off, no copy.
        self.feature_params = None if learner.lora else learner.snapshot()
        self._tokenizer_lock = threading.Lock()  # generate runs in the rollout producer thread when prefetching

    # ------------------------------------------------------------------ ground truth
    def ground_truth_ids(self, prompt_batch) -> list[list[int]]:
        """Token ids of each prompt's ground-truth completion (``gt_column``, no special tokens, uncut)."""
        column = self.ebft.gt_column
        if column not in prompt_batch.columns:
            raise KeyError(f"EBFTConfig.gt_column={column!r} is not a column of the data source "
                           f"{self.data_source!r}; available columns: {sorted(prompt_batch.columns)}. "
                           "Set --ebft.gt-column to the column holding the reference completion")
        texts = prompt_batch.columns[column]
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise TypeError(f"EBFTConfig.gt_column={column!r}: row {prompt_batch.indices[bad[0]]} holds "
                            f"{type(texts[bad[0]]).__name__}, not text; the ground truth must be a string")
        with self._tokenizer_lock:
            return [list(self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    def generation_limit(self, gt_ids: list[list[int]]) -> int:
        """The batch's ``max_new_tokens`` given its ground-truth token ids (:func:`adaptive_max_new_tokens`
        with ``adaptive_max_tokens``, else ``rollout.max_new_tokens``)."""
        if not self.ebft.adaptive_max_tokens:
            return self.sampling.max_new_tokens
        return adaptive_max_new_tokens([len(ids) for ids in gt_ids], self.ebft.gt_length_multiplier,
                                       floor=self.ebft.adaptive_min_tokens, cap=self.sampling.max_new_tokens)

    def sampling_params(self, prompt_batch) -> SamplingParams:
        """The batch's sampling parameters: the ``rollout`` section's, with the adaptive generation limit."""
        if not self.ebft.adaptive_max_tokens:
            return self.sampling
        return dataclasses.replace(self.sampling,
                                   max_new_tokens=self.generation_limit(self.ground_truth_ids(prompt_batch)))

    def generate(self, engine, prompt_batch, *, step: int, seed: int) -> RolloutBatch:
        return engine.generate(prompt_batch.prompt_ids, self.sampling_params(prompt_batch),
                               num_generations=self.algo.num_generations, seed=seed)

    # ------------------------------------------------------------------ experience
    def embed(self, learner, input_ids: np.ndarray, mask: np.ndarray, prompt_lengths: np.ndarray) -> np.ndarray:
        """Feature embeddings [R, E] of packed rows (frozen feature network, no gradient)."""
        return learner.evaluate(self.embedding, (input_ids, mask, prompt_lengths), params=self.feature_params,
                                disable_lora=learner.lora)

    def _prompt_length(self, prompts: list[list[int]]) -> int:
        return -(-max(len(p) for p in prompts) // PROMPT_PAD_MULTIPLE) * PROMPT_PAD_MULTIPLE

    def rewards(self, completion_ids: list[list[int]], prompt_batch, gt_full: list[list[int]],
                learner) -> tuple[np.ndarray, dict[str, float]]:
        """(feature-matching rewards [N, 1], ``ebft/*`` metrics) of the completions of ``prompt_batch`` against its
        ground truth ``gt_full`` (:meth:`ground_truth_ids`)."""
        e, g, t = self.ebft, self.algo.num_generations, self.sampling.max_new_tokens
        stops = set(self.sampling.stop_token_ids)
        gt = [ids[:t] for ids in gt_full]
        prompts = [list(p) for p in prompt_batch.prompt_ids]
        lp = self._prompt_length(prompts)
        # The generated side without its stop token, like the ground truth (which has none).
        generated = [c[:-1] if c and c[-1] in stops else c for c in completion_ids]
        gen_prompts = [p for p in prompts for _ in range(g)]
        gen_ids, gen_mask, _, _ = pack_rows(gen_prompts, generated, pad_id=self.pad_id, prompt_length=lp,
                                            completion_length=t)
        gt_ids, gt_mask, _, _ = pack_rows(prompts, gt, pad_id=self.pad_id, prompt_length=lp, completion_length=t)
        gen_emb = self.embed(learner, gen_ids, gen_mask, np.repeat([len(p) for p in prompts], g).astype(np.int32))
        gt_emb = self.embed(learner, gt_ids, gt_mask, np.asarray([len(p) for p in prompts], np.int32))
        rewards, ebft_metrics = _feature_rewards(
            jnp.asarray(gen_emb).reshape(len(prompts), g, -1), jnp.asarray(gt_emb), alignment_coef=e.alignment_coef,
            diversity_coef=e.diversity_coef, use_whitening=e.use_whitening, whitening_scope=e.whitening_scope,
            whitening_ridge=e.whitening_ridge)
        metrics = {k: float(v) for k, v in ebft_metrics.items()}
        metrics["ebft/gt_truncated_frac"] = float(np.mean([len(ids) > t for ids in gt_full]))
        metrics["ebft/max_new_tokens"] = float(self.generation_limit(gt_full))
        return np.asarray(rewards, np.float32).reshape(-1, 1), metrics

    def ground_truth_batch(self, prompt_batch, gt_full: list[list[int]]) -> StepBatch:
        """The cross-entropy rows: each prompt followed by its ground truth ``gt_full`` (cut to
        ``rollout.max_new_tokens``) and EOS when it fits."""
        t, eos = self.sampling.max_new_tokens, self.tokenizer.eos_token_id
        prompts = [list(p) for p in prompt_batch.prompt_ids]
        targets = [ids[:t] + [eos] if eos is not None and len(ids) < t else ids[:t] for ids in gt_full]
        ids, mask, c_ids, c_mask = pack_rows(prompts, targets, pad_id=self.pad_id,
                                             prompt_length=self._prompt_length(prompts), completion_length=t)
        return StepBatch(input_ids=ids, attention_mask=mask, completion_ids=c_ids, completion_mask=c_mask,
                         advantages=np.zeros(len(prompts), np.float32), truncated=np.asarray([len(x) > t for x in gt_full]))

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        """Advantages [N] of the feature-matching rewards [N, 1], per group (``EBFTConfig.advantage_estimator``)."""
        g = self.algo.num_generations
        return np.asarray(ebft_advantages(rewards.reshape(-1, g), self.ebft.estimator("grpo"))).reshape(-1)

    def make_experience(self, rollout: RolloutBatch, prompt_batch, learner, step: int):
        g = self.algo.num_generations
        gt_full = self.ground_truth_ids(prompt_batch)  # tokenised once per step
        rewards, ebft_metrics = self.rewards(completion_token_lists(rollout), prompt_batch, gt_full, learner)
        metrics = rollout_metrics(rollout, rewards, group_size=g, reward_weights=self.algo.reward_weights,
                                  reward_names=("ebft",))
        metrics.update(ebft_metrics)
        policy = build_step_batch(rollout, self.advantages(rewards), pad_id=self.pad_id,
                                  completion_length=self.sampling.max_new_tokens,
                                  has_signal=row_has_signal(rewards, self.algo))
        ground_truth = self.ground_truth_batch(prompt_batch, gt_full) if self.ebft.ce_coef > 0 else None
        return EBFTExperience(policy, ground_truth), metrics

    def loss_terms(self, learner, experience: EBFTExperience) -> tuple[LossTerm, ...]:
        """The terms besides the GRPO one: the ground-truth cross-entropy when ``ce_coef > 0``."""
        if experience.ground_truth is None:
            return ()
        total = np.float32(max(1.0, float(np.sum(experience.ground_truth.completion_mask))))
        return (LossTerm(self.cross_entropy, experience.ground_truth, total),)

    def update(self, learner, experience: EBFTExperience) -> dict[str, float]:
        return self.update_policy(learner, experience.policy, self.loss_terms(learner, experience), reduction=_reduction)

    def generated_tokens(self, rollout: RolloutBatch) -> int:
        return int(np.asarray(rollout.completion_mask).sum())

    def progress_postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return ebft_progress_postfix(metrics)

    def log_summary(self, metrics: dict[str, float]) -> str:
        return f"reward {metrics['reward/mean']:.4f}"

    def close(self) -> None:
        """Nothing to release: the feature-matching reward runs in the train step's process."""
