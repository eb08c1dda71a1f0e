"""The training loop: one class composed of parts chosen by name (docs/architecture.md).

- a :class:`~jrl.sources.rollout.RolloutSource` (``rollout.backend``, ``rollout.sync``): rollouts and
  weight syncs, synchronous or prefetched in a background thread; with ``mode='train'`` a
  :class:`~jrl.train.exploration.QueueSource` instead: scored groups that explorer processes put in the experience
  queue, and weights published for them;
- an algorithm (``algorithm``, :data:`jrl.train.algorithms.ALGORITHMS`): sampling, rollout → experience,
  loss terms;
- a :class:`~jrl.train.learner.Learner`: trainable state, optimizer, accumulation.

Per step: batch ``k`` from the source (sampled with a seed derived from ``(seed, k)``, so a resumed run
samples exactly what the uninterrupted run would have) → ``algorithm.make_experience`` →
``algorithm.update`` → weight sync at sync steps → one line of ``metrics.jsonl``, TensorBoard scalars,
the progress bar; checkpoints every ``save_every`` steps and at the end; a plot at the end. Where generation runs
apart from the learner's devices (``rollout.prefetch_depth`` > 0 with ``rollout.devices`` or a server), a step
launches its update, syncs the engine, then takes batch ``k + 1``, makes its experience and plans its update while
the devices train, and only then reads the first update's metrics (:meth:`Trainer.train_step`): the host's part of a
step (rewards, advantages, packing) no longer leaves the learner's devices idle. It does not look ahead across a
checkpoint or an evaluation, and a stop signal lets the step it prepared run before the checkpoint: a run trains the
same steps either way. With ``eval_every`` the current weights are evaluated on held-out prompts before the first
step and every ``eval_every`` steps (:mod:`jrl.train.evaluation`, ``eval.jsonl``).

Per step the log has, besides the algorithm's metrics: ``async/staleness`` (version lag of the consumed
batch), ``async/queue_depth`` (batches ready when the step asked for one), ``time/rollout`` (the generate
call), ``time/wait_rollout`` (time this thread waited for generation), ``time/reward`` (experience),
``time/train`` (the update's host work, launch and the wait for its metrics; with the next step prepared in
between, only what outlasts that), ``time/sync`` (seconds of the step's weight sync, 0 without one),
``async/experience_ahead`` (1 when the step's batch, experience and update plan were made during the previous step's
update), ``time/compile``
(seconds this process spent compiling during the step, :mod:`jrl.train.compile_clock`),
``sync/version`` (the policy version the engine holds after it) and ``tokens_per_second``.

SIGTERM / SIGINT (:mod:`jrl.train.preemption`): the running step finishes, a checkpoint is written at that
boundary and :meth:`Trainer.train` returns (the script exits 0); ``--resume`` continues exactly. A step or evaluation
that runs past ``step_timeout_s`` ends the process with status 1 (:mod:`jrl.train.watchdog`).

Several processes (:func:`jrl.sharding.initialize`, docs/multihost.md) run the same loop on one global mesh: each
builds the same prompt batches and places only its devices' rows, the sampler's completions are gathered to every
host, each process scores its share of them (:mod:`jrl.rewards.pool`), and every host-side decision is then
the same everywhere. Only process 0 writes the output directory's logs, plots and samples; checkpoints are written
by all of them together (orbax). A stop signal that reaches any process stops all of them after the same step.

Checkpoint ``meta`` (see :mod:`jrl.train.checkpoint`): ``step``, ``num_updates``, ``seed``,
``data_state`` (the loader state after the last consumed batch), ``model`` (``path``, ``dtype``,
``param_dtype``) and ``lora`` (the :class:`~jrl.models.lora.LoraConfig` fields or None), which let
:mod:`jrl.train.export` rebuild the model, and ``algorithm`` (the algorithm's ``state(step)``, e.g. GRPO's replay
and re-roll buffers, when it has one).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import jax

from jrl.data.pipeline import PromptLoader, build_prompt_dataset
from jrl.envs import prompt_tools
from jrl.rollout.base import RolloutEngine
from jrl.sharding import any_process, barrier, is_main_process
from jrl.train.algorithms import ALGORITHMS
from jrl.train.checkpoint import TrainCheckpointer
from jrl.train.config import TrainConfig
from jrl.train.evaluation import split_eval_prompts
from jrl.train.exploration import QueueSource
from jrl.train import compile_cache
from jrl.train.compile_clock import compiled_seconds
from jrl.train.learner import Learner
from jrl.train.observability import MetricsWriter, WandbSink, claim_output_dir, plot_curves, truncate_jsonl_after
from jrl.rewards.functions import best_total, load_reward_functions
from jrl.train.policy_loading import load_policy
from jrl.train.preemption import stop_requests
from jrl.train.watchdog import StepWatchdog
from jrl.sources.prefetch import is_checkpoint_step
from jrl.sources.rollout import RolloutSource, make_rollout_engine

logger = logging.getLogger(__name__)

#: Share of the routed (token, expert) rows an expert-parallel capacity may drop in a step before the run warns (once).
DROPPED_ROWS_WARNING = 0.01


@dataclasses.dataclass
class _PreparedStep:
    """A step's rollout batch and experience, what making them took, and its update's host work when done ahead."""

    item: Any
    waited: float
    ready: int
    experience: Any
    metrics: dict[str, float]
    seconds: float
    """Seconds of ``make_experience``."""
    plan: Any = None
    """The algorithm's ``plan_update`` of the experience (None: not planned ahead)."""
    plan_seconds: float = 0.0
    """Seconds of ``plan_update``."""


def warn_dropped_rows(metrics: dict, step: int, capacity: float) -> bool:
    """Warn when a step's ``moe/dropped_rows`` passes :data:`DROPPED_ROWS_WARNING`; returns whether it warned."""
    share = metrics.get("moe/dropped_rows", 0.0)
    if not share > DROPPED_ROWS_WARNING:
        return False
    logger.warning("moe/dropped_rows=%.4f at step %d: expert parallelism with model.expert_capacity=%g dropped %.1f%% "
                   "of the routed (token, expert) rows, whose experts then add nothing to their tokens; raise "
                   "model.expert_capacity above the router's imbalance (moe/expert_load_max_over_mean) or set it to "
                   "0 (dropless, exact). Warned once.", share, step, capacity, 100 * share)
    return True


class Trainer:
    """Builds the parts a :class:`TrainConfig` names and runs them to ``max_steps`` (:meth:`train`).
    ``engine``: a rollout engine to use instead of building ``rollout.backend`` (the caller closes it)."""

    def __init__(self, cfg: TrainConfig, *, engine: RolloutEngine | None = None, progress: bool = True):
        self.cfg, self.progress = cfg, progress
        check_processes(cfg)
        self.compile_cache = compile_cache.enable(cfg.compile_cache_dir)
        policy = load_policy(cfg)
        self.tokenizer, self.pad_id, self.mesh = policy.tokenizer, policy.pad_id, policy.mesh
        tools = prompt_tools(cfg.env)
        prompts = build_prompt_dataset(cfg.data, self.tokenizer, tools=tools)
        if cfg.eval_every:
            prompts, eval_prompts = split_eval_prompts(cfg.eval, cfg.data, prompts, self.tokenizer, tools=tools)
        self.loader = PromptLoader(prompts, cfg.data)
        self.learner = Learner(policy.model, cfg.optim, total_updates=cfg.max_steps * cfg.updates_per_step,
                               mesh=policy.mesh, rules=policy.rules)
        self.algorithm = ALGORITHMS.get(cfg.algorithm)(cfg, policy, self.learner)
        self.out_dir = Path(cfg.output_dir)
        self.evaluator = (self.algorithm.evaluator(cfg.eval, eval_prompts, output_dir=self.out_dir, seed=cfg.seed)
                          if cfg.eval_every else None)
        if not cfg.resuming and is_main_process():
            claim_output_dir(self.out_dir, overwrite=cfg.overwrite)
        barrier("jrl-output-dir")  # no process writes to output_dir before it is claimed
        if cfg.mode == "train":
            self.source = QueueSource(cfg, loader=self.loader, learner=self.learner, pad_id=policy.pad_id,
                                      output_dir=self.out_dir)
        else:
            self.source = RolloutSource(
                cfg.rollout, loader=self.loader, generate=self.algorithm.generate, learner=self.learner,
                engine=engine, seed=cfg.seed, max_steps=cfg.max_steps, checkpoint_every=cfg.save_every,
                make_engine=lambda: make_rollout_engine(cfg.rollout, self.learner.model, pad_id=policy.pad_id,
                                                        mesh=policy.rollout_mesh, rules=policy.rollout_rules,
                                                        output_dir=self.out_dir),
                multi_device=policy.mesh is not None,
                rerolled=self.algorithm.rerolled_prompts if "reroll" in self.algorithm.capabilities else None)
        self.checkpointer = TrainCheckpointer(self.out_dir / "checkpoints", max_to_keep=cfg.keep_checkpoints)
        self.step = 0
        self._ahead: _PreparedStep | None = None  # the next step's batch and experience, made during an update
        self._warned_dropped_rows = False

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine (built on first use)."""
        return self.source.engine

    # ------------------------------------------------------------------ one step
    def _prepare(self, step: int, plan: bool = False) -> _PreparedStep:
        """Rollout batch ``step`` (waiting for it), its experience and, with ``plan``, its update's plan."""
        item, waited, ready = self.source.next(step)
        t0 = time.perf_counter()
        experience, metrics = self.algorithm.make_experience(item.rollout, item.prompt_batch, self.learner, step)
        t1 = time.perf_counter()
        planned = self.algorithm.plan_update(self.learner, experience) if plan else None
        return _PreparedStep(item, waited, ready, experience, metrics, t1 - t0, planned, time.perf_counter() - t1)

    def looks_ahead(self, step: int) -> bool:
        """Whether step ``step`` (0-based) prepares the next step while its update runs: where the algorithm plans
        and launches updates apart from reading their metrics (capability ``deferred_update``) and
        generation runs apart from the learner's devices (``rollout.prefetch_depth`` > 0 with ``rollout.devices``
        or a server), unless the next step is past the end, or a checkpoint or evaluation follows this one (the
        next step's experience changes the algorithm's state: a checkpoint keeps the state after this step)."""
        after, cfg = step + 1, self.cfg
        return ("deferred_update" in self.algorithm.capabilities and self.source.generates_apart
                and after < cfg.max_steps and not is_checkpoint_step(after, cfg.save_every)
                and not (cfg.eval_every and after % cfg.eval_every == 0))

    def train_step(self, look_ahead: bool = True) -> dict[str, float]:
        """One rollout, its experience and update(s), the weight sync; returns the step's metrics. With ``look_ahead``
        and where :meth:`looks_ahead` says so, the update is launched, the engine synced, the next step's batch taken,
        its experience made and its update's host work done (``plan_update``: the loss terms, packed rows), and only
        then this update's metrics read: between two updates the learner's devices wait only for the next one's
        launch. The next update is launched after the first's metrics are read, so the two never hold memory at
        once. The next call starts from there."""
        step, source = self.step, self.source
        t0, compiled = time.perf_counter(), compiled_seconds()
        ahead = self._ahead is not None
        prepared, self._ahead = self._ahead or self._prepare(step), None
        item, metrics = prepared.item, dict(prepared.metrics)
        t1 = time.perf_counter()
        if look_ahead and self.looks_ahead(step):
            finish = self.algorithm.start_update(self.learner, prepared.experience, prepared.plan)
            train_seconds = time.perf_counter() - t1
            self.step += 1
            source.consumed(item)
            sync_wait, sync_seconds = source.sync_after_step(self.step)  # the weights after this update
            self._ahead = self._prepare(self.step, plan=True)
            t2 = time.perf_counter()
            metrics.update(finish())
            train_seconds += time.perf_counter() - t2
        else:
            with source.device_lock:
                if prepared.plan is not None:
                    metrics.update(self.algorithm.start_update(self.learner, prepared.experience, prepared.plan)())
                else:
                    metrics.update(self.algorithm.update(self.learner, prepared.experience))
            train_seconds = time.perf_counter() - t1
            self.step += 1
            source.consumed(item)
            sync_wait, sync_seconds = source.sync_after_step(self.step)
        metrics.update(item.metrics)
        metrics["async/staleness"] = float(step - item.rollout.policy_version)
        metrics["async/queue_depth"] = float(prepared.ready)
        metrics["async/experience_ahead"] = float(ahead)
        metrics["time/rollout"] = item.seconds
        metrics["time/wait_rollout"] = prepared.waited + sync_wait
        metrics["time/reward"] = prepared.seconds
        metrics["time/train"] = prepared.plan_seconds + train_seconds
        metrics["time/sync"] = sync_seconds
        metrics["time/compile"] = compiled_seconds() - compiled
        metrics["sync/version"] = float(source.served_version())
        metrics["tokens_per_second"] = self.algorithm.generated_tokens(item.rollout) / max(time.perf_counter() - t0, 1e-9)
        if not self._warned_dropped_rows:
            self._warned_dropped_rows = warn_dropped_rows(metrics, step, self.cfg.model.expert_capacity)
        return metrics

    def evaluate(self, writer: MetricsWriter) -> None:
        """Evaluate the current weights (the ``eval`` section) and log it at this step."""
        if self.source.schedule is not None and self.source.served_version() != self.step:
            raise RuntimeError(f"evaluation at step {self.step} found the engine at version "
                               f"{self.source.served_version()}; evaluations must fall on weight-sync steps")
        t0 = time.perf_counter()
        with self.source.device_lock:
            metrics = self.evaluator.run(self.engine, self.step, writer)
        metrics["time/eval"] = time.perf_counter() - t0
        writer.write(self.step, metrics)
        logger.info("eval at step %d: %s", self.step, ", ".join(
            f"{k[len('eval/'):]} {v:.4f}" for k, v in metrics.items() if k.endswith("reward/mean")))

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        cfg = self.cfg
        meta = {"step": self.step, "num_updates": self.learner.num_updates, "seed": cfg.seed,
                "data_state": self.source.checkpoint_data_state(),
                "model": {"path": str(Path(cfg.model.path).resolve()), "dtype": cfg.model.dtype,
                          "param_dtype": cfg.model.param_dtype},
                "lora": None if cfg.lora is None else dataclasses.asdict(cfg.lora)}
        if "state" in self.algorithm.capabilities:
            meta["algorithm"] = self.algorithm.state(self.step)
        self.checkpointer.save(self.step, self.learner.params, self.learner.opt_state, meta)

    def restore(self) -> dict[str, Any]:
        """Restore the checkpoint ``resume_from`` names, else the newest intact one (learner, loader, step),
        written with this run's seed, and sync the engine to it; returns its meta."""
        self.source.stop()
        self._ahead = None
        params, opt_state, meta = self.checkpointer.restore(self.learner.params, self.learner.opt_state,
                                                            step=self.cfg.resume_from)
        if meta.get("seed") != self.cfg.seed:
            raise ValueError(f"the checkpoint in {self.checkpointer.directory} was written with seed={meta.get('seed')}, "
                             f"this run has seed={self.cfg.seed}; resume with the same seed")
        self.learner.params, self.learner.opt_state = params, opt_state
        self.learner.num_updates = int(meta["num_updates"])
        self.loader.set_state(meta["data_state"])
        if "state" in self.algorithm.capabilities:
            self.algorithm.load_state(meta.get("algorithm", {}))
        self.step = int(meta["step"])
        self.source.restored(meta["data_state"], self.step)
        return meta

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict[str, Any]]:
        """Run to ``max_steps``; returns the metric history (also in ``metrics.jsonl``)."""
        cfg, algorithm = self.cfg, self.algorithm
        if cfg.resuming:
            self.restore()
        main = is_main_process()
        sink = WandbSink(cfg.wandb, self.out_dir, dataclasses.asdict(cfg)) if cfg.wandb.project and main else None
        writer = MetricsWriter(self.out_dir, wandb=sink)
        eval_writer = MetricsWriter(self.out_dir, name="eval", wandb=sink) if self.evaluator else None
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.max_steps, initial=self.step, desc=algorithm.progress_desc,
                   disable=not (self.progress and main), dynamic_ncols=True)
        watchdog = StepWatchdog(cfg.step_timeout_s)
        try:
            if cfg.resuming:  # lines written after the restored checkpoint
                writer.truncate_after(self.step)
                if eval_writer and main:
                    eval_writer.truncate_after(self.step)
                    truncate_jsonl_after(self.evaluator.samples_path, self.step)
            with stop_requests() as stop:
                if eval_writer and self.step == 0:
                    with watchdog.step("the evaluation before step 1"):
                        self.evaluate(eval_writer)
                stopping = asked = False
                while self.step < cfg.max_steps and not stopping:
                    with watchdog.step(f"step {self.step + 1}"):
                        metrics = self.train_step(look_ahead=not asked)
                    writer.write(self.step, metrics)
                    if eval_writer and self.step % cfg.eval_every == 0:
                        with watchdog.step(f"the evaluation after step {self.step}"):
                            self.evaluate(eval_writer)
                    bar.update(1)
                    bar.set_postfix(algorithm.progress_postfix(metrics))
                    if self.step % cfg.log_every == 0:
                        logger.info("step %d: %s loss %.5f", self.step, algorithm.log_summary(metrics), metrics["loss"])
                    if is_checkpoint_step(self.step, cfg.save_every) and self.step < cfg.max_steps:
                        self.save()
                    asked = any_process(stop.signal is not None)  # every process stops after the same step
                    stopping = asked and self._ahead is None  # else the next step's experience is made: train it
                if self.checkpointer.latest_step() != self.step:
                    self.save()
                if self.step == cfg.max_steps:
                    self.source.finish(self.step)  # a queue's explorers stop once the last checkpoint is written
                if stopping:
                    why = f"{stop.name} received" if stop.signal is not None else "another process was asked to stop"
                    logger.warning("%s: stopped after step %d of %d with a checkpoint in %s; continue with --resume",
                                   why, self.step, cfg.max_steps, self.checkpointer.directory)
        finally:
            watchdog.close()
            self.source.stop()
            bar.close()
            writer.close()
            if eval_writer:
                eval_writer.close()
            if sink:
                sink.close()
        history = writer.history()
        if main:
            plot_curves(history, self.out_dir / "curves.png", keys=algorithm.plot_keys,
                        eval_history=eval_writer.history() if eval_writer else [], best_reward=self._best_reward())
        return history

    def _best_reward(self) -> float | None:
        """The best possible reward of the run's reward functions (when they declare it and the algorithm uses them)."""
        if "rewards" in self.algorithm.ignores:
            return None
        return best_total(load_reward_functions(self.cfg.rewards))  # the specs' weights: algo.reward_weights is None

    def close(self) -> None:
        self.source.close()
        self.algorithm.close()
        self.checkpointer.close()
        if self.compile_cache is not None:
            logger.info(self.compile_cache.summary())


def check_processes(cfg: TrainConfig, processes: int | None = None) -> None:
    """Refuse, naming the setting, what a run of ``processes`` processes (default: the run's, once joined) does not
    support."""
    processes = jax.process_count() if processes is None else processes
    if processes <= 1:
        return
    if cfg.mode != "both":
        raise ValueError(f"mode={cfg.mode!r} runs in one process per trainer or explorer; start this run as one "
                         "process (several explorers may feed one trainer)")
    if cfg.env.name is not None:
        raise ValueError(f"env.name={cfg.env.name!r}: with {processes} processes every process would play "
                         "the episodes on its own, and an environment answering differently on one of them would feed "
                         "the processes different observations; train on episodes in one process, or play them in "
                         "explorer processes (--mode explore) that feed a one-process trainer")
    if cfg.rollout.prefetch_depth > 0:
        raise ValueError(f"rollout.prefetch_depth={cfg.rollout.prefetch_depth}: with {processes} processes "
                         "rollouts are generated in the trainer's thread (the processes must launch their programs "
                         "and collectives in one order); use --rollout.prefetch-depth 0")


def train(cfg: TrainConfig, **kwargs) -> list[dict[str, Any]]:
    """Build the :class:`Trainer` of ``cfg`` and run it."""
    trainer = Trainer(cfg, **kwargs)
    try:
        return trainer.train()
    finally:
        trainer.close()
