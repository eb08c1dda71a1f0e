"""The rollout side of the GRPO family: :class:`GroupSampler` samples a group of completions per prompt (or
episodes against an environment, or partial rollouts carried across steps) and scores them with the reward functions
in worker processes; the trainer's GRPO uses it in one process, an explorer process alone."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np

from jrl.envs import ENVIRONMENTS, EnvSteps, EpisodeRollout, join_episodes, run_episodes
from jrl.envs.chat import observation_encoder
from jrl.rollout.base import RolloutBatch, SamplingParams, concat_rollouts, step_seed
from jrl.sources.partial import PartialRollout, PartialRollouts
from jrl.sources.scored import ScoredRollout
from jrl.rewards.pool import RewardScorer, StartedScoring
from jrl.rewards.functions import load_reward_functions

logger = logging.getLogger(__name__)


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

def run_sampling(cfg, policy) -> SamplingParams:
    """The run's sampling parameters: the ``rollout`` section, stopping at EOS."""
    eos = policy.tokenizer.eos_token_id
    return cfg.rollout.sampling_params(() if eos is None else (int(eos),))

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

class GroupSampler:
    """The rollout side of GRPO: a group of completions per prompt (the algorithm's ``samples_per_prompt``) at the
    run's sampling parameters, scored by the reward functions (in worker processes,
    :class:`~jrl.rewards.pool.RewardScorer`). The trainer's :class:`GRPO` uses it in one process; an explorer
    process uses it alone; any algorithm that trains on scored groups may."""

    def __init__(self, cfg, policy):
        self.tokenizer, self.pad_id = policy.tokenizer, policy.pad_id
        self.group, self.sampling = cfg.samples_per_prompt, run_sampling(cfg, policy)
        self.scorer = RewardScorer(load_reward_functions(cfg.rewards), num_workers=cfg.scoring.num_workers,
                                   timeout_s=cfg.scoring.timeout_s, max_failed_steps=cfg.scoring.max_failed_steps)
        self.stream = cfg.scoring.stream_groups
        self.env_cfg = cfg.env
        self.env = None if cfg.env.name is None else ENVIRONMENTS.get(cfg.env.name)(cfg.env)
        self.env_steps = None if self.env is None else EnvSteps(cfg.env.step_timeout_s)
        self.encode_observation = observation_encoder(self.tokenizer, cfg.env.observation_role)
        self.partial = (PartialRollouts(num_generations=self.group,
                                        groups_per_step=cfg.data.prompts_per_batch,
                                        max_staleness=cfg.rollout.max_staleness, pad_id=self.pad_id,
                                        keep_kv=cfg.rollout.partial_kv == "keep", checkpoint_every=cfg.save_every)
                        if cfg.rollout.partial else None)

    def generate(self, engine, prompt_batch, *, step: int,
                 seed: int) -> RolloutBatch | StreamedRollout | EpisodeRollout | PartialRollout:
        """The batch's completions (for training step ``step``); with ``scoring.stream_groups``, generated in chunks
        of that many prompts (chunk ``k`` sampled with a seed derived from ``seed`` and ``k``), each chunk's rewards
        started once it is out; with ``env.name``, episodes against the environment (:func:`jrl.envs.run_episodes`);
        with ``rollout.partial``, the first finished groups of those carried and these prompts'
        (:mod:`jrl.sources.partial`)."""
        g = self.group
        if self.partial is not None:
            return self.partial.generate(engine, prompt_batch, self.sampling, step=step, seed=seed)
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
        g = self.group
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
