"""GRPO and its family (BNPO, Dr. GRPO, DAPO, GSPO, CISPO... as ``algo`` picks): rewards from reward
functions, group advantages, the clipped-ratio loss of :func:`jrl.losses.grpo_loss`.

Per step: ``num_generations`` completions per prompt at the ``rollout`` section's sampling parameters →
decoded and scored by the reward functions ([N, K], NaN for None) → advantages on the whole batch
(:func:`jrl.losses.advantages_from_config`) and per-group signal flags from the raw rewards → a
:class:`StepBatch` (the experience) → :class:`PolicyUpdate`: ``num_iterations`` passes over the batch, each
one optimizer update per ``docs_per_step`` rows (whole groups; default the whole batch), each update over
micro-batches with normalisers global to the update (:func:`jrl.losses.step_normalizers`), micro-batches
without learning signal skipped and counted in ``skipped_zero_adv_batches`` (docs/algorithms/grpo.md §14.8).

Three modules: this one (the config checks, :class:`GRPO` and the pipeline other algorithms build on), the rollout
side (:mod:`jrl.train.algorithms.group_sampler`: sampling and scoring, also what explorer processes run) and the
learner side (:mod:`jrl.train.algorithms.grpo_update`: the step batch, the loss terms, the update).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from jrl.envs import EpisodeRollout
from jrl.losses import GRPOConfig, advantages_from_config, reward_metrics
from jrl.rollout.base import RolloutBatch, SamplingParams
from jrl.sharding import on_host
from jrl.train.algorithms.base import ALGORITHMS
from jrl.train.algorithms.group_sampler import GroupSampler, StreamedRollout, decoded_completions, run_sampling
from jrl.train.algorithms.grpo_update import PolicyUpdate, StepBatch, build_step_batch, row_has_signal
from jrl.train.evaluation import Completions, Evaluator
from jrl.sources.partial import PartialRollout, PartialRollouts
from jrl.sources.replay import ReplayBuffer
from jrl.sources.scored import ScoredRollout, reward_log_name, rollout_metrics
from jrl.sources.reroll import RerollBuffer, all_fail_groups
from jrl.validation import invalid

logger = logging.getLogger(__name__)


def check_grpo_config(cfg) -> None:
    """The checks of a GRPO-pipeline algorithm's ``algo`` section (:class:`GRPOConfig`) against the rest of ``cfg``:
    groups to compare, a Dr. GRPO normaliser that covers every completion, a fused head only for losses that sum
    over rows, reward weights in one place."""
    g = cfg.algo.num_generations
    if g < 2:
        raise invalid("TrainConfig", "algo.num_generations", g,
                      "GRPO compares completions of the same prompt; use >= 2 (e.g. 8)")
    m = cfg.algo.max_completion_length
    if m is not None and m < cfg.rollout.max_new_tokens:
        raise invalid("TrainConfig", "algo.max_completion_length", m,
                      f"it must be >= rollout.max_new_tokens={cfg.rollout.max_new_tokens}, or None")
    if m is not None and cfg.env.name is not None and m < cfg.env.max_episode_tokens:
        raise invalid("TrainConfig", "algo.max_completion_length", m,
                      f"it must be >= env.max_episode_tokens={cfg.env.max_episode_tokens}, or None")
    if cfg.loss_head == "fused" and cfg.algo.top_entropy_quantile < 1.0:
        raise invalid("TrainConfig", "loss_head", cfg.loss_head,
                      f"algo.top_entropy_quantile={cfg.algo.top_entropy_quantile} thresholds entropies "
                      "over the whole batch, which a row-chunked head cannot; use loss_head='auto'")
    if cfg.algo.reward_weights is not None:
        raise invalid("TrainConfig", "algo.reward_weights", cfg.algo.reward_weights,
                      "set the weights on the reward specs (TrainConfig.rewards[i].weight) and leave it None")

def grpo_pipeline(cfg, policy, learner) -> tuple[GRPOConfig, SamplingParams, PolicyUpdate]:
    """What every GRPO-pipeline algorithm builds from the config: ``algo`` with the run's reward weights, the
    sampling parameters and the policy update at that temperature."""
    algo, sampling = dataclasses.replace(cfg.algo, reward_weights=cfg.reward_weights), run_sampling(cfg, policy)
    update = PolicyUpdate(algo, learner, temperature=sampling.temperature, num_iterations=cfg.num_iterations,
                          impl=cfg.logprobs_impl, loss_head=cfg.loss_head, docs_per_step=cfg.docs_per_step)
    return algo, sampling, update

FLAT_REWARD_STEPS = 5
"""Consecutive steps whose groups all got equal rewards (every advantage zero: nothing learned) before a
warning."""

@ALGORITHMS.register("grpo")
class GRPO:
    """GRPO-family training with reward functions (see the module docstring). With ``mode='train'`` the rollouts
    arrive scored (:class:`ScoredRollout`, from explorer processes) and no sampler is built."""

    config_type = GRPOConfig
    sections = ()
    check_config = staticmethod(check_grpo_config)
    ignores = ()
    progress_desc = "grpo"
    plot_keys = ("reward/mean", "loss")
    summary_keys = ("reward/mean",)
    capabilities = frozenset({"state", "reroll", "explorer", "partial", "deferred_update"})
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

    def generate(self, engine, prompt_batch, *, step: int, seed: int) -> RolloutBatch | StreamedRollout:
        return self.sampler.generate(engine, prompt_batch, step=step, seed=seed)

    def make_experience(self, rollout: RolloutBatch | StreamedRollout | ScoredRollout, prompt_batch, learner,
                        step: int):
        scored = rollout if isinstance(rollout, ScoredRollout) else self.sampler.score(rollout, prompt_batch, step)
        with on_host():
            batch, metrics = self._experience(scored, prompt_batch, step)
        if not isinstance(rollout, PartialRollout):
            return batch, metrics
        self._partial.consumed(rollout)
        return batch, {**metrics, **rollout.metrics}

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

    def plan_update(self, learner, batch: StepBatch):
        return self.update_policy.plan(learner, batch)

    def start_update(self, learner, batch: StepBatch, plan=None) -> Callable[[], dict[str, float]]:
        return self.update_policy.start(learner, batch, terms=plan)

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
