"""EBFT structured mode (ebft.md §8): the GRPO loop with a feature-matching reward.

Per step, on top of :class:`~jrl.train.grpo.GRPOTrainer`'s loop (rollout, update, sync, metrics,
checkpoints, resume, prefetch are all the GRPO trainer's):

1. :meth:`EBFTStructuredTrainer.sampling_params`: with ``adaptive_max_tokens`` the batch's generation
   limit is max(⌊longest ground truth × ``gt_length_multiplier``⌋, ``adaptive_min_tokens``), capped by
   ``rollout.max_new_tokens``. The train step needs static shapes, so completions are still padded
   to ``rollout.max_new_tokens``: the limit only shortens generation.
2. :meth:`~EBFTStructuredTrainer.score_rollout`: the generated side (prompt + completion, without its
   stop token) and the ground-truth side (the same prompt + the ``gt_column`` text tokenised without
   special tokens, cut to ``rollout.max_new_tokens`` tokens; once per group) go through the frozen
   feature network (:func:`jrl.models.features.feature_layers`): with LoRA the policy's own base
   weights with the adapters off, with full fine-tuning a frozen copy of the initial weights. Pooled
   and concatenated (:func:`jrl.losses.embed_layers`), whitened or normalised, they give the rewards
   and the ``ebft/*`` metrics (:func:`jrl.losses.feature_rewards`) as one reward column ``ebft``.
3. :meth:`~EBFTStructuredTrainer.advantages`: :func:`jrl.losses.ebft_advantages` per group with
   ``EBFTConfig.estimator`` (structured default ``group_norm``); the update is the GRPO surrogate of
   ``algo``.
4. With ``ce_coef > 0`` the loss adds ``ce_coef`` × the cross-entropy of the ground-truth completion
   (+ EOS when it fits) given the prompt (ebft.md §14 point 4), logged as ``ebft/ce_loss``.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.data.pipeline import left_pad
from jrl.losses import cross_entropy_loss, ebft_advantages, embed_layers, feature_rewards
from jrl.models.features import feature_layer_indices, feature_layers
from jrl.rollout.base import SamplingParams
from jrl.train.config import TrainConfig
from jrl.train.grpo import PROMPT_PAD_MULTIPLE, GRPOTrainer
from jrl.train.step import GRPOLearner, StepBatch, completion_logprobs


def adaptive_max_new_tokens(gt_lengths, multiplier: float, *, floor: int, cap: int) -> int:
    """The batch's generation limit: min(cap, max(⌊max(gt_lengths) × multiplier⌋, floor)) (ebft.md §8.2,
    capped by the static completion length)."""
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


@functools.partial(jax.jit, static_argnames=("graphdef", "layers", "method", "per_layer_norm", "concat_span",
                                             "disable_lora"))
def _embed(params, frozen, input_ids, mask, prompt_lengths, *, graphdef, layers, method, per_layer_norm,
           concat_span, disable_lora):
    """Feature embeddings [B, E] of the sequences (frozen feature network, no gradient)."""
    model = nnx.merge(graphdef, params, frozen)
    hidden = feature_layers(model, input_ids, layers=layers, disable_lora=disable_lora, attention_mask=mask)
    return embed_layers(hidden, mask, method, per_layer_norm=per_layer_norm, prompt_lengths=prompt_lengths,
                        concat_span=concat_span)


_feature_rewards = jax.jit(feature_rewards, static_argnames=(
    "alignment_coef", "diversity_coef", "use_whitening", "whitening_scope", "whitening_tol", "whitening_ridge"))


@functools.partial(jax.jit, static_argnames=("graphdef", "impl"), donate_argnums=0)
def _ce_micro(acc, params, frozen, batch, weight, coef, *, graphdef, impl):
    """``acc + coef · ∇(weight · CE)`` of one ground-truth micro-batch and its ``weight · CE`` (CE at
    temperature 1; ``weight`` = its share of the step's ground-truth tokens, so the parts sum to the mean)."""
    def loss_fn(p):
        lp, _ = completion_logprobs(nnx.merge(graphdef, p, frozen), batch, temperature=1.0, impl=impl)
        return cross_entropy_loss(lp, batch.completion_mask) * weight

    ce, grads = jax.value_and_grad(loss_fn)(params)
    return jax.tree.map(lambda a, g: a + coef * g, acc, grads), ce


class EBFTLearner(GRPOLearner):
    """:class:`GRPOLearner` plus an optional cross-entropy term on the ground-truth completions.

    ``ce_coef`` and ``ce_batch`` (the ground-truth rows of the step being trained, a :class:`StepBatch`)
    are set by the trainer before :meth:`update`; the CE gradient is added to every update's
    accumulated gradient, and ``ce_coef · CE`` to its ``loss``."""

    ce_coef: float = 0.0
    ce_batch: StepBatch | None = None

    def accumulate_gradients(self, batch: StepBatch, has_signal: np.ndarray):
        acc, collected, skipped = super().accumulate_gradients(batch, has_signal)
        gt = self.ce_batch
        if self.ce_coef <= 0 or gt is None:
            return acc, collected, skipped
        rows = gt.completion_ids.shape[0]
        mb = self.optim.micro_batch_size or rows
        total = max(1.0, float(np.sum(gt.completion_mask)))
        ce = 0.0
        for start in range(0, rows, mb):
            part = gt.rows(slice(start, start + mb))
            weight = jnp.float32(float(np.sum(part.completion_mask)) / total)
            acc, value = _ce_micro(acc, self.params, self.frozen, self._device(part), weight,
                                   jnp.float32(self.ce_coef), graphdef=self.graphdef, impl=self.impl)
            ce += float(value)
        collected["loss"].append(self.ce_coef * ce)
        collected["ebft/ce_loss"] = [ce]
        return acc, collected, skipped


class EBFTStructuredTrainer(GRPOTrainer):
    """The GRPO trainer with EBFT's feature-matching reward (``cfg.ebft.mode == "structured"``)."""

    learner_class = EBFTLearner
    progress_desc = "ebft"

    def __init__(self, cfg: TrainConfig, **kwargs):
        if cfg.ebft is None or cfg.ebft.mode != "structured":
            raise ValueError(f"EBFTStructuredTrainer needs TrainConfig.ebft with mode='structured', got {cfg.ebft!r}")
        super().__init__(cfg, **kwargs)
        self.ebft = cfg.ebft
        self.layers = feature_layer_indices(self.ebft.feature_layers, self.learner.model.config.num_hidden_layers)
        self.learner.ce_coef = float(self.ebft.ce_coef)
        # Full fine-tune: the feature network is a frozen copy of the initial weights (the pretrained
        # ones, also on resume). LoRA: the live base weights with the adapters switched off, no copy.
        self.feature_params = None if self.learner.lora else jax.tree.map(jnp.copy, self.learner.params)
        self._tokenizer_lock = threading.Lock()  # sampling_params may run in the rollout producer thread

    # ------------------------------------------------------------------ ground truth
    def ground_truth_ids(self, prompt_batch) -> list[list[int]]:
        """Token ids of each prompt's ground-truth completion (``gt_column``, no special tokens, uncut)."""
        column = self.ebft.gt_column
        if column not in prompt_batch.columns:
            raise KeyError(f"EBFTConfig.gt_column={column!r} is not a column of the data source "
                           f"{self.cfg.data.source!r}; available columns: {sorted(prompt_batch.columns)}. "
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
        if not self.ebft.adaptive_max_tokens:
            return self.sampling
        limit = self.generation_limit(self.ground_truth_ids(prompt_batch))
        return dataclasses.replace(self.sampling, max_new_tokens=limit)

    # ------------------------------------------------------------------ features and rewards
    def embed(self, input_ids: np.ndarray, mask: np.ndarray, prompt_lengths: np.ndarray) -> jax.Array:
        """Feature embeddings [R, E] of packed rows, in micro-batches of ``optim.micro_batch_size`` rows."""
        e, learner = self.ebft, self.learner
        params = learner.params if self.feature_params is None else self.feature_params
        rows = input_ids.shape[0]
        mb = self.cfg.optim.micro_batch_size or rows
        parts = [_embed(params, learner.frozen, learner._put(input_ids[s:s + mb]), learner._put(mask[s:s + mb]),
                        learner._put(prompt_lengths[s:s + mb]), graphdef=learner.graphdef, layers=self.layers,
                        method=e.embed_method, per_layer_norm=e.per_layer_norm, concat_span=e.concat_span,
                        disable_lora=learner.lora)
                 for s in range(0, rows, mb)]
        return jnp.concatenate(parts, axis=0)

    def score_rollout(self, prompt_batch, completion_ids: list[list[int]], step: int):
        e, g = self.ebft, self.algo.num_generations
        t = self.sampling.max_new_tokens
        stops = set(self.sampling.stop_token_ids)
        gt_full = self.ground_truth_ids(prompt_batch)
        gt = [ids[:t] for ids in gt_full]
        prompts = [list(p) for p in prompt_batch.prompt_ids]
        lp = -(-max(len(p) for p in prompts) // PROMPT_PAD_MULTIPLE) * PROMPT_PAD_MULTIPLE
        # The generated side without its stop token, like the ground truth (which has none).
        generated = [c[:-1] if c and c[-1] in stops else c for c in completion_ids]
        gen_prompts = [p for p in prompts for _ in range(g)]
        gen_ids, gen_mask, _, _ = pack_rows(gen_prompts, generated, pad_id=self.pad_id, prompt_length=lp,
                                            completion_length=t)
        gt_ids, gt_mask, _, _ = pack_rows(prompts, gt, pad_id=self.pad_id, prompt_length=lp, completion_length=t)
        gen_emb = self.embed(gen_ids, gen_mask, np.repeat([len(p) for p in prompts], g).astype(np.int32))
        gt_emb = self.embed(gt_ids, gt_mask, np.asarray([len(p) for p in prompts], np.int32))
        rewards, ebft_metrics = _feature_rewards(
            gen_emb.reshape(len(prompts), g, -1), gt_emb, alignment_coef=e.alignment_coef,
            diversity_coef=e.diversity_coef, use_whitening=e.use_whitening, whitening_scope=e.whitening_scope,
            whitening_ridge=e.whitening_ridge)
        metrics = {k: float(v) for k, v in ebft_metrics.items()}
        metrics["ebft/gt_truncated_frac"] = float(np.mean([len(ids) > t for ids in gt_full]))
        metrics["ebft/max_new_tokens"] = float(self.generation_limit(gt_full))
        if e.ce_coef > 0:
            eos = self.tokenizer.eos_token_id
            targets = [ids + [eos] if eos is not None and len(ids) < t else ids for ids in gt]
            ids, mask, c_ids, c_mask = pack_rows(prompts, targets, pad_id=self.pad_id, prompt_length=lp,
                                                 completion_length=t)
            self.learner.ce_batch = StepBatch(input_ids=ids, attention_mask=mask, completion_ids=c_ids,
                                              completion_mask=c_mask, advantages=np.zeros(len(prompts), np.float32),
                                              truncated=np.asarray([len(x) > t for x in gt_full]))
        return np.asarray(rewards, np.float32).reshape(-1, 1), ["ebft"], metrics

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        g = self.algo.num_generations
        return np.asarray(ebft_advantages(np.asarray(rewards).reshape(-1, g), self.ebft.estimator)).reshape(-1)

    def progress_postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"align": f"{metrics['ebft/alignment']:+.3f} ↑", "cfm": f"{metrics['ebft/cfm_loss']:.3f} ↓",
                "reward": f"{metrics['ebft/reward']:+.3f} ↑", "loss": f"{metrics['loss']:.4f}"}
