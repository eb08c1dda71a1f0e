"""A new algorithm in one file: REINFORCE with a group-mean baseline, registered as ``toy_reinforce``, with a config
section of its own (:class:`ToyConfig`, its ``algo``). It reuses the GRPO room's sampler (generation and reward
scoring) and hands the learner one loss term of its own; nothing outside this file names it
(tests/train/test_toy_algorithm.py trains with it)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jrl.train.algorithms import ALGORITHMS
from jrl.sources.scored import rollout_metrics
from jrl.train.algorithms.group_sampler import GroupSampler
from jrl.train.algorithms.grpo_update import build_step_batch, completion_logprobs
from jrl.train.learner import LossTerm, reduce_metrics
from jrl.validation import check_int, check_real, invalid


@dataclasses.dataclass(frozen=True)
class ToyConfig:
    """The toy's own knobs (``--algo.*`` on the command line when ``--algorithm toy_reinforce``)."""

    group_size: int = 4
    """Completions per prompt (a group shares its mean reward as the baseline)."""
    advantage_scale: float = 1.0
    """Factor on every advantage."""

    def __post_init__(self):
        check_int(self, "group_size", lo=1)
        check_real(self, "advantage_scale", gt=0, fix="use a number > 0")


@dataclasses.dataclass(frozen=True)
class ReinforceLoss:
    """−Σ A·logπ over the completion tokens / their count (a hashable loss function of the learner)."""

    temperature: float

    def __call__(self, model, batch, aux):
        lp, _ = completion_logprobs(model, batch, temperature=self.temperature)
        mask = batch.completion_mask.astype(jnp.float32)
        loss = -jnp.sum(batch.advantages[:, None] * lp * mask) / aux
        return loss, {}


@ALGORITHMS.register("toy_reinforce")
class ToyReinforce:
    config_type = ToyConfig
    sections = ()
    ignores = ("replay", "reroll", "eval_every", "eval", "docs_per_step", "num_iterations", "loss_head",
               "logprobs_impl")
    progress_desc = "toy"
    plot_keys = ("reward/mean", "loss")
    summary_keys = ("reward/mean",)
    capabilities = frozenset()
    engine_needs = frozenset()
    samples_field = "algo.group_size"

    @staticmethod
    def check_config(cfg) -> None:
        if cfg.algo.group_size < 2:
            raise invalid("TrainConfig", "algo.group_size", cfg.algo.group_size, "a baseline needs >= 2 per group")

    def __init__(self, cfg, policy, learner):
        self.sampler, self.pad_id = GroupSampler(cfg, policy), policy.pad_id
        self.group, self.max_new, self.scale = cfg.algo.group_size, cfg.rollout.max_new_tokens, cfg.algo.advantage_scale
        self.loss = ReinforceLoss(self.sampler.sampling.temperature)

    def generate(self, engine, prompt_batch, *, step: int, seed: int):
        return self.sampler.generate(engine, prompt_batch, step=step, seed=seed)

    def make_experience(self, rollout, prompt_batch, learner, step: int):
        scored = self.sampler.score(rollout, prompt_batch, step)
        total = scored.rewards.sum(axis=1).reshape(-1, self.group)
        advantages = (self.scale * (total - total.mean(axis=1, keepdims=True))).reshape(-1).astype(np.float32)
        batch = build_step_batch(scored.rollout, advantages, pad_id=self.pad_id, completion_length=self.max_new)
        metrics = rollout_metrics(scored.rollout, scored.rewards, group_size=self.group, reward_weights=None,
                                  reward_names=scored.reward_names)
        return batch, metrics

    def update(self, learner, batch) -> dict[str, float]:
        tokens = np.float32(max(1.0, float(batch.completion_mask.sum())))
        metrics, _ = learner.step([LossTerm(self.loss, batch._replace(has_signal=None), tokens)])
        return reduce_metrics([metrics], lambda name: "sum" if name == "loss" else "mean")

    def generated_tokens(self, rollout) -> int:
        return int(np.asarray(rollout.completion_mask).sum())

    def progress_postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        return {"reward": f"{metrics['reward/mean']:.3f}"}

    def log_summary(self, metrics: dict[str, float]) -> str:
        return f"reward {metrics['reward/mean']:.3f}"

    def close(self) -> None:
        self.sampler.close()
