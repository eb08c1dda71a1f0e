"""The GRPO trainer loop: prompts → rollout → rewards → advantages → update → weight sync → metrics.

Per step (one optimizer step per rollout, times ``num_iterations``):

1. the next :class:`~jrl.data.PromptBatch` (``prompts_per_batch`` prompts);
2. the rollout engine samples ``num_generations`` completions per prompt at a seed derived from
   ``(seed, step)``, so a resumed run samples exactly what the uninterrupted run would have;
3. completions are decoded and scored by the reward functions ([N, K], NaN for None);
4. advantages on the whole batch (:func:`jrl.losses.advantages_from_config`) and per-group signal
   flags from the raw rewards (zero-advantage skip);
5. :meth:`GRPOLearner.update`; then ``engine.sync_weights(model, version)``;
6. one line in ``metrics.jsonl``, TensorBoard scalars, the progress bar; checkpoints every
   ``save_every`` steps and at the end; a reward/loss plot at the end.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jrl.data.pipeline import left_pad, make_prompt_loader
from jrl.losses import (
    advantages_from_config,
    completion_metrics,
    group_has_signal,
    reward_metrics,
    sequence_has_signal,
)
from jrl.models import from_pretrained
from jrl.models.lora import apply_lora
from jrl.rollout.base import RolloutBatch, RolloutEngine
from jrl.sharding import make_mesh, shard_model
from jrl.train.checkpoint import TrainCheckpointer
from jrl.train.config import TrainConfig
from jrl.train.observability import MetricsWriter, claim_output_dir, plot_curves
from jrl.train.rewards import compute_rewards, load_reward_functions
from jrl.train.step import GRPOLearner, StepBatch

logger = logging.getLogger(__name__)

#: Rollout backend name → ``module:attribute`` of a factory ``(model, *, tokenizer, mesh, rules) -> RolloutEngine``
#: (imported only when the backend is used).
ROLLOUT_BACKENDS: dict[str, str] = {"jax": "jrl.rollout.jax_engine:JaxRolloutEngine"}

#: Prompt padding granularity: prompts are left-padded to a multiple of this, bounding recompiles.
PROMPT_PAD_MULTIPLE = 16


def make_rollout_engine(name: str, model, tokenizer, mesh=None, rules=None) -> RolloutEngine:
    """The rollout engine registered as ``name`` in :data:`ROLLOUT_BACKENDS`, built for ``model``."""
    if name not in ROLLOUT_BACKENDS:
        raise ValueError(f"RolloutConfig.backend={name!r} is unknown; use one of {sorted(ROLLOUT_BACKENDS)}")
    module, attr = ROLLOUT_BACKENDS[name].split(":")
    factory = getattr(importlib.import_module(module), attr)
    return factory(model, tokenizer=tokenizer, mesh=mesh, rules=rules)


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


class GRPOTrainer:
    """Builds everything a :class:`TrainConfig` names and runs the loop (:meth:`train`)."""

    def __init__(self, cfg: TrainConfig, *, engine: RolloutEngine | None = None, progress: bool = True):
        from transformers import AutoTokenizer

        self.cfg = cfg
        self.progress = progress
        cfg.mesh.axis_sizes(jax.device_count())  # a clear error for a mesh that does not fit the devices
        self.reward_fns = load_reward_functions(cfg.rewards)
        self.algo = dataclasses.replace(cfg.algo, reward_weights=cfg.reward_weights)
        model_dir = Path(cfg.model.path)
        if not (model_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"ModelSpec.path={cfg.model.path!r} is not a Hugging Face model directory (no config.json); "
                "point --model.path at one (the default tiny model is made by scripts/make_default_model.py)")
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.loader = make_prompt_loader(cfg.data, self.tokenizer)
        # One device needs no mesh: no placement or sharding constraints at all.
        self.mesh = make_mesh(cfg.mesh) if jax.device_count() > 1 else None
        self.rules = cfg.mesh.logical_rules()
        model = from_pretrained(model_dir, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
                                mesh=self.mesh, rules=self.rules)
        if cfg.lora is not None:
            apply_lora(model, cfg.lora, seed=cfg.seed)
            if self.mesh is not None:
                shard_model(model, self.mesh, self.rules)
        self.learner = GRPOLearner(model, self.algo, cfg.optim, total_updates=cfg.max_steps * cfg.num_iterations,
                                   num_iterations=cfg.num_iterations, logprobs_impl=cfg.logprobs_impl,
                                   mesh=self.mesh, rules=self.rules)
        eos = self.tokenizer.eos_token_id
        self.sampling = cfg.rollout.sampling_params(() if eos is None else (int(eos),))
        self._engine = engine
        self.out_dir = Path(cfg.output_dir)
        if not cfg.resume:
            claim_output_dir(self.out_dir, overwrite=cfg.overwrite)
        self.checkpointer = TrainCheckpointer(self.out_dir / "checkpoints", max_to_keep=cfg.keep_checkpoints)
        self.step = 0

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine (built from ``rollout.backend`` on first use unless one was passed in)."""
        if self._engine is None:
            self._engine = make_rollout_engine(self.cfg.rollout.backend, self.learner.model, self.tokenizer,
                                               self.mesh, self.rules)
        return self._engine

    # ------------------------------------------------------------------ pieces
    def rewards(self, prompt_batch, completion_ids: list[list[int]], step: int) -> tuple[np.ndarray, list[str]]:
        """Reward matrix [N, K] of the decoded completions (prompt columns repeated per generation)."""
        rep = prompt_batch.repeat(self.algo.num_generations)
        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        return compute_rewards(self.reward_fns, None, rep.prompts, texts, completion_ids, rep.columns,
                               batch=f"step {step}", group_size=self.algo.num_generations)

    def train_step(self) -> dict[str, float]:
        """One rollout and its updates; returns the step's metrics."""
        step, g = self.step, self.algo.num_generations
        prompt_batch = next(self.loader)
        t0 = time.perf_counter()
        rollout = self.engine.generate(prompt_batch.prompt_ids, self.sampling, num_generations=g,
                                       seed=step_seed(self.cfg.seed, step))
        t1 = time.perf_counter()
        lengths = np.asarray(rollout.completion_mask).sum(-1).astype(int)
        ids = [list(map(int, row[:n])) for row, n in zip(np.asarray(rollout.completion_ids), lengths)]
        rewards, names = self.rewards(prompt_batch, ids, step)
        adv = np.asarray(advantages_from_config(rewards, self.algo))
        signal = np.asarray(sequence_has_signal(group_has_signal(
            rewards, group_size=g, reward_weights=self.algo.reward_weights,
            aggregation=self.algo.multi_objective_aggregation), g))
        t2 = time.perf_counter()
        batch = build_step_batch(rollout, adv, pad_id=self.pad_id, completion_length=self.sampling.max_new_tokens)
        metrics = self.learner.update(batch, signal)
        t3 = time.perf_counter()
        self.step += 1
        self.engine.sync_weights(self.learner.model, self.step)
        rm = reward_metrics(rewards, group_size=g, reward_weights=self.algo.reward_weights, reward_names=tuple(names))
        for k, v in rm.items():
            metrics[_reward_name(k)] = float(v)
        metrics.update({k: float(v) for k, v in completion_metrics(rollout.completion_mask, rollout.truncated).items()})
        metrics["time/rollout"] = t1 - t0
        metrics["time/reward"] = t2 - t1
        metrics["time/train"] = t3 - t2
        metrics["tokens_per_second"] = float(lengths.sum()) / max(t3 - t0, 1e-9)
        return metrics

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        cfg = self.cfg
        meta = {"step": self.step, "num_updates": self.learner.num_updates, "seed": cfg.seed,
                "data_state": self.loader.get_state(),
                "model": {"path": str(Path(cfg.model.path).resolve()), "dtype": cfg.model.dtype,
                          "param_dtype": cfg.model.param_dtype},
                "lora": None if cfg.lora is None else dataclasses.asdict(cfg.lora)}
        self.checkpointer.save(self.step, self.learner.params, self.learner.opt_state, meta)

    def restore(self) -> None:
        params, opt_state, meta = self.checkpointer.restore(self.learner.params, self.learner.opt_state)
        if meta.get("seed") != self.cfg.seed:
            raise ValueError(f"the checkpoint in {self.checkpointer.directory} was written with seed={meta.get('seed')}, "
                             f"this run has seed={self.cfg.seed}; resume with the same seed")
        self.learner.params, self.learner.opt_state = params, opt_state
        self.learner.num_updates = int(meta["num_updates"])
        self.loader.set_state(meta["data_state"])
        self.step = int(meta["step"])
        self.engine.sync_weights(self.learner.model, self.step)

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict[str, Any]]:
        """Run to ``max_steps``; returns the metric history (also in ``metrics.jsonl``)."""
        cfg = self.cfg
        writer = MetricsWriter(self.out_dir)
        if cfg.resume:
            if self.checkpointer.latest_step() is None:
                raise FileNotFoundError(f"resume=True but {self.checkpointer.directory} holds no checkpoint")
            self.restore()
            writer.truncate_after(self.step)
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=self.step, desc="grpo", disable=not self.progress, dynamic_ncols=True)
        try:
            while self.step < cfg.max_steps:
                metrics = self.train_step()
                writer.write(self.step, metrics)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", loss=f"{metrics['loss']:.4f}",
                                tok_s=f"{metrics['tokens_per_second']:.0f}")
                if self.step % cfg.log_every == 0:
                    logger.info("step %d: reward %.4f loss %.5f", self.step, metrics["reward/mean"], metrics["loss"])
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.max_steps:
                    self.save()
            if self.checkpointer.latest_step() != self.step:
                self.save()
        finally:
            bar.close()
            writer.close()
        history = writer.history()
        plot_curves(history, self.out_dir / "curves.png")
        return history

    def close(self) -> None:
        self.checkpointer.close()


def _reward_name(name: str) -> str:
    """Reward metric names of the run log: ``reward/mean``, ``reward/std``, ``reward/<fn>/mean``..."""
    if name == "reward":
        return "reward/mean"
    if name == "reward_std":
        return "reward/std"
    if name.startswith("rewards/"):
        return "reward/" + name[len("rewards/"):]
    return name


def train(cfg: TrainConfig, **kwargs) -> list[dict[str, Any]]:
    """Build a :class:`GRPOTrainer` for ``cfg`` and run it."""
    trainer = GRPOTrainer(cfg, **kwargs)
    try:
        return trainer.train()
    finally:
        trainer.close()
