"""GRPO and its family (BNPO, Dr. GRPO, DAPO, GSPO, CISPO... as ``algo`` picks): rewards from reward
functions, group advantages, the clipped-ratio loss of :func:`jrl.losses.grpo_loss`.

Per step: ``num_generations`` completions per prompt at the ``rollout`` section's sampling parameters →
decoded and scored by the reward functions ([N, K], NaN for None) → advantages on the whole batch
(:func:`jrl.losses.advantages_from_config`) and per-group signal flags from the raw rewards → a
:class:`StepBatch` (the experience) → :class:`PolicyUpdate`: ``num_iterations`` passes over the batch, each
one optimizer update per ``docs_per_step`` rows (whole groups; default the whole batch), each update over
micro-batches with normalisers global to the update (:func:`jrl.losses.step_normalizers`), micro-batches
without learning signal skipped and counted in ``skipped_zero_adv_batches`` (docs/algorithms/grpo.md §14.8).

Old log-probs (the PPO ratio's denominator) are always those of the *current* weights, never the
sampler's: with one update per batch the loss uses sg(new), and with more the batch is scored once
before the first update. The sampler's log-probs (of the possibly older version that generated the
batch) feed only the IS correction and OPSM of :mod:`jrl.losses` (docs/algorithms/grpo.md §2.4). With
``beta > 0`` the reference log-probs come from the base weights with LoRA disabled, or from a frozen copy of
the initial weights for a full fine-tune.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl.data.pipeline import left_pad
from jrl.envs import ENVIRONMENTS, EnvSteps, EpisodeRollout, join_episodes, run_episodes
from jrl.envs.chat import observation_encoder
from jrl.kernels._dispatch import backend as kernel_backend
from jrl.losses import (
    GRPOConfig,
    LossInputs,
    advantages_from_config,
    group_has_signal,
    grpo_loss,
    loss_mask,
    metric_reduction,
    reward_metrics,
    sequence_has_signal,
    step_normalizers,
)
from jrl.rollout.base import RolloutBatch, SamplingParams, concat_rollouts, step_seed
from jrl.sharding import batch_shards, on_host
from jrl.train.algorithms.base import ALGORITHMS
from jrl.train.evaluation import Completions, Evaluator
from jrl.train.learner import LossTerm, reduce_metrics, row_slices, take_rows
from jrl.train.packing import loss_extent, pack, per_sequence
from jrl.sources.partial import PartialRollout, PartialRollouts
from jrl.sources.replay import ReplayBuffer
from jrl.sources.scored import ScoredRollout, reward_log_name, rollout_metrics
from jrl.sources.reroll import RerollBuffer, all_fail_groups
from jrl.rewards.pool import RewardScorer, StartedScoring
from jrl.rewards.functions import load_reward_functions

logger = logging.getLogger(__name__)

#: Prompt padding granularity: prompts are left-padded to a multiple of this, bounding recompiles.
PROMPT_PAD_MULTIPLE = 16


class StepBatch(NamedTuple):
    """The experience of one GRPO step (or one micro-batch of it): N rows of host or device arrays."""

    input_ids: np.ndarray
    """[N, Lp + T] int32: left-padded prompt then right-padded completion."""
    attention_mask: np.ndarray
    """[N, Lp + T] int32: prompt mask then completion mask."""
    completion_ids: np.ndarray
    """[N, T] int32."""
    completion_mask: np.ndarray
    """[N, T] int32, 1 on the tokens the loss covers: up to and including the stop token, or a multi-turn episode's
    model-written tokens (its environment's tokens are 0 here and 1 in ``attention_mask``)."""
    advantages: np.ndarray
    """[N] float32."""
    truncated: np.ndarray
    """[N] bool, no stop token."""
    sampler_logprobs: np.ndarray | None = None
    """[N, T] float32 sampler log-probs (NaN where missing)."""
    old_logprobs: np.ndarray | None = None
    """[N, T] float32 log-probs of the weights before the step's first update (filled when mu > 1)."""
    ref_logprobs: np.ndarray | None = None
    """[N, T] float32 reference log-probs (filled when beta > 0)."""
    has_signal: np.ndarray | None = None
    """[N] bool: the row's group has a learning signal (raw rewards not all equal)."""


def trim_completions(batch: StepBatch, width: int) -> StepBatch:
    """``batch`` with its completion columns cut to the first ``width`` (the prompt columns kept)."""
    cut = batch.input_ids.shape[1] - batch.completion_ids.shape[1] + width
    per_token = ("completion_ids", "completion_mask", "sampler_logprobs", "old_logprobs", "ref_logprobs")
    return batch._replace(input_ids=batch.input_ids[:, :cut], attention_mask=batch.attention_mask[:, :cut],
                          **{k: getattr(batch, k)[:, :width] for k in per_token if getattr(batch, k) is not None})


def length_groups(lengths: np.ndarray, micro_batch_size: int, bucket: int, width: int) -> list[tuple[np.ndarray, int]]:
    """(row indices, completion width) of runs of micro-batches: rows sorted by ``lengths`` (longest first),
    ``micro_batch_size`` at a time, each micro-batch's width the multiple of ``bucket`` covering its longest row
    (at most ``width``); consecutive micro-batches of one width form one run."""
    order = np.argsort(-np.asarray(lengths), kind="stable")
    groups: list[tuple[list, int]] = []
    for start in range(0, len(order), micro_batch_size):
        rows = order[start:start + micro_batch_size]
        w = min(width, max(bucket, -(-int(lengths[rows].max()) // bucket) * bucket))
        if groups and groups[-1][1] == w:
            groups[-1][0].extend(rows)
        else:
            groups.append((list(rows), w))
    return [(np.asarray(rows), w) for rows, w in groups]


def build_step_batch(rollout: RolloutBatch, advantages: np.ndarray, *, pad_id: int, completion_length: int,
                     has_signal: np.ndarray | None = None, prompt_multiple: int = PROMPT_PAD_MULTIPLE) -> StepBatch:
    """Train-step arrays from a rollout: prompts left-padded to a multiple of ``prompt_multiple``,
    completions right-padded to ``completion_length`` (static shapes across steps)."""
    n, t = rollout.completion_ids.shape
    if t > completion_length:
        raise ValueError(f"the rollout has completions of {t} tokens, more than max_new_tokens={completion_length}")
    p_ids, p_mask = left_pad(rollout.prompt_lists(), pad_id, multiple_of=prompt_multiple)
    pad = completion_length - t
    c_ids = np.pad(np.asarray(rollout.completion_ids, np.int32), ((0, 0), (0, pad)), constant_values=pad_id)
    c_mask = np.pad(np.asarray(rollout.completion_mask, np.int32), ((0, 0), (0, pad)))
    loss = c_mask if rollout.loss_mask is None else np.pad(np.asarray(rollout.loss_mask, np.int32), ((0, 0), (0, pad)))
    samp = np.pad(np.asarray(rollout.sampling_logprobs, np.float32), ((0, 0), (0, pad)), constant_values=np.nan)
    return StepBatch(
        input_ids=np.concatenate([np.asarray(p_ids, np.int32), c_ids], axis=1),
        attention_mask=np.concatenate([np.asarray(p_mask, np.int32), c_mask], axis=1),
        completion_ids=c_ids, completion_mask=loss, advantages=np.asarray(advantages, np.float32),
        truncated=np.asarray(rollout.truncated, bool), sampler_logprobs=samp,
        has_signal=None if has_signal is None else np.asarray(has_signal, bool))


def completion_hidden(model, batch: StepBatch):
    """[N, T, H] final hidden states that predict ``batch.completion_ids`` (one position before each)."""
    t = batch.completion_ids.shape[1]
    lp_len = batch.input_ids.shape[1] - t
    hidden = model.hidden_states(batch.input_ids, attention_mask=batch.attention_mask)
    return hidden[:, lp_len - 1: lp_len - 1 + t]


def completion_logprobs(model, batch: StepBatch, *, temperature: float, impl: str = "auto",
                        with_entropy: bool = False):
    """(logπ [N, T], entropy [N, T] or None) of ``batch.completion_ids`` under ``model`` at ``temperature``."""
    return model.token_logprobs(completion_hidden(model, batch), batch.completion_ids, temperature=temperature,
                                with_entropy=with_entropy, impl=impl)


@dataclasses.dataclass(frozen=True)
class CompletionLogprobs:
    """``model, batch -> logπ [N, T]`` of the completions (old / reference scoring, no gradient)."""

    temperature: float
    impl: str

    def __call__(self, model, batch: StepBatch, aux=None):
        return completion_logprobs(model, batch, temperature=self.temperature, impl=self.impl)[0]


def _loss_inputs(batch: StepBatch, lp, ent) -> LossInputs:
    return LossInputs(advantages=batch.advantages, completion_mask=batch.completion_mask, logprobs=lp, entropy=ent,
                      old_logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs,
                      sampler_logprobs=batch.sampler_logprobs, truncated=batch.truncated)


@dataclasses.dataclass(frozen=True)
class GRPORowLoss:
    """``grpo_loss`` of some rows of a step under the step's normalisers (the ``row_loss`` of
    :func:`jrl.kernels.logprobs.fused_head_loss`: the step loss is its sum over any split of the rows)."""

    algo: GRPOConfig

    def __call__(self, lp, ent, rows: StepBatch, normalizers):
        return grpo_loss(_loss_inputs(rows, lp, ent), self.algo, normalizers)[0]


def fused_head_supported(algo: GRPOConfig) -> bool:
    """The loss sums over rows (no batch-wide entropy threshold), so the loss-fused head can compute it."""
    return algo.top_entropy_quantile >= 1.0


@dataclasses.dataclass(frozen=True)
class GRPOLoss:
    """``grpo_loss`` of a micro-batch under ``model`` at the sampling temperature (``aux``: the step's
    normalisers). With ``fused_head`` the loss and its head gradients come from the loss-fused LM head
    (:meth:`jrl.models.transformer.Transformer.head_loss`), else from the ``impl`` log-prob kernel."""

    algo: GRPOConfig
    temperature: float
    impl: str
    fused_head: bool = False

    def __call__(self, model, batch: StepBatch, normalizers):
        if not self.fused_head:
            lp, ent = completion_logprobs(model, batch, temperature=self.temperature, impl=self.impl,
                                          with_entropy=self.algo.needs_entropy)
            return grpo_loss(_loss_inputs(batch, lp, ent), self.algo, normalizers)
        rows = batch._replace(input_ids=None, attention_mask=None, has_signal=None)
        loss, lp, ent = model.head_loss(completion_hidden(model, batch), batch.completion_ids, GRPORowLoss(self.algo),
                                        rows, normalizers, temperature=self.temperature,
                                        with_entropy=self.algo.needs_entropy)
        _, metrics = grpo_loss(_loss_inputs(batch, lp, ent), self.algo, normalizers)
        return loss, metrics


class PackedStep(NamedTuple):
    """A GRPO step's rows packed (:mod:`jrl.train.packing`): R packed rows of width W, up to S sequences each, with the
    sequences' per-token arrays in the padded layout ([R, S, T]) and per-sequence ones [R, S]."""

    input_ids: np.ndarray
    segment_ids: np.ndarray
    scored: np.ndarray
    targets: np.ndarray
    gather: np.ndarray
    completion_mask: np.ndarray
    advantages: np.ndarray
    truncated: np.ndarray
    sampler_logprobs: np.ndarray | None = None
    old_logprobs: np.ndarray | None = None
    ref_logprobs: np.ndarray | None = None


def packed_step(batch: StepBatch, learner) -> tuple[PackedStep, np.ndarray]:
    """``batch`` packed (:func:`jrl.train.packing.pack`) into micro-batches of ``learner``'s size (or a power of two
    of rows, at least the batch's shards) and the padded row of each sequence slot [R, S] (-1: empty)."""
    rows = pack(batch.input_ids, batch.attention_mask, batch.completion_mask,
                rows_multiple=learner.optim.micro_batch_size, least_rows=batch_shards(learner.mesh, learner.rules))
    seq = rows.sequence
    return PackedStep(
        input_ids=rows.input_ids, segment_ids=rows.segment_ids, scored=rows.scored, targets=rows.targets,
        gather=rows.gather,
        completion_mask=per_sequence(batch.completion_mask, seq, 0), advantages=per_sequence(batch.advantages, seq, 0),
        truncated=per_sequence(batch.truncated, seq, False),
        sampler_logprobs=per_sequence(batch.sampler_logprobs, seq, np.nan),
        old_logprobs=per_sequence(batch.old_logprobs, seq, 0), ref_logprobs=per_sequence(batch.ref_logprobs, seq, 0),
    ), seq


def packed_logprobs(model, packed: PackedStep, *, temperature: float, impl: str, with_entropy: bool = False):
    """(logπ, entropy or None) [R·S, T] of each sequence slot's completion tokens in packed rows: the ``impl``
    log-prob kernel over each row's scored columns, gathered into the padded layout."""
    r, s, t = packed.gather.shape
    hidden = model.hidden_states(packed.input_ids, segment_ids=packed.segment_ids, max_segments=s + 1)
    scored = jnp.take_along_axis(hidden, packed.scored[:, :, None], axis=1)  # [R, C, H]
    lp, ent = model.token_logprobs(scored, packed.targets, temperature=temperature, with_entropy=with_entropy,
                                   impl=impl)

    def per_slot(x):
        return None if x is None else jnp.take_along_axis(x, packed.gather.reshape(r, s * t), axis=1).reshape(r * s, t)

    return per_slot(lp), per_slot(ent)


@dataclasses.dataclass(frozen=True)
class PackedCompletionLogprobs:
    """``model, packed -> logπ [R, S, T]`` of packed rows' completions (old / reference scoring, no gradient)."""

    temperature: float
    impl: str

    def __call__(self, model, packed: PackedStep, aux=None):
        lp, _ = packed_logprobs(model, packed, temperature=self.temperature, impl=self.impl)
        return lp.reshape(packed.gather.shape)


@dataclasses.dataclass(frozen=True)
class PackedGRPOLoss:
    """``grpo_loss`` of packed rows (:func:`packed_logprobs`): the padded loss over the sequence slots ([R·S, T];
    an empty slot has no loss token)."""

    algo: GRPOConfig
    temperature: float
    impl: str

    def __call__(self, model, packed: PackedStep, normalizers):
        r, s = packed.advantages.shape
        lp, ent = packed_logprobs(model, packed, temperature=self.temperature, impl=self.impl,
                                  with_entropy=self.algo.needs_entropy)

        def flat(x):
            return None if x is None else x.reshape((r * s,) + x.shape[2:])

        rows = StepBatch(input_ids=None, attention_mask=None, completion_ids=None,
                         completion_mask=flat(packed.completion_mask), advantages=flat(packed.advantages),
                         truncated=flat(packed.truncated), sampler_logprobs=flat(packed.sampler_logprobs),
                         old_logprobs=flat(packed.old_logprobs), ref_logprobs=flat(packed.ref_logprobs))
        return grpo_loss(_loss_inputs(rows, lp, ent), self.algo, normalizers)


def _with_completion_length(loss: GRPOLoss, width: int) -> GRPOLoss:
    """``loss`` for rows trimmed from ``width`` completion columns: ``dr_grpo``'s constant stays ``width``."""
    if loss.algo.max_completion_length is not None:
        return loss
    return dataclasses.replace(loss, algo=dataclasses.replace(loss.algo, max_completion_length=width))


@functools.partial(jax.jit, static_argnames=("mask_truncated", "num_micro_batches"))
def _step_mask_and_normalizers(completion_mask, truncated, *, mask_truncated: bool, num_micro_batches: int):
    """(loss mask [B, T], the step's normalisers) in one program (on the host's CPU device under ``on_host``:
    the same math as separate eager ops cost ~2 ms of dispatches per step with the accelerator waiting)."""
    mask = loss_mask(completion_mask, None, truncated, mask_truncated_completions=mask_truncated)
    return mask, step_normalizers(mask, num_micro_batches=num_micro_batches)


def _grpo_reduction(name: str) -> str:
    return "sum" if name == "loss" else metric_reduction(name)


class PolicyUpdate:
    """The GRPO-family update of a :class:`StepBatch`: reference and old log-probs when needed, then
    ``num_iterations`` passes over the batch, each one learner step per ``docs_per_step`` rows (None: the whole
    batch) on the GRPO loss plus any ``extra_terms`` (e.g. EBFT's cross-entropy; whole batches only)."""

    def __init__(self, algo: GRPOConfig, learner, *, temperature: float, num_iterations: int, impl: str,
                 loss_head: str = "auto", docs_per_step: int | None = None):
        self.algo, self.mu, self.docs = algo, int(num_iterations), docs_per_step
        fused = loss_head == "fused" or (loss_head == "auto" and kernel_backend() != "cpu")
        self.loss = GRPOLoss(algo, float(temperature), impl, fused and fused_head_supported(algo))
        self.logprobs = CompletionLogprobs(float(temperature), impl)
        self.packed_logprobs = PackedCompletionLogprobs(float(temperature), impl)
        # Full fine-tune with a KL term: a frozen copy of the initial weights is the reference.
        self.ref_params = learner.snapshot() if algo.beta != 0.0 and not learner.lora else None

    def parts(self, n: int) -> list[slice]:
        """The rows of each optimizer update of one pass over a batch of ``n`` rows."""
        return row_slices(n, self.docs)

    def prepare(self, learner, batch: StepBatch) -> StepBatch:
        """``batch`` with the reference log-probs (``beta > 0``) and the old log-probs (more than one update per
        batch) of the current weights filled in (computed on packed rows with ``optim.packing``; 0 past each row's
        last loss token)."""
        need_ref = self.algo.beta != 0.0 and batch.ref_logprobs is None
        need_old = self.mu * len(self.parts(batch.completion_ids.shape[0])) > 1 and batch.old_logprobs is None
        if not (need_ref or need_old):
            return batch
        if learner.optim.packing:
            packed, seq = packed_step(batch, learner)
            fn, rows = self.packed_logprobs, packed._replace(completion_mask=None, advantages=None, truncated=None,
                                                             sampler_logprobs=None)
        else:
            fn, rows = self.logprobs, batch._replace(has_signal=None)

        def score(**kwargs) -> np.ndarray:
            values = learner.evaluate(fn, rows, **kwargs)
            if not learner.optim.packing:
                return values
            out = np.zeros(batch.completion_ids.shape, np.float32)
            out[seq[seq >= 0]] = values[seq >= 0]
            return out

        if need_ref:
            batch = batch._replace(ref_logprobs=score(disable_lora=learner.lora, params=self.ref_params))
        if need_old:
            batch = batch._replace(old_logprobs=score())
        return batch

    def policy_term(self, learner, batch: StepBatch) -> LossTerm:
        """The GRPO loss term of ``batch``: step-global normalisers, and the rows without learning signal
        (``has_signal``) not kept when ``skip_zero_advantage_batches``."""
        cfg = self.algo
        num_micro_batches = len(learner.micro_slices(batch.completion_ids.shape[0]))
        with on_host():
            mask, norms = _step_mask_and_normalizers(
                np.asarray(batch.completion_mask), np.asarray(batch.truncated),
                mask_truncated=cfg.mask_truncated_completions, num_micro_batches=num_micro_batches)
        mask = np.asarray(mask)
        keep = None
        if cfg.skip_zero_advantage_batches:
            signal = np.ones(len(mask), bool) if batch.has_signal is None else batch.has_signal
            keep = signal & (mask.sum(-1) > 0)
        return LossTerm(self.loss, batch._replace(has_signal=None), norms, keep)

    def policy_terms(self, learner, batch: StepBatch) -> list[LossTerm]:
        """:meth:`policy_term` of ``batch`` as the loss terms of one update: with ``optim.packing`` one term of
        packed rows (:class:`PackedGRPOLoss`); with ``optim.length_bucket`` and several micro-batches, one term per
        run of micro-batches of one trimmed width (:func:`length_groups`), each with the step's normalisers and the
        padded length as ``max_completion_length`` (``dr_grpo``); either way the loss and gradient are the padded
        ones (``bnpo`` keeps the padded term); else the term itself."""
        term = self.policy_term(learner, batch)
        n, width = batch.completion_ids.shape
        if learner.optim.packing and self.algo.loss_type != "bnpo":
            packed, seq = packed_step(term.rows, learner)
            keep = None if term.keep is None else (term.keep[np.maximum(seq, 0)] & (seq >= 0)).any(axis=1)
            return [LossTerm(PackedGRPOLoss(self.algo, self.loss.temperature, self.loss.impl), packed, term.aux, keep)]
        bucket, mb = learner.optim.length_bucket, learner.optim.micro_batch_size or n
        if not bucket or width <= bucket or self.algo.loss_type == "bnpo":
            return [term]
        groups = length_groups(loss_extent(batch.completion_mask), mb, bucket, width)
        if len(groups) == 1 and groups[0][1] == width:
            return [term]
        loss = _with_completion_length(self.loss, width)
        return [LossTerm(loss, trim_completions(take_rows(term.rows, rows), w), term.aux,
                         None if term.keep is None else term.keep[rows]) for rows, w in groups]

    def __call__(self, learner, batch: StepBatch, extra_terms: tuple[LossTerm, ...] = (),
                 reduction: Callable[[str], str] = _grpo_reduction) -> dict[str, float]:
        batch = self.prepare(learner, batch)
        parts = self.parts(batch.completion_ids.shape[0])
        if extra_terms and len(parts) > 1:
            raise ValueError("docs_per_step splits the policy term only; an update with extra loss terms takes the "
                             "whole batch")
        terms = [self.policy_terms(learner, take_rows(batch, sl)) for sl in parts]
        updates, skipped = [], 0
        for _ in range(self.mu):
            skipped = 0  # micro-batches skipped in one pass over the batch
            for part in terms:
                collected, n = learner.step([*part, *extra_terms])
                updates.append(collected)
                skipped += n
        out = reduce_metrics(updates, reduction)
        out["skipped_zero_adv_batches"] = float(skipped)
        return out


def row_has_signal(rewards: np.ndarray, algo: GRPOConfig) -> np.ndarray:
    """[N] bool: the row's group has a learning signal (its raw rewards [N, K] are not all equal)."""
    g = algo.num_generations
    return np.asarray(sequence_has_signal(group_has_signal(
        rewards, group_size=g, reward_weights=algo.reward_weights, aggregation=algo.multi_objective_aggregation), g))


def completion_rows(rollout: RolloutBatch) -> list[np.ndarray]:
    """The completions of a rollout as int32 arrays (up to and including the stop token)."""
    lengths = np.asarray(rollout.completion_mask).sum(-1).astype(int)
    return [row[:n] for row, n in zip(np.asarray(rollout.completion_ids, np.int32), lengths)]


def completion_token_lists(rollout: RolloutBatch) -> list[list[int]]:
    """The completions of a rollout as token-id lists (up to and including the stop token)."""
    return [row.tolist() for row in completion_rows(rollout)]


def decoded_completions(tokenizer, rollout: RolloutBatch) -> tuple[list[str], list[list[int]]]:
    """``(texts, token-id lists)`` of a rollout's completions, special tokens skipped in the texts. The tokenizer
    gets arrays, not lists: a Hugging Face tokenizer converts an array with one ``tolist`` but checks a list's
    every element in Python (half the host time of a step's decoding at a thousand completions)."""
    rows = completion_rows(rollout)
    return [tokenizer.decode(row, skip_special_tokens=True) for row in rows], [row.tolist() for row in rows]


def grpo_sampling(cfg, policy) -> tuple[GRPOConfig, SamplingParams]:
    """``algo`` with the run's reward weights, and the sampling parameters (the ``rollout`` section, stopping at
    EOS)."""
    algo = dataclasses.replace(cfg.algo, reward_weights=cfg.reward_weights)
    eos = policy.tokenizer.eos_token_id
    return algo, cfg.rollout.sampling_params(() if eos is None else (int(eos),))


def grpo_pipeline(cfg, policy, learner) -> tuple[GRPOConfig, SamplingParams, PolicyUpdate]:
    """What every GRPO-pipeline algorithm builds from the config: :func:`grpo_sampling` and the policy update at
    that temperature."""
    algo, sampling = grpo_sampling(cfg, policy)
    update = PolicyUpdate(algo, learner, temperature=sampling.temperature, num_iterations=cfg.num_iterations,
                          impl=cfg.logprobs_impl, loss_head=cfg.loss_head, docs_per_step=cfg.docs_per_step)
    return algo, sampling, update


@dataclasses.dataclass
class StreamedRollout:
    """A rollout generated chunk by chunk with each chunk's reward calls already sent (``scoring.stream_groups``)."""

    rollout: RolloutBatch
    scoring: list[StartedScoring]
    """The started scoring of each chunk, in row order (none for episodes without reward functions)."""
    episodes: EpisodeRollout | None = None
    """With ``env.name``: the chunks' episodes joined (``rollout`` is theirs)."""

    @property
    def policy_version(self) -> int:
        return self.rollout.policy_version


FLAT_REWARD_STEPS = 5
"""Consecutive steps whose groups all got equal rewards (every advantage zero: nothing learned) before a
warning."""


class GroupSampler:
    """The rollout side of GRPO: ``num_generations`` completions per prompt at the run's sampling parameters,
    scored by the reward functions (in worker processes, :class:`~jrl.rewards.pool.RewardScorer`). The
    trainer's :class:`GRPO` uses it in one process; an explorer process uses it alone."""

    def __init__(self, cfg, policy):
        self.tokenizer, self.pad_id = policy.tokenizer, policy.pad_id
        self.algo, self.sampling = grpo_sampling(cfg, policy)
        self.scorer = RewardScorer(load_reward_functions(cfg.rewards), num_workers=cfg.scoring.num_workers,
                                   timeout_s=cfg.scoring.timeout_s, max_failed_steps=cfg.scoring.max_failed_steps)
        self.stream = cfg.scoring.stream_groups
        self.env_cfg = cfg.env
        self.env = None if cfg.env.name is None else ENVIRONMENTS.get(cfg.env.name)(cfg.env)
        self.env_steps = None if self.env is None else EnvSteps(cfg.env.step_timeout_s)
        self.encode_observation = observation_encoder(self.tokenizer, cfg.env.observation_role)
        self.partial = (PartialRollouts(num_generations=self.algo.num_generations,
                                        groups_per_step=cfg.data.prompts_per_batch,
                                        max_staleness=cfg.rollout.max_staleness, pad_id=self.pad_id)
                        if cfg.rollout.partial else None)

    def generate(self, engine, prompt_batch, *,
                 seed: int) -> RolloutBatch | StreamedRollout | EpisodeRollout | PartialRollout:
        """The batch's completions; with ``scoring.stream_groups``, generated in chunks of that many prompts (chunk
        ``k`` sampled with a seed derived from ``seed`` and ``k``), each chunk's rewards started once it is out; with
        ``env.name``, episodes against the environment (:func:`jrl.envs.run_episodes`); with ``rollout.partial``,
        the first finished groups of those carried and these prompts' (:mod:`jrl.sources.partial`)."""
        g = self.algo.num_generations
        if self.partial is not None:
            return self.partial.generate(engine, prompt_batch, self.sampling, seed=seed)
        if not self.stream:
            return self._sample(engine, prompt_batch, self.sampling, num_generations=g, seed=seed)
        parts, started = [], []
        for k, start in enumerate(range(0, len(prompt_batch), self.stream)):
            chunk = prompt_batch.rows(slice(start, start + self.stream))
            parts.append(self._sample(engine, chunk, self.sampling, num_generations=g, seed=step_seed(seed, k)))
            if self.scorer.fns:
                started.append(self._start_scoring(parts[-1] if self.env is None else parts[-1].rollout, chunk))
        if self.env is None:
            return StreamedRollout(concat_rollouts(parts, self.pad_id), started)
        episodes = join_episodes(parts, self.pad_id)
        return StreamedRollout(episodes.rollout, started, episodes)

    def _start_scoring(self, rollout: RolloutBatch, prompt_batch) -> StartedScoring:
        g = self.algo.num_generations
        texts, ids = decoded_completions(self.tokenizer, rollout)
        rep = prompt_batch.repeat(g)
        return self.scorer.start(rep.prompts, texts, ids, rep.columns, group_size=g)

    def score(self, rollout: RolloutBatch | StreamedRollout | EpisodeRollout | PartialRollout, prompt_batch,
              step: int) -> ScoredRollout:
        """The rollout of ``prompt_batch`` with its rewards (a partial rollout's own prompts instead); ``step``
        (0-based) names the step in logs and counts consecutive failing steps. Episodes add their reward as the last
        column (``env/<name>``), after the reward functions' (scored on the whole episode's text)."""
        if isinstance(rollout, PartialRollout):
            rollout, prompt_batch = rollout.rollout, rollout.prompt_batch
        if isinstance(rollout, EpisodeRollout):
            return self._score_episodes(rollout, prompt_batch, step)
        if isinstance(rollout, StreamedRollout) and rollout.episodes is not None:
            return self._score_episodes(rollout.episodes, prompt_batch, step, started=rollout.scoring)
        if isinstance(rollout, StreamedRollout):
            started, rollout = rollout.scoring, rollout.rollout
        else:
            started = [self._start_scoring(rollout, prompt_batch)]
        rewards, names, failures = self.scorer.finish(started, step=step + 1)
        for name, column in zip(names, np.asarray(rewards).T):
            if np.all(np.isnan(column)):
                logger.warning("step %d: reward function %r gave no reward (None/NaN, or a failed call) for any "
                               "completion, so it adds nothing to the advantages; check the function "
                               "(reward/%s/mean is null in metrics.jsonl)", step + 1, name, name)
        return ScoredRollout(rollout, np.asarray(rewards, np.float32), tuple(names), dict(failures))

    def generate_once(self, engine, prompt_batch, sampling: SamplingParams, *,
                      seed: int) -> RolloutBatch | EpisodeRollout:
        """One completion per prompt at ``sampling`` (held-out evaluation): an episode each with an environment."""
        return self._sample(engine, prompt_batch, sampling, num_generations=1, seed=seed)

    def _sample(self, engine, prompt_batch, sampling: SamplingParams, *, num_generations: int,
                seed: int) -> RolloutBatch | EpisodeRollout:
        """``num_generations`` completions per prompt, or with an environment as many episodes."""
        if self.env is None:
            return engine.generate(prompt_batch.prompt_ids, sampling, num_generations=num_generations, seed=seed)
        return run_episodes(engine, self.env, prompt_batch, sampling, num_generations=num_generations, seed=seed,
                            cfg=self.env_cfg, encode=self.encode_observation,
                            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
                            pad_id=self.pad_id, steps=self.env_steps)

    def with_episode_rewards(self, rewards, names: tuple, episode_rewards: np.ndarray) -> tuple[np.ndarray, tuple]:
        """The reward functions' columns (None: the run has none) with the episodes' reward as the last one."""
        rewards = np.zeros((len(episode_rewards), 0), np.float32) if rewards is None else np.asarray(rewards,
                                                                                                       np.float32)
        return (np.concatenate([rewards, np.asarray(episode_rewards, np.float32)[:, None]], axis=1),
                (*names, f"env/{self.env_cfg.name}"))

    def _score_episodes(self, episodes: EpisodeRollout, prompt_batch, step: int,
                        started: list[StartedScoring] | None = None) -> ScoredRollout:
        """Episodes with the reward functions' columns (their calls ``started`` already when streamed) and the
        episode reward as the last one."""
        rollout, rewards, names, failures = episodes.rollout, None, (), {}
        if self.scorer.fns:
            scored = self.score(rollout if started is None else StreamedRollout(rollout, started), prompt_batch, step)
            rewards, names, failures = scored.rewards, scored.reward_names, scored.failures
        rewards, names = self.with_episode_rewards(rewards, names, episodes.rewards)
        env = {f"env/errors/{kind}": float(count) for kind, count in sorted(episodes.errors.items())}
        env.update({"env/turns/mean": float(np.mean(episodes.turns)),
                    "env/model_tokens/mean": float(np.asarray(rollout.loss_mask).sum(-1).mean())})
        return ScoredRollout(rollout, rewards, names, {**failures, **env})

    def close(self) -> None:
        self.scorer.close()
        if self.env_steps is not None:
            self.env_steps.close()


@ALGORITHMS.register("grpo")
class GRPO:
    """GRPO-family training with reward functions (see the module docstring). With ``mode='train'`` the rollouts
    arrive scored (:class:`ScoredRollout`, from explorer processes) and no sampler is built."""

    ignores = ("ebft",)
    progress_desc = "grpo"
    plot_keys = ("reward/mean", "loss")
    summary_keys = ("reward/mean",)
    capabilities = frozenset({"state", "reroll", "explorer", "partial"})
    engine_needs = frozenset()
    samples_field = "algo.num_generations"
    explorer = GroupSampler
    """What an explorer process runs (``mode='explore'``, :mod:`jrl.train.exploration`)."""

    def __init__(self, cfg, policy, learner):
        self.pad_id = policy.pad_id
        self.algo, self.sampling, self.update_policy = grpo_pipeline(cfg, policy, learner)
        self.sampler = GroupSampler(cfg, policy) if cfg.mode == "both" else None
        #: Completion columns of a step batch: a turn's tokens, or an episode's.
        self.completion_length = cfg.env.max_episode_tokens if cfg.env.name else self.sampling.max_new_tokens
        self._flat_steps = 0  # consecutive steps without a learning signal
        g = self.algo.num_generations
        self.replay = ReplayBuffer(cfg.replay, group_size=g, seed=cfg.seed) if cfg.replay.buffer_size else None
        self.reroll = (RerollBuffer(cfg.reroll, max_steps=cfg.max_steps, lag=cfg.rollout.prefetch_depth)
                       if cfg.reroll.start_fraction < 1 else None)

    def generate(self, engine, prompt_batch, *, seed: int) -> RolloutBatch | StreamedRollout:
        return self.sampler.generate(engine, prompt_batch, seed=seed)

    def make_experience(self, rollout: RolloutBatch | StreamedRollout | ScoredRollout, prompt_batch, learner,
                        step: int):
        scored = rollout if isinstance(rollout, ScoredRollout) else self.sampler.score(rollout, prompt_batch, step)
        with on_host():
            batch, metrics = self._experience(scored, prompt_batch, step)
        return batch, {**metrics, **(rollout.metrics if isinstance(rollout, PartialRollout) else {})}

    def _experience(self, scored: ScoredRollout, prompt_batch, step: int):
        """The step batch and metrics of a scored rollout (host arrays only)."""
        g = self.algo.num_generations
        rollout, rewards = scored.rollout, scored.rewards
        adv = np.asarray(advantages_from_config(rewards, self.algo))
        has_signal = row_has_signal(rewards, self.algo)
        self._flat_steps = 0 if has_signal.any() else self._flat_steps + 1
        metrics = rollout_metrics(rollout, rewards, group_size=g, reward_weights=self.algo.reward_weights,
                                  reward_names=scored.reward_names)
        if self.reroll is not None:
            metrics.update(self.reroll.add(step, prompt_batch.indices, all_fail_groups(rewards, g)))
        if self.replay is not None:
            rollout, rewards, replaced = self.replay.exchange(rollout, rewards, adv, has_signal[::g], step=step,
                                                              pad_id=self.pad_id, width=self.completion_length)
            if replaced:
                adv = np.asarray(advantages_from_config(rewards, self.algo))
                has_signal = row_has_signal(rewards, self.algo)
            metrics.update(replay_buffer_replacements=float(replaced), replay_buffer_size=float(len(self.replay)))
        if self._flat_steps == FLAT_REWARD_STEPS:
            logger.warning("steps %d-%d: in every group all completions got the same rewards, so every advantage is "
                           "zero and nothing is learned; the task may be too easy or too hard for the policy, or a "
                           "reward function constant: raise algo.num_generations or rollout.temperature, or check "
                           "the rewards", step + 2 - FLAT_REWARD_STEPS, step + 1)
        batch = build_step_batch(rollout, adv, pad_id=self.pad_id, completion_length=self.completion_length,
                                 has_signal=has_signal)
        return batch, {**metrics, **scored.failures}

    def rerolled_prompts(self, index: int) -> list[int]:
        """Dataset indices of the prompts rollout batch ``index`` samples again (:mod:`jrl.sources.reroll`)."""
        return [] if self.reroll is None else self.reroll.take(index)

    def state(self, step: int) -> dict:
        """What a checkpoint at step ``step`` keeps of this algorithm: the replay and re-roll buffers, and the
        groups a partial rollout carries."""
        return {"replay": None if self.replay is None else self.replay.state(),
                "reroll": None if self.reroll is None else self.reroll.state(step),
                "partial": None if self._partial is None else self._partial.state()}

    @property
    def _partial(self) -> PartialRollouts | None:
        """The groups carried by partial rollouts (``rollout.partial``), or None."""
        return None if self.sampler is None else self.sampler.partial

    def load_state(self, state: dict) -> None:
        for part, buffer in (("replay", self.replay), ("reroll", self.reroll), ("partial", self._partial)):
            saved = state.get(part)
            if (buffer is None) != (saved is None):
                raise ValueError(f"the checkpoint was written with {part} {'off' if saved is None else 'on'}, this "
                                 f"run has it {'off' if buffer is None else 'on'}; resume with the same {part} "
                                 "settings")
            if buffer is not None:
                buffer.load_state(saved)

    def update(self, learner, batch: StepBatch) -> dict[str, float]:
        return self.update_policy(learner, batch)

    def generated_tokens(self, rollout: RolloutBatch | StreamedRollout | ScoredRollout | EpisodeRollout) -> int:
        if isinstance(rollout, (StreamedRollout, ScoredRollout, EpisodeRollout, PartialRollout)):
            rollout = rollout.rollout
        mask = rollout.completion_mask if rollout.loss_mask is None else rollout.loss_mask
        return int(np.asarray(mask).sum())

    def progress_postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{metrics['reward/mean']:.3f}", "loss": f"{metrics['loss']:.4f}",
                "tok_s": f"{metrics['tokens_per_second']:.0f}"}

    def log_summary(self, metrics: dict[str, float]) -> str:
        return f"reward {metrics['reward/mean']:.4f}"

    def evaluator(self, cfg, prompts, *, output_dir, seed: int) -> Evaluator:
        """The held-out evaluation of ``prompts`` (an ``EvalConfig``'s) with this run's sampling and rewards."""
        return Evaluator(cfg, prompts, sampling=self.sampling, complete=self._complete, score=self._score_eval,
                         weights=self.algo.reward_weights, output_dir=output_dir, seed=seed)

    def _complete(self, engine, prompt_batch, sampling: SamplingParams, *, seed: int) -> Completions:
        episodes = self.sampler.generate_once(engine, prompt_batch, sampling, seed=seed)
        rollout = episodes if isinstance(episodes, RolloutBatch) else episodes.rollout
        texts, ids = decoded_completions(self.sampler.tokenizer, rollout)
        return Completions(texts, ids, np.asarray(rollout.truncated, bool),
                           None if isinstance(episodes, RolloutBatch) else episodes.rewards)

    def _score_eval(self, prompt_batch, done: Completions, step: int):
        rewards, names = None, ()
        if self.sampler.scorer.fns:
            rewards, names, _ = self.sampler.scorer.score(prompt_batch.prompts, done.texts, done.ids,
                                                          prompt_batch.columns, step=step, group_size=1,
                                                          count_failures=False)
        if done.episode_rewards is not None:
            rewards, names = self.sampler.with_episode_rewards(rewards, names, done.episode_rewards)
        rm = reward_metrics(rewards, group_size=1, reward_weights=self.algo.reward_weights, reward_names=tuple(names))
        kept = {k: float(v) for k, v in rm.items() if k == "reward" or k.endswith("/mean")}
        return rewards, names, {reward_log_name(k): v for k, v in kept.items()}

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
