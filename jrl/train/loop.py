"""What every trainer does around its step: policy and data, output directory, checkpoints, resume and
the run loop (``metrics.jsonl`` / TensorBoard, progress bar, periodic and final checkpoints, the plot).

A trainer subclasses :class:`TrainLoop` and supplies :meth:`TrainLoop.build_learner` and
:meth:`TrainLoop.train_step`; :class:`~jrl.train.grpo.GRPOTrainer` and
:class:`~jrl.train.ebft_strided.EBFTStridedTrainer` do.

Checkpoint ``meta`` (see :mod:`jrl.train.checkpoint`): ``step``, ``num_updates``, ``seed``,
``data_state`` (the loader state after the last consumed batch), ``model`` (``path``, ``dtype``,
``param_dtype``) and ``lora`` (the :class:`~jrl.models.lora.LoraConfig` fields or None); the last two
let :mod:`jrl.train.export` rebuild the model.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from jrl.data.pipeline import make_prompt_loader
from jrl.train.checkpoint import TrainCheckpointer
from jrl.train.config import TrainConfig
from jrl.train.observability import MetricsWriter, claim_output_dir, plot_curves
from jrl.train.policy import load_policy

logger = logging.getLogger(__name__)


class TrainLoop:
    """Builds the policy, loader, learner, output directory and checkpointer a :class:`TrainConfig` names,
    and runs :meth:`train_step` to ``max_steps`` with checkpoints and resume (:meth:`train`)."""

    #: Label of the progress bar.
    progress_desc: str = "train"
    #: Metrics of the final plot (``curves.png``).
    plot_keys: tuple[str, ...] = ("reward/mean", "loss")

    def __init__(self, cfg: TrainConfig, *, progress: bool = True):
        self.cfg = cfg
        self.progress = progress
        policy = load_policy(cfg)
        self.tokenizer, self.pad_id, self.mesh, self.rules = policy.tokenizer, policy.pad_id, policy.mesh, policy.rules
        self.loader = make_prompt_loader(cfg.data, self.tokenizer)
        self.learner = self.build_learner(policy.model)
        self.out_dir = Path(cfg.output_dir)
        if not cfg.resume:
            claim_output_dir(self.out_dir, overwrite=cfg.overwrite)
        self.checkpointer = TrainCheckpointer(self.out_dir / "checkpoints", max_to_keep=cfg.keep_checkpoints)
        self.step = 0

    # ------------------------------------------------------------------ what a trainer supplies
    def build_learner(self, model):
        """The learner (a :class:`~jrl.train.step.TrainableState`) that trains ``model``."""
        raise NotImplementedError

    def train_step(self) -> dict[str, float]:
        """One step; advances :attr:`step` and returns the step's metrics."""
        raise NotImplementedError

    def progress_postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        """The values the progress bar shows after a step."""
        return {"loss": f"{metrics['loss']:.4f}"}

    def log_summary(self, metrics: dict[str, float]) -> str:
        """What the periodic log line says of a step besides its number and loss."""
        return ""

    def checkpoint_data_state(self) -> dict:
        """The loader state a checkpoint records: after the last consumed batch."""
        return self.loader.get_state()

    def _stop_rollouts(self) -> None:
        """Stop background generation (none here); called on restore, at the end of a run and on close."""

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        cfg = self.cfg
        meta = {"step": self.step, "num_updates": self.learner.num_updates, "seed": cfg.seed,
                "data_state": self.checkpoint_data_state(),
                "model": {"path": str(Path(cfg.model.path).resolve()), "dtype": cfg.model.dtype,
                          "param_dtype": cfg.model.param_dtype},
                "lora": None if cfg.lora is None else dataclasses.asdict(cfg.lora)}
        self.checkpointer.save(self.step, self.learner.params, self.learner.opt_state, meta)

    def restore(self) -> dict[str, Any]:
        """Restore the latest checkpoint (learner, loader, step) written with this run's seed; returns its meta."""
        self._stop_rollouts()
        params, opt_state, meta = self.checkpointer.restore(self.learner.params, self.learner.opt_state)
        if meta.get("seed") != self.cfg.seed:
            raise ValueError(f"the checkpoint in {self.checkpointer.directory} was written with seed={meta.get('seed')}, "
                             f"this run has seed={self.cfg.seed}; resume with the same seed")
        self.learner.params, self.learner.opt_state = params, opt_state
        self.learner.num_updates = int(meta["num_updates"])
        self.loader.set_state(meta["data_state"])
        self.step = int(meta["step"])
        return meta

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

        bar = tqdm(total=cfg.max_steps, initial=self.step, desc=self.progress_desc, disable=not self.progress,
                   dynamic_ncols=True)
        try:
            while self.step < cfg.max_steps:
                metrics = self.train_step()
                writer.write(self.step, metrics)
                bar.update(1)
                bar.set_postfix(self.progress_postfix(metrics))
                if self.step % cfg.log_every == 0:
                    logger.info("step %d: %s loss %.5f", self.step, self.log_summary(metrics), metrics["loss"])
                if cfg.save_every and self.step % cfg.save_every == 0 and self.step < cfg.max_steps:
                    self.save()
            if self.checkpointer.latest_step() != self.step:
                self.save()
        finally:
            self._stop_rollouts()
            bar.close()
            writer.close()
        history = writer.history()
        plot_curves(history, self.out_dir / "curves.png", keys=self.plot_keys)
        return history

    def close(self) -> None:
        self._stop_rollouts()
        self.checkpointer.close()
