"""The jitted GRPO update: log-probs, gradient accumulation, optimizer step (grpo.md §10, §12.3, §14.8).

One optimizer step consumes one rollout of ``N = P x G`` sequences, split into micro-batches of
``micro_batch_size`` rows. Normalisers are computed once on the whole step's loss mask
(:func:`jrl.losses.step_normalizers`), each micro-batch's loss is ``Σ ℓ m c / Z`` with that global Z,
and the micro-batch gradients are summed, so the update does not depend on the split (nothing is
divided by the micro-batch or device count anywhere). Micro-batches without learning signal (every
sequence in a group whose raw rewards are constant, §14.8) are skipped on the host before dispatch
and counted in ``skipped_zero_adv_batches``.

The model is split into ``(graphdef, trainable, frozen)`` (:class:`TrainableState`, shared with the
EBFT learner): with LoRA the trainable state is the :class:`~jrl.models.lora.LoRAParam` variables,
else every ``nnx.Param``. Three jitted functions:
``_logprobs`` (no gradient: old / reference log-probs, once per rollout), ``_micro`` (forward +
backward of one micro-batch, added into a donated gradient accumulator) and ``_apply`` (global-norm
clip + AdamW, donated params and optimizer state).

Log-probs come from ``model.hidden_states`` + :func:`jrl.kernels.logprobs.token_logprobs` with
``impl`` from the config: ``hidden[:, Lp - 1 + t]`` predicts ``completion_ids[:, t]``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jrl.kernels.logprobs import token_logprobs
from jrl.losses import GRPOConfig, LossInputs, grpo_loss, loss_mask, metric_reduction, step_normalizers
from jrl.models.lora import LoRAParam, has_lora, lora_disabled
from jrl.sharding import batch_sharding, opt_state_shardings
from jrl.train.config import OptimConfig


class StepBatch(NamedTuple):
    """The arrays of one rollout (or one micro-batch of it); host NumPy or device arrays, N rows."""

    input_ids: np.ndarray
    """[N, Lp + T] int32: left-padded prompt then right-padded completion."""
    attention_mask: np.ndarray
    """[N, Lp + T] int32: prompt mask then completion mask."""
    completion_ids: np.ndarray
    """[N, T] int32."""
    completion_mask: np.ndarray
    """[N, T] int32, 1 up to and including the stop token."""
    advantages: np.ndarray
    """[N] float32."""
    truncated: np.ndarray
    """[N] bool, no stop token."""
    sampler_logprobs: np.ndarray | None = None
    """[N, T] float32 sampler log-probs (NaN where missing)."""
    old_logprobs: np.ndarray | None = None
    """[N, T] float32 log-probs of the policy that generated the rollout (filled by the step when mu > 1)."""
    ref_logprobs: np.ndarray | None = None
    """[N, T] float32 reference log-probs (filled by the step when beta > 0)."""

    def rows(self, sl: slice) -> StepBatch:
        return StepBatch(*(None if x is None else x[sl] for x in self))


@functools.lru_cache(maxsize=32)
def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup then constant / cosine / linear decay, after global-norm clipping.

    Cached, so learners with equal settings share one transformation object and its compiled update."""
    lr, warm = cfg.learning_rate, cfg.warmup_steps
    decay_steps = max(1, total_steps - warm)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(lr)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, decay_steps)
    else:
        after = optax.linear_schedule(lr, 0.0, decay_steps)
    schedule = optax.join_schedules([optax.linear_schedule(0.0, lr, warm), after], [warm]) if warm else after
    parts = [] if cfg.max_grad_norm is None else [optax.clip_by_global_norm(cfg.max_grad_norm)]
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    return optax.chain(*parts), schedule


def completion_logprobs(model, batch: StepBatch, *, temperature: float, impl: str = "auto",
                        with_entropy: bool = False):
    """(logπ [N, T], entropy [N, T] or None) of ``batch.completion_ids`` under ``model`` at ``temperature``."""
    n, t = batch.completion_ids.shape
    lp_len = batch.input_ids.shape[1] - t
    hidden = model.hidden_states(batch.input_ids, attention_mask=batch.attention_mask)
    h = hidden[:, lp_len - 1: lp_len - 1 + t]
    lp, ent = token_logprobs(h.reshape(n * t, -1), model.lm_head_weight(), batch.completion_ids.reshape(n * t),
                             temperature=temperature, with_entropy=with_entropy, impl=impl)
    return lp.reshape(n, t), None if ent is None else ent.reshape(n, t)


def step_loss(model, batch: StepBatch, algo: GRPOConfig, normalizers=None, *, impl: str = "auto"):
    """``grpo_loss`` of ``batch`` under ``model`` (the loss the train step differentiates)."""
    lp, ent = completion_logprobs(model, batch, temperature=algo.temperature, impl=impl,
                                  with_entropy=algo.needs_entropy)
    inputs = LossInputs(advantages=batch.advantages, completion_mask=batch.completion_mask, logprobs=lp, entropy=ent,
                        old_logprobs=batch.old_logprobs, ref_logprobs=batch.ref_logprobs,
                        sampler_logprobs=batch.sampler_logprobs, truncated=batch.truncated)
    return grpo_loss(inputs, algo, normalizers)


def _reduce(values: list[float], how: str) -> float:
    if how == "sum":
        return float(np.sum(values))
    if how == "min":
        return float(np.min(values))
    if how == "max":
        return float(np.max(values))
    return float(np.mean(values))


@functools.partial(jax.jit, static_argnames=("graphdef", "algo", "impl", "disable_lora"))
def _logprobs(params, frozen, batch, *, graphdef, algo, impl, disable_lora):
    model = nnx.merge(graphdef, params, frozen)
    with lora_disabled(model) if disable_lora else contextlib.nullcontext():
        return completion_logprobs(model, batch, temperature=algo.temperature, impl=impl)[0]


@functools.partial(jax.jit, static_argnames=("graphdef", "algo", "impl"), donate_argnums=0)
def _micro(acc, params, frozen, batch, normalizers, *, graphdef, algo, impl):
    """``acc + ∇ loss`` of one micro-batch (the accumulator is donated), its loss and metrics."""
    def loss_fn(p):
        return step_loss(nnx.merge(graphdef, p, frozen), batch, algo, normalizers, impl=impl)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return jax.tree.map(jnp.add, acc, grads), loss, metrics


@functools.partial(jax.jit, static_argnames=("tx",), donate_argnums=(0, 1))
def _apply(params, opt_state, grads, *, tx):
    """One optimizer update (params and optimizer state donated); returns the gradient's global norm too."""
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)


_zeros_like = jax.jit(lambda tree: jax.tree.map(jnp.zeros_like, tree))


class TrainableState:
    """A model split into ``(graphdef, params, frozen)`` (with LoRA the trainable params are the
    :class:`~jrl.models.lora.LoRAParam` variables, else every ``nnx.Param``) and the optimizer of the
    params; the part every learner (GRPO, EBFT) shares.

    ``model`` is used in place: after an update, ``self.model`` holds the new weights (for the rollout
    engine's ``sync_weights`` and for export).
    """

    #: What a step's rows are, in the error for a step not split evenly into micro-batches.
    rows_phrase: str = "the rollout has {n} sequences"

    def __init__(self, model: nnx.Module, optim: OptimConfig, *, total_updates: int, mesh=None, rules=None):
        self.optim, self.mesh, self.rules = optim, mesh, rules
        self.lora = has_lora(model)
        wrt = LoRAParam if self.lora else nnx.Param
        self.graphdef, self.params, self.frozen = nnx.split(model, wrt, ...)
        self.tx, self.schedule = make_optimizer(optim, total_updates)
        if mesh is None:
            self.opt_state = jax.jit(self.tx.init)(self.params)
        else:
            shardings = opt_state_shardings(jax.eval_shape(self.tx.init, self.params), self.params, mesh, rules)
            self.opt_state = jax.jit(self.tx.init, out_shardings=shardings)(self.params)
        self.num_updates = 0

    @property
    def model(self) -> nnx.Module:
        """The model with the current weights (shares the learner's arrays)."""
        return nnx.merge(self.graphdef, self.params, self.frozen)

    def _put(self, x):
        if x is None:
            return None
        x = np.asarray(x)
        if self.mesh is None:
            return jnp.asarray(x)
        return jax.device_put(x, batch_sharding(self.mesh, x.ndim, self.rules, shape=x.shape))

    def _micro_slices(self, n: int) -> list[slice]:
        """Row slices of the ``optim.micro_batch_size`` micro-batches of a step of ``n`` rows."""
        mb = self.optim.micro_batch_size or n
        if n % mb:
            raise ValueError(f"{self.rows_phrase.format(n=n)}, not a multiple of OptimConfig.micro_batch_size={mb}")
        return [slice(i, i + mb) for i in range(0, n, mb)]

    def zero_gradients(self):
        """A zero gradient accumulator shaped like the trainable params."""
        return _zeros_like(self.params)

    def apply_gradients(self, grads) -> jax.Array:
        """One optimizer update with the summed gradient ``grads`` (params and optimizer state are
        donated and replaced); returns the gradient's global norm."""
        self.params, self.opt_state, gnorm = _apply(self.params, self.opt_state, grads, tx=self.tx)
        self.num_updates += 1
        return gnorm


class GRPOLearner(TrainableState):
    """Owns the trainable state and optimizer of a model and runs GRPO updates on rollouts."""

    def __init__(self, model: nnx.Module, algo: GRPOConfig, optim: OptimConfig, *, total_updates: int,
                 num_iterations: int = 1, logprobs_impl: str = "auto", mesh=None, rules=None):
        super().__init__(model, optim, total_updates=total_updates, mesh=mesh, rules=rules)
        self.algo, self.mu, self.impl = algo, int(num_iterations), logprobs_impl
        # Full fine-tune with a KL term: a frozen copy of the initial weights is the reference.
        self.ref_params = (jax.tree.map(jnp.copy, self.params)
                           if algo.beta != 0.0 and not self.lora else None)
        self._static = dict(graphdef=self.graphdef, algo=algo, impl=logprobs_impl)

    # ---------------------------------------------------------------- state
    def _device(self, batch: StepBatch) -> StepBatch:
        return StepBatch(*(self._put(x) for x in batch))

    def score(self, batch: StepBatch, *, disable_lora: bool = False, params=None) -> np.ndarray:
        """Log-probs [N, T] of the completions (no gradient), computed micro-batch by micro-batch."""
        params = self.params if params is None else params
        parts = [np.asarray(_logprobs(params, self.frozen, self._device(batch.rows(sl)), disable_lora=disable_lora,
                                       **self._static))
                 for sl in self._micro_slices(batch.completion_ids.shape[0])]
        return np.concatenate(parts, axis=0)

    # ---------------------------------------------------------------- update
    def update(self, batch: StepBatch, has_signal: np.ndarray) -> dict[str, float]:
        """``num_iterations`` optimizer updates on one rollout; returns the step's metrics.

        ``has_signal`` [N] bool: the sequence's group has a learning signal (from raw rewards,
        :func:`jrl.losses.sequence_has_signal`); micro-batches with none are skipped when
        ``algo.skip_zero_advantage_batches``.
        """
        cfg = self.algo
        if cfg.beta != 0.0 and batch.ref_logprobs is None:
            ref = (self.score(batch, disable_lora=True) if self.lora else self.score(batch, params=self.ref_params))
            batch = batch._replace(ref_logprobs=ref)
        if self.mu > 1 and batch.old_logprobs is None:
            batch = batch._replace(old_logprobs=self.score(batch))
        per_update: list[dict[str, list]] = []
        for _ in range(self.mu):
            acc, collected, skipped = self.accumulate_gradients(batch, has_signal)
            collected["learning_rate"] = [self.schedule(self.num_updates)]
            collected["grad_norm"] = [self.apply_gradients(acc)]
            per_update.append(collected)
        # Reduce over micro-batches within an update (the loss is a sum: global normalisers), then
        # average the updates of this rollout (min / max metrics keep their extreme).
        out: dict[str, float] = {}
        for k in per_update[0]:
            how = "sum" if k == "loss" else metric_reduction(k)
            vals = [_reduce([float(x) for x in u[k]], how) if u[k] else 0.0 for u in per_update]
            out[k] = _reduce(vals, how if how in ("min", "max") else "mean")
        out["skipped_zero_adv_batches"] = float(skipped)
        return out

    def accumulate_gradients(self, batch: StepBatch, has_signal: np.ndarray):
        """(summed gradient of the step loss w.r.t. the trainable state, per-micro-batch metrics,
        number of skipped micro-batches) for one pass over ``batch`` at the current weights."""
        cfg = self.algo
        slices = self._micro_slices(batch.completion_ids.shape[0])
        mask = np.asarray(loss_mask(np.asarray(batch.completion_mask), None, np.asarray(batch.truncated),
                                    mask_truncated_completions=cfg.mask_truncated_completions))
        norms = step_normalizers(mask, num_micro_batches=len(slices))
        has_signal = np.asarray(has_signal, bool)
        acc = self.zero_gradients()
        collected: dict[str, list] = {"loss": []}
        skipped = 0
        for sl in slices:
            if cfg.skip_zero_advantage_batches and not np.any(has_signal[sl] & (mask[sl].sum(-1) > 0)):
                skipped += 1
                continue
            acc, loss, metrics = _micro(acc, self.params, self.frozen, self._device(batch.rows(sl)), norms,
                                        **self._static)
            collected["loss"].append(loss)
            for k, v in metrics.items():
                collected.setdefault(k, []).append(v)
        return acc, collected, skipped
