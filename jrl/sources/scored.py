"""A rollout with its rewards (:class:`ScoredRollout`): what an algorithm's sampler scores and what a queue-fed
trainer reads from the explorers' experience queue, whatever the algorithm; and the run log's metrics of one
(rewards per group and per function, completion lengths)."""

from __future__ import annotations

import dataclasses

import numpy as np

from jrl.losses import completion_metrics, reward_metrics
from jrl.rollout.base import RolloutBatch


@dataclasses.dataclass
class ScoredRollout:
    """A rollout with its rewards: what a sampler's ``score`` makes of a generated one (GRPO's
    :class:`~jrl.train.algorithms.grpo.GroupSampler`), and what the trainer reads from an experience queue
    (:mod:`jrl.train.exploration`), scored by the explorers."""

    rollout: RolloutBatch
    rewards: np.ndarray
    """[N, R] float32, each reward function's value per completion (NaN: no reward)."""
    reward_names: tuple[str, ...]
    """The reward functions' names, one per column."""
    failures: dict[str, float] = dataclasses.field(default_factory=dict)
    """Failed-call metrics of the scoring (:class:`~jrl.rewards.pool.RewardScorer`)."""

    @property
    def policy_version(self) -> int:
        return self.rollout.policy_version


def reward_log_name(name: str) -> str:
    """Reward metric names of the run log: ``reward/mean``, ``reward/std``, ``reward/<fn>/mean``..."""
    if name == "reward":
        return "reward/mean"
    if name == "reward_std":
        return "reward/std"
    if name.startswith("rewards/"):
        return "reward/" + name[len("rewards/"):]
    return name


def rollout_metrics(rollout: RolloutBatch, rewards: np.ndarray, *, group_size: int, reward_weights,
                    reward_names: tuple[str, ...]) -> dict[str, float]:
    """Reward metrics of a rollout of groups of ``group_size`` completions, and its completion lengths."""
    rm = reward_metrics(rewards, group_size=group_size, reward_weights=reward_weights, reward_names=reward_names)
    out = {reward_log_name(k): float(v) for k, v in rm.items()}
    out.update({k: float(v) for k, v in completion_metrics(rollout.completion_mask, rollout.truncated).items()})
    return out
