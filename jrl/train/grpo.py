"""The GRPO trainer loop: prompts → rollout → rewards → advantages → update → weight sync → metrics.

Per step (one optimizer step per rollout, times ``num_iterations``):

1. the next :class:`~jrl.data.PromptBatch` (``prompts_per_batch`` prompts);
2. the rollout engine samples ``num_generations`` completions per prompt at a seed derived from
   ``(seed, step)``, so a resumed run samples exactly what the uninterrupted run would have;
3. completions are decoded and scored by the reward functions ([N, K], NaN for None);
4. advantages on the whole batch (:func:`jrl.losses.advantages_from_config`) and per-group signal
   flags from the raw rewards (zero-advantage skip);
5. :meth:`GRPOLearner.update`; then, at sync steps, ``engine.sync_weights(model, version)``;
6. one line in ``metrics.jsonl``, TensorBoard scalars, the progress bar; checkpoints every
   ``save_every`` steps and at the end; a reward/loss plot at the end.

With ``rollout.prefetch_depth > 0`` steps 1–2 run in a background thread
(:class:`~jrl.train.async_rollout.RolloutProducer`) that generates later batches while this thread
trains; which policy version generates each batch is fixed by
:class:`~jrl.train.async_rollout.RolloutSchedule` (``sync_interval``, ``max_staleness``, checkpoints),
so runs and resumes are reproducible. The engine is then (and whenever ``sync_interval > 1``) given a
copy of the trainable weights at each sync, because the next update donates the learner's buffers while
generation may still read them.
An engine that runs on the trainer's own devices (the embedded sampler: ``shares_trainer_devices``)
on a multi-device mesh takes turns with the update (one lock), since two threads launching programs
with collectives on the same devices can enqueue them in different orders on different devices and
deadlock; there the overlap is of host work (rewards, data, logging), and on one device it is full.

Deferred scoring (grpo.md §2.4, §14.5): the PPO ratio's "old" log-probs are always those of the
*current* weights, never the sampler's: with ``num_iterations = 1`` the learner uses sg(new), which is
the current policy's log-prob, and with more it scores the batch once before the first update. The
sampler's log-probs (of the possibly older version that generated the batch) feed only the IS
correction and OPSM of :mod:`jrl.losses`. Per step the log has ``async/staleness`` (version lag of
the consumed batch), ``async/queue_depth`` (batches ready when the step asked for one),
``time/wait_rollout`` (time this thread waited for generation), ``time/sync`` (seconds of the step's
weight sync, 0 without one) and ``sync/version`` (the policy version the engine holds after it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.data.pipeline import left_pad
from jrl.losses import (
    advantages_from_config,
    completion_metrics,
    group_has_signal,
    reward_metrics,
    sequence_has_signal,
)
from jrl.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from jrl.train.async_rollout import ProducedRollout, RolloutProducer, RolloutSchedule
from jrl.train.config import RolloutConfig, TrainConfig
from jrl.train.loop import TrainLoop
from jrl.train.rewards import compute_rewards, load_reward_functions
from jrl.train.step import GRPOLearner, StepBatch

logger = logging.getLogger(__name__)

#: Rollout backend name → ``module:attribute`` of a factory
#: ``(model, *, tokenizer, mesh, rules, rollout: RolloutConfig, output_dir: Path) -> RolloutEngine``
#: (imported only when the backend is used).
ROLLOUT_BACKENDS: dict[str, str] = {
    "jax": "jrl.train.grpo:embedded_rollout_engine",
    "vllm": "jrl.rollout.vllm_engine:make_vllm_engine",
}

#: Prompt padding granularity: prompts are left-padded to a multiple of this, bounding recompiles.
PROMPT_PAD_MULTIPLE = 16


def embedded_rollout_engine(model, *, tokenizer, mesh, rules, rollout, output_dir) -> RolloutEngine:
    """The ``jax`` backend: the embedded sampler on the trained model (no settings beyond sampling)."""
    from jrl.rollout.jax_engine import JaxRolloutEngine

    return JaxRolloutEngine(model, tokenizer=tokenizer, mesh=mesh, rules=rules)


def _import_entry(entry: str):
    """The attribute a registry entry ``module:attribute`` names (its module imported now)."""
    module, attr = entry.split(":")
    return getattr(importlib.import_module(module), attr)


def make_rollout_engine(name: str, model, tokenizer, mesh=None, rules=None, *,
                        rollout: RolloutConfig | None = None, output_dir: str | Path = ".") -> RolloutEngine:
    """The rollout engine registered as ``name`` in :data:`ROLLOUT_BACKENDS`, built for ``model`` with the
    run's ``rollout`` section (default: its defaults) and ``output_dir`` (where a backend writes weight syncs)."""
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"RolloutConfig.backend={name!r} is unknown; use one of {sorted(ROLLOUT_BACKENDS)}")
    factory = _import_entry(ROLLOUT_BACKENDS[name])
    return factory(model, tokenizer=tokenizer, mesh=mesh, rules=rules,
                   rollout=rollout if rollout is not None else RolloutConfig(backend=name), output_dir=Path(output_dir))


def step_seed(seed: int, step: int) -> int:
    """Sampling seed of ``step`` (a pure function of the run seed and the step)."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


def build_step_batch(rollout: RolloutBatch, advantages: np.ndarray, *, pad_id: int, completion_length: int,
                     prompt_multiple: int = PROMPT_PAD_MULTIPLE) -> StepBatch:
    """Train-step arrays from a rollout: prompts left-padded to a multiple of ``prompt_multiple``,
    completions right-padded to ``completion_length`` (static shapes across steps)."""
    n, t = rollout.completion_ids.shape
    if t > completion_length:
        raise ValueError(f"the rollout has completions of {t} tokens, more than max_new_tokens={completion_length}")
    prompts = [list(np.asarray(ids)[np.asarray(m) > 0]) for ids, m in zip(rollout.prompt_ids, rollout.prompt_mask)]
    p_ids, p_mask = left_pad(prompts, pad_id, multiple_of=prompt_multiple)
    pad = completion_length - t
    c_ids = np.pad(np.asarray(rollout.completion_ids, np.int32), ((0, 0), (0, pad)), constant_values=pad_id)
    c_mask = np.pad(np.asarray(rollout.completion_mask, np.int32), ((0, 0), (0, pad)))
    samp = np.pad(np.asarray(rollout.sampling_logprobs, np.float32), ((0, 0), (0, pad)), constant_values=np.nan)
    return StepBatch(
        input_ids=np.concatenate([np.asarray(p_ids, np.int32), c_ids], axis=1),
        attention_mask=np.concatenate([np.asarray(p_mask, np.int32), c_mask], axis=1),
        completion_ids=c_ids, completion_mask=c_mask, advantages=np.asarray(advantages, np.float32),
        truncated=np.asarray(rollout.truncated, bool), sampler_logprobs=samp)


class GRPOTrainer(TrainLoop):
    """Builds everything a :class:`TrainConfig` names and runs the loop (:meth:`train`)."""

    #: The learner class the trainer builds (a subclass may add loss terms).
    learner_class: type[GRPOLearner] = GRPOLearner
    progress_desc = "grpo"

    def __init__(self, cfg: TrainConfig, *, engine: RolloutEngine | None = None, progress: bool = True):
        self.reward_fns = load_reward_functions(cfg.rewards) if cfg.ebft is None else []
        self.algo = dataclasses.replace(cfg.algo, reward_weights=cfg.reward_weights)
        super().__init__(cfg, progress=progress)
        eos = self.tokenizer.eos_token_id
        self.sampling = cfg.rollout.sampling_params(() if eos is None else (int(eos),))
        self._engine = engine
        self._data_state = self.loader.get_state()  # loader state after the last consumed batch
        self._loader_ahead = False  # the producer has taken prompts of batches not consumed yet
        self._schedule: RolloutSchedule | None = None  # set when the rollouts start (first step)
        self._producer: RolloutProducer | None = None
        self._synced_version: int | None = None
        self._device_lock: contextlib.AbstractContextManager = contextlib.nullcontext()

    def build_learner(self, model) -> GRPOLearner:
        cfg = self.cfg
        return self.learner_class(model, self.algo, cfg.optim, total_updates=cfg.max_steps * cfg.num_iterations,
                                  num_iterations=cfg.num_iterations, logprobs_impl=cfg.logprobs_impl,
                                  mesh=self.mesh, rules=self.rules)

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine (built from ``rollout.backend`` on first use unless one was passed in)."""
        if self._engine is None:
            self._engine = make_rollout_engine(self.cfg.rollout.backend, self.learner.model, self.tokenizer,
                                               self.mesh, self.rules, rollout=self.cfg.rollout,
                                               output_dir=self.out_dir)
        return self._engine

    # ------------------------------------------------------------------ pieces
    def rewards(self, prompt_batch, completion_ids: list[list[int]], step: int) -> tuple[np.ndarray, list[str]]:
        """Reward matrix [N, K] of the decoded completions (prompt columns repeated per generation)."""
        rep = prompt_batch.repeat(self.algo.num_generations)
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        return compute_rewards(self.reward_fns, None, rep.prompts, texts, completion_ids, rep.columns,
                               batch=f"step {step}", group_size=self.algo.num_generations)

    # Hooks a trainer built on this loop (EBFT structured mode) overrides.
    def sampling_params(self, prompt_batch) -> SamplingParams:
        """How the completions of ``prompt_batch`` are sampled (may run in the rollout producer thread)."""
        return self.sampling

    def score_rollout(self, prompt_batch, completion_ids: list[list[int]],
                      step: int) -> tuple[np.ndarray, list[str], dict[str, float]]:
        """(reward matrix [N, K], reward names, extra step metrics) of the completions of ``prompt_batch``."""
        rewards, names = self.rewards(prompt_batch, completion_ids, step)
        return rewards, names, {}

    def advantages(self, rewards: np.ndarray) -> np.ndarray:
        """Advantages [N] of the step from its reward matrix."""
        return np.asarray(advantages_from_config(rewards, self.algo))

    def progress_postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{metrics['reward/mean']:.3f}", "loss": f"{metrics['loss']:.4f}",
                "tok_s": f"{metrics['tokens_per_second']:.0f}"}

    def log_summary(self, metrics: dict[str, float]) -> str:
        return f"reward {metrics['reward/mean']:.4f}"

    def produce_rollout(self, index: int) -> ProducedRollout:
        """Rollout batch ``index``: the loader's next prompt batch, sampled with the seed of step ``index``
        (in the producer thread when prefetching)."""
        prompt_batch = next(self.loader)
        data_state = self.loader.get_state()
        with self._device_lock:
            t0 = time.perf_counter()
            rollout = self.engine.generate(prompt_batch.prompt_ids, self.sampling_params(prompt_batch),
                                           num_generations=self.algo.num_generations,
                                           seed=step_seed(self.cfg.seed, index))
            seconds = time.perf_counter() - t0
        return ProducedRollout(index, prompt_batch, rollout, data_state, seconds)

    def _start_rollouts(self) -> None:
        """Fix the rollout schedule from the current step and, when prefetching, start the producer."""
        r, engine = self.cfg.rollout, self.engine  # the engine is built here, in this thread
        self._schedule = RolloutSchedule(start=self.step, sync_interval=r.sync_interval, run_ahead=r.run_ahead,
                                         checkpoint_every=self.cfg.save_every)
        if self.step >= self.cfg.max_steps:
            return
        if r.prefetch_depth > 0 and getattr(engine, "shares_trainer_devices", False) and self.mesh is not None:
            self._device_lock = threading.Lock()  # see the module docstring
        if self._engine_outlives_update and self._synced_version != self.step:
            self._sync_weights(self.step)  # the engine must hold a copy, not the learner's buffers
        if r.prefetch_depth == 0:
            return
        logger.info("rollout producer: %d batch(es) in flight, generation %d step(s) ahead, sync every %d step(s), "
                    "engine %s", r.prefetch_depth, r.run_ahead, r.sync_interval, type(engine).__name__)
        self._loader_ahead = True
        self._producer = RolloutProducer(self.produce_rollout, self._schedule, depth=r.prefetch_depth,
                                         stop=self.cfg.max_steps, synced_version=self.step)

    def _stop_rollouts(self) -> None:
        """Stop the producer and put the loader back after the last consumed batch (unless the producer
        is still inside a generate call, in which case checkpoints keep using the consumed state)."""
        if self._producer is not None and self._producer.close():
            self.loader.set_state(self._data_state)
            self._loader_ahead = False
        self._producer, self._schedule = None, None
        self._device_lock = contextlib.nullcontext()

    def _next_rollout(self, index: int) -> tuple[ProducedRollout, float, int]:
        """(batch ``index``, seconds this thread waited for it, batches that were ready)."""
        if self._schedule is None:
            self._start_rollouts()
        if self._producer is None:
            item = self.produce_rollout(index)
            return item, item.seconds, 0
        return self._producer.get(index)

    @property
    def _engine_outlives_update(self) -> bool:
        """Whether the engine may generate from the weights of a sync after the learner's next update:
        when prefetching, or when it is not synced after every step."""
        return self.cfg.rollout.prefetch_depth > 0 or self.cfg.rollout.sync_interval > 1

    def _sync_weights(self, version: int) -> None:
        """Point the engine at the current weights, tagged ``version``; a copy of the trainable arrays when
        the engine outlives the next update (which donates the learner's own while generation may read them)."""
        learner = self.learner
        with self._device_lock:
            if self._engine_outlives_update:
                model = nnx.merge(learner.graphdef, jax.tree.map(jnp.copy, learner.params), learner.frozen)
            else:
                model = learner.model
            self.engine.sync_weights(model, version)
        self._synced_version = version

    def _sync_after_step(self) -> tuple[float, float]:
        """Sync the engine if this step is a sync step: (seconds waited for pending generation, seconds of the sync)."""
        version = self.step
        if not self._schedule.is_sync_step(version):
            return 0.0, 0.0
        waited = 0.0 if self._producer is None else self._producer.release_weights(version)
        t0 = time.perf_counter()
        self._sync_weights(version)
        if self._producer is not None:
            self._producer.weights_synced(version)
        return waited, time.perf_counter() - t0

    def train_step(self) -> dict[str, float]:
        """One rollout and its updates; returns the step's metrics."""
        step, g = self.step, self.algo.num_generations
        t0 = time.perf_counter()
        item, waited, ready = self._next_rollout(step)
        prompt_batch, rollout = item.prompt_batch, item.rollout
        expected = self._schedule.generating_version(step)
        if rollout.policy_version != expected:
            raise RuntimeError(
                f"rollout batch {step} is tagged policy_version={rollout.policy_version}, but the engine "
                f"({type(self.engine).__name__}) was synced to version {expected} when it generated it; "
                "RolloutEngine.generate must tag each batch with the version of its last sync_weights")
        t1 = time.perf_counter()
        lengths = np.asarray(rollout.completion_mask).sum(-1).astype(int)
        ids = [list(map(int, row[:n])) for row, n in zip(np.asarray(rollout.completion_ids), lengths)]
        rewards, names, extra_metrics = self.score_rollout(prompt_batch, ids, step)
        adv = self.advantages(rewards)
        signal = np.asarray(sequence_has_signal(group_has_signal(
            rewards, group_size=g, reward_weights=self.algo.reward_weights,
            aggregation=self.algo.multi_objective_aggregation), g))
        t2 = time.perf_counter()
        batch = build_step_batch(rollout, adv, pad_id=self.pad_id, completion_length=self.sampling.max_new_tokens)
        with self._device_lock:
            metrics = self.learner.update(batch, signal)
        t3 = time.perf_counter()
        self.step += 1
        self._data_state = item.data_state
        sync_wait, sync_seconds = self._sync_after_step()
        rm = reward_metrics(rewards, group_size=g, reward_weights=self.algo.reward_weights, reward_names=tuple(names))
        for k, v in rm.items():
            metrics[_reward_name(k)] = float(v)
        metrics.update({k: float(v) for k, v in completion_metrics(rollout.completion_mask, rollout.truncated).items()})
        metrics.update(extra_metrics)
        metrics["async/staleness"] = float(step - rollout.policy_version)
        metrics["async/queue_depth"] = float(ready)
        metrics["time/rollout"] = item.seconds
        metrics["time/wait_rollout"] = waited + sync_wait
        metrics["time/reward"] = t2 - t1
        metrics["time/train"] = t3 - t2
        metrics["time/sync"] = sync_seconds
        # Before its first sync the engine holds the weights it was built from: the run's starting version.
        served = self._schedule.start if self._synced_version is None else self._synced_version
        metrics["sync/version"] = float(served)
        metrics["tokens_per_second"] = float(lengths.sum()) / max(time.perf_counter() - t0, 1e-9)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_data_state(self) -> dict:
        return self._data_state if self._loader_ahead else self.loader.get_state()

    def restore(self) -> dict[str, Any]:
        meta = super().restore()  # stops the producer first
        self._loader_ahead = False  # the restore positioned the loader
        self._data_state = meta["data_state"]
        self._sync_weights(self.step)
        return meta


def _reward_name(name: str) -> str:
    """Reward metric names of the run log: ``reward/mean``, ``reward/std``, ``reward/<fn>/mean``..."""
    if name == "reward":
        return "reward/mean"
    if name == "reward_std":
        return "reward/std"
    if name.startswith("rewards/"):
        return "reward/" + name[len("rewards/"):]
    return name


#: ``EBFTConfig.mode`` → ``module:attribute`` of its trainer class (imported only when used).
EBFT_TRAINERS: dict[str, str] = {"structured": "jrl.train.ebft:EBFTStructuredTrainer",
                                 "strided": "jrl.train.ebft_strided:EBFTStridedTrainer"}


def trainer_class(cfg: TrainConfig) -> type:
    """The trainer of ``cfg``: :class:`GRPOTrainer`, or the EBFT trainer of ``cfg.ebft.mode``."""
    if cfg.ebft is None:
        return GRPOTrainer
    return _import_entry(EBFT_TRAINERS[cfg.ebft.mode])


def train(cfg: TrainConfig, **kwargs) -> list[dict[str, Any]]:
    """Build the trainer of ``cfg`` (:func:`trainer_class`) and run it."""
    trainer = trainer_class(cfg)(cfg, **kwargs)
    try:
        return trainer.train()
    finally:
        trainer.close()
