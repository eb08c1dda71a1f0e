"""The learner side of the GRPO family: a step's experience (:class:`StepBatch`), the loss terms the learner
descends on it (padded rows, or packed with :mod:`jrl.train.packing`) and :class:`PolicyUpdate`: ``num_iterations``
passes over the batch, each one optimizer update per ``docs_per_step`` rows (whole groups; default the whole batch),
each update over micro-batches with normalisers global to the update (:func:`jrl.losses.step_normalizers`),
micro-batches without learning signal skipped and counted in ``skipped_zero_adv_batches`` (docs/algorithms/grpo.md
§14.8).

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
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jrl.data.pipeline import left_pad
from jrl.kernels import backend as kernel_backend
from jrl.losses import (
    GRPOConfig,
    LossInputs,
    group_has_signal,
    grpo_loss,
    loss_mask,
    metric_reduction,
    sequence_has_signal,
    step_normalizers,
)
from jrl.rollout.base import RolloutBatch
from jrl.sharding import batch_shards, on_host
from jrl.train.learner import LossTerm, reduce_metrics, row_slices, take_rows
from jrl.train.packing import loss_extent, pack, per_sequence

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


def sums_over_rows(algo: GRPOConfig) -> bool:
    """The loss of a micro-batch is the sum of its rows' losses under the step's normalisers (not ``bnpo``'s
    micro-batch token mean, no batch-wide entropy threshold), so each device can compute its own rows' part
    (``OptimConfig.grad_sync``)."""
    return fused_head_supported(algo) and algo.loss_type != "bnpo"


@dataclasses.dataclass(frozen=True)
class GRPOLoss:
    """``grpo_loss`` of a micro-batch under ``model`` at the sampling temperature (``aux``: the step's
    normalisers). With ``fused_head`` the loss and its head gradients come from the loss-fused LM head
    (:meth:`jrl.models.transformer.Transformer.head_loss`), else from the ``impl`` log-prob kernel."""

    algo: GRPOConfig
    temperature: float
    impl: str
    fused_head: bool = False

    @property
    def rows_separable(self) -> bool:
        """See :func:`sums_over_rows`."""
        return sums_over_rows(self.algo)

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
    positions: np.ndarray | None = None
    expand: np.ndarray | None = None
    copies: np.ndarray | None = None


def packed_step(batch: StepBatch, learner) -> tuple[PackedStep, np.ndarray]:
    """``batch`` packed (:func:`jrl.train.packing.pack`) into micro-batches of ``learner``'s size (or a power of two
    of rows, at least the batch's shards) and the padded row of each sequence slot [R, S] (-1: empty)."""
    rows = pack(batch.input_ids, batch.attention_mask, batch.completion_mask,
                rows_multiple=learner.optim.micro_batch_size, least_rows=batch_shards(learner.mesh, learner.rules),
                share_prompts=learner.optim.share_prompts)
    seq = rows.sequence
    return PackedStep(
        input_ids=rows.input_ids, segment_ids=rows.segment_ids, scored=rows.scored, targets=rows.targets,
        gather=rows.gather,
        completion_mask=per_sequence(batch.completion_mask, seq, 0), advantages=per_sequence(batch.advantages, seq, 0),
        truncated=per_sequence(batch.truncated, seq, False),
        sampler_logprobs=per_sequence(batch.sampler_logprobs, seq, np.nan),
        old_logprobs=per_sequence(batch.old_logprobs, seq, 0), ref_logprobs=per_sequence(batch.ref_logprobs, seq, 0),
        positions=rows.positions, expand=rows.expand, copies=rows.copies,
    ), seq


def packed_hidden(model, packed: PackedStep):
    """[R, C, H] final hidden states of packed rows at their scored columns (each predicts that column's target)."""
    s = packed.gather.shape[1]
    expand = None if packed.expand is None else (packed.expand, packed.copies)
    hidden = model.hidden_states(packed.input_ids, positions=packed.positions, segment_ids=packed.segment_ids,
                                 max_segments=s + 1, expand=expand)
    return jnp.take_along_axis(hidden, packed.scored[:, :, None], axis=1)


def per_slot(x, gather):
    """``x`` [R, C] of packed rows' scored columns in the padded layout of their sequence slots [R·S, T] (``gather``
    [R, S, T]: each slot position's column); None stays None."""
    if x is None:
        return None
    r, s, t = gather.shape
    return jnp.take_along_axis(x, gather.reshape(r, s * t), axis=1).reshape(r * s, t)


def slot_rows(packed: PackedStep) -> StepBatch:
    """The per-token and per-sequence arrays of packed rows' sequence slots as padded rows [R·S, ...] (an empty slot
    has no loss token)."""

    def flat(x):
        return None if x is None else x.reshape((-1,) + x.shape[2:])

    return StepBatch(input_ids=None, attention_mask=None, completion_ids=None,
                     completion_mask=flat(packed.completion_mask), advantages=flat(packed.advantages),
                     truncated=flat(packed.truncated), sampler_logprobs=flat(packed.sampler_logprobs),
                     old_logprobs=flat(packed.old_logprobs), ref_logprobs=flat(packed.ref_logprobs))


def packed_logprobs(model, packed: PackedStep, *, temperature: float, impl: str, with_entropy: bool = False):
    """(logπ, entropy or None) [R·S, T] of each sequence slot's completion tokens in packed rows: the ``impl``
    log-prob kernel over each row's scored columns, gathered into the padded layout."""
    lp, ent = model.token_logprobs(packed_hidden(model, packed), packed.targets, temperature=temperature,
                                   with_entropy=with_entropy, impl=impl)
    return per_slot(lp, packed.gather), per_slot(ent, packed.gather)


@dataclasses.dataclass(frozen=True)
class PackedCompletionLogprobs:
    """``model, packed -> logπ [R, S, T]`` of packed rows' completions (old / reference scoring, no gradient)."""

    temperature: float
    impl: str

    def __call__(self, model, packed: PackedStep, aux=None):
        lp, _ = packed_logprobs(model, packed, temperature=self.temperature, impl=self.impl)
        return lp.reshape(packed.gather.shape)


@dataclasses.dataclass(frozen=True)
class PackedGRPORowLoss:
    """``grpo_loss`` of some packed rows under the step's normalisers (the ``row_loss`` of the loss-fused head over
    packed rows' scored columns: a packed row holds whole sequences, so the step loss sums over packed rows)."""

    algo: GRPOConfig

    def __call__(self, lp, ent, rows: PackedStep, normalizers):
        inputs = _loss_inputs(slot_rows(rows), per_slot(lp, rows.gather), per_slot(ent, rows.gather))
        return grpo_loss(inputs, self.algo, normalizers)[0]


@dataclasses.dataclass(frozen=True)
class PackedGRPOLoss:
    """``loss`` (its algorithm, temperature, log-prob kernel and head) over packed rows: the padded loss over the
    sequence slots ([R·S, T]). With ``loss.fused_head`` the loss and its head gradients come from the loss-fused LM
    head over the scored columns (three head matmuls), else from the log-prob kernel (four)."""

    loss: GRPOLoss

    @property
    def rows_separable(self) -> bool:
        """As the padded loss's (a packed row holds whole sequences)."""
        return self.loss.rows_separable

    def __call__(self, model, packed: PackedStep, normalizers):
        algo, temperature = self.loss.algo, self.loss.temperature
        if not self.loss.fused_head:
            lp, ent = packed_logprobs(model, packed, temperature=temperature, impl=self.loss.impl,
                                      with_entropy=algo.needs_entropy)
            return grpo_loss(_loss_inputs(slot_rows(packed), lp, ent), algo, normalizers)
        rows = packed._replace(input_ids=None, segment_ids=None, scored=None, targets=None, positions=None,
                               expand=None, copies=None)
        loss, lp, ent = model.head_loss(packed_hidden(model, packed), packed.targets, PackedGRPORowLoss(algo), rows,
                                        normalizers, temperature=temperature, with_entropy=algo.needs_entropy)
        lp, ent = per_slot(lp, packed.gather), per_slot(ent, packed.gather)
        _, metrics = grpo_loss(_loss_inputs(slot_rows(packed), lp, ent), algo, normalizers)
        return loss, metrics


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
        need_ref, need_old = self._missing_logprobs(batch)
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
            return [LossTerm(PackedGRPOLoss(self.loss), packed, term.aux, keep)]
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
        return self.start(learner, batch, extra_terms, reduction)()

    def plan(self, learner, batch: StepBatch) -> list[list[LossTerm]] | None:
        """The policy loss terms of each optimizer update of one pass over ``batch`` (host arrays: masks,
        normalisers, packed rows), or None where they need the devices first (reference or old log-probs to
        compute): the host's part of :meth:`start`, which a caller may do ahead, while the devices still train."""
        return None if any(self._missing_logprobs(batch)) else self._terms(learner, batch)

    def _terms(self, learner, batch: StepBatch) -> list[list[LossTerm]]:
        return [self.policy_terms(learner, take_rows(batch, sl)) for sl in self.parts(batch.completion_ids.shape[0])]

    def _missing_logprobs(self, batch: StepBatch) -> tuple[bool, bool]:
        """Whether :meth:`prepare` has the reference log-probs (a KL term) and the old log-probs (more than one
        update per batch) of ``batch`` to compute."""
        return (self.algo.beta != 0.0 and batch.ref_logprobs is None,
                self.mu * len(self.parts(batch.completion_ids.shape[0])) > 1 and batch.old_logprobs is None)

    def start(self, learner, batch: StepBatch, extra_terms: tuple[LossTerm, ...] = (),
              reduction: Callable[[str], str] = _grpo_reduction,
              terms: list[list[LossTerm]] | None = None) -> Callable[[], dict[str, float]]:
        """Launch the update on the devices and return what waits for it: a call that reads its metrics back
        (the host is free in between, e.g. to make the next step's experience). ``terms``: :meth:`plan`'s, when
        done ahead."""
        terms = self._terms(learner, self.prepare(learner, batch)) if terms is None else terms
        if extra_terms and len(terms) > 1:
            raise ValueError("docs_per_step splits the policy term only; an update with extra loss terms takes the "
                             "whole batch")
        updates, skipped = [], 0
        for _ in range(self.mu):
            skipped = 0  # micro-batches skipped in one pass over the batch
            for part in terms:
                collected, n = learner.step([*part, *extra_terms])
                updates.append(collected)
                skipped += n

        def finish() -> dict[str, float]:
            return reduce_metrics(updates, reduction) | {"skipped_zero_adv_batches": float(skipped)}

        return finish


def row_has_signal(rewards: np.ndarray, algo: GRPOConfig) -> np.ndarray:
    """[N] bool: the row's group has a learning signal (its raw rewards [N, K] are not all equal)."""
    g = algo.num_generations
    return np.asarray(sequence_has_signal(group_has_signal(
        rewards, group_size=g, reward_weights=algo.reward_weights, aggregation=algo.multi_objective_aggregation), g))
