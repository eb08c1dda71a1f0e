"""The ``env`` section: a run with an environment needs no reward functions and gets the episode's reward as one
more weighted column; wrong names and the parts that do not carry episodes yet are refused by name; the shipped
multi-turn config trains through the CLI, logs the episodes' metrics and evaluates held-out episodes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jrl.envs import EnvConfig
from jrl.sources.config import ReplayConfig
from jrl.train.config import ScoringConfig
from jrl.train.config import ARITHMETIC_REWARDS, TrainConfig

ROOT = Path(__file__).resolve().parents[2]


def test_an_environment_run_needs_no_reward_functions_and_weighs_the_episode_reward():
    cfg = TrainConfig(rewards=(), env=EnvConfig(name="higher_lower", reward_weight=2.0))
    assert cfg.reward_weights == (2.0,)
    both = TrainConfig(rewards=ARITHMETIC_REWARDS, env=EnvConfig(name="higher_lower"))
    assert both.reward_weights == (1.0, 0.5, 1.0)
    with pytest.raises(ValueError, match="TrainConfig.rewards"):
        TrainConfig(rewards=())
    replayed = TrainConfig(rewards=(), env=EnvConfig(name="higher_lower"), replay=ReplayConfig(buffer_size=2))
    assert replayed.replay.buffer_size == 2  # the replay buffer keeps episodes' loss masks


@pytest.mark.parametrize("change, field", [
    (dict(env=EnvConfig(name="nope")), "env.name"),
    (dict(env=EnvConfig(max_turns=5)), "env=.*env.name=None"),
    (dict(env=EnvConfig(name="higher_lower", max_episode_tokens=512)), "algo.max_completion_length"),
    (dict(env=EnvConfig(name="higher_lower"), algorithm="ebft_structured"), "env"),
])
def test_refused_by_name(change, field):
    base = TrainConfig()
    if "max_episode_tokens" in str(change):
        base = dataclasses.replace(base, algo=dataclasses.replace(base.algo, max_completion_length=256))
    with pytest.raises(ValueError, match=field if "*" in field else field.replace(".", r"\.")):
        dataclasses.replace(base, **change)


@pytest.mark.parametrize("field, value", [("max_turns", 0), ("max_episode_tokens", 0), ("step_timeout_s", 0.0),
                                          ("name", "")])
def test_env_config_fields_are_checked(field, value):
    with pytest.raises(ValueError, match=f"EnvConfig.{field}"):
        EnvConfig(**{field: value})


def test_the_multi_turn_config_trains_through_the_cli(tmp_path):
    out = subprocess.run([sys.executable, "scripts/train.py", "--config", "configs/grpo_multiturn.py",
                          "--max-steps", "2", "--output-dir", str(tmp_path / "run"), "--eval-every", "2",
                          "--eval.holdout", "8", "--eval.decodings", "greedy"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    assert len(rows) == 2 and 1 <= last["env/turns/mean"] <= 3
    episode_reward = last["reward/env/higher_lower/mean"]
    assert 0 <= episode_reward <= 1 and last["reward/mean"] == episode_reward
    assert 0 < last["env/model_tokens/mean"] <= last["completions/mean_length"]  # observations are not the model's
    # Held-out episodes: one per prompt, scored by the environment (before the first step and at step 2).
    evals = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    assert len(evals) == 2 and all(0 <= e["eval/greedy/reward/env/higher_lower/mean"] <= 1 for e in evals), evals
    samples = [json.loads(line) for line in (tmp_path / "run" / "eval_samples.jsonl").read_text().splitlines()]
    assert samples and set(samples[0]["rewards"]) == {"env/higher_lower"}


def test_an_explorer_plays_episodes_into_the_queue(tmp_path):
    """``mode='explore'`` with an environment: the explorer plays episodes and writes their groups with the loss mask
    (the environment's tokens 0) and the episode reward column; a trainer fed by the queue reads them back."""
    import runpy

    from jrl.explore.config import ExploreConfig
    from jrl.explore.publication import WeightPublisher, trainable
    from jrl.explore.queue import open_queue
    from jrl.train.config import ScoringConfig
    from jrl.train.exploration import Explorer, scored_rollout
    from jrl.train.policy_loading import load_policy

    base = runpy.run_path(str(ROOT / "configs" / "grpo_multiturn.py"))["config"]()
    cfg = dataclasses.replace(base, mode="explore", output_dir=str(tmp_path),
                              model=dataclasses.replace(base.model, path=str(ROOT / "models" / "tiny-arithmetic")),
                              data=dataclasses.replace(base.data, prompts_per_batch=4),
                              scoring=ScoringConfig(num_workers=0),
                              explore=ExploreConfig(name="e", max_batches=1, timeout_s=30.0))
    publisher = WeightPublisher(cfg.explore.weights_path(tmp_path), keep=2)
    publisher.reset()
    publisher.publish(trainable(load_policy(cfg).model)[1], 0, lora=False)
    explorer = Explorer(cfg)
    try:
        assert explorer.run() == 1
    finally:
        explorer.close()
    g = cfg.algo.num_generations
    groups = open_queue(cfg.explore.queue_url(cfg.output_dir)).take(4, step=1, timeout=0.0)
    assert all(grp.reward_names == ("env/higher_lower",) and grp.loss_mask is not None for grp in groups)
    rollout = scored_rollout(groups, pad_id=0, group_size=g, num_rewards=1).rollout
    mask, loss = rollout.completion_mask.astype(bool), rollout.loss_mask.astype(bool)
    assert (loss <= mask).all() and (mask & ~loss).any(), "episodes of several turns hold the environment's tokens"
    assert np.isfinite(np.concatenate([grp.rewards for grp in groups])).any()


def test_streamed_episodes_are_scored_chunk_by_chunk_like_the_whole_batch():
    """``scoring.stream_groups`` with an environment: the batch's episodes are played a chunk of prompts at a time and
    each chunk's reward calls start as it ends; the rewards are those of scoring the joined episodes at once, the
    episode reward is the last column and the loss mask leaves the observations out."""
    import runpy

    from jrl.data.pipeline import PromptLoader, build_prompt_dataset
    from jrl.rollout.jax_engine import JaxRolloutEngine
    from jrl.train.algorithms.group_sampler import GroupSampler, StreamedRollout
    from jrl.train.policy_loading import load_policy

    base = runpy.run_path(str(ROOT / "configs" / "grpo_multiturn.py"))["config"]()
    cfg = dataclasses.replace(base, rewards=ARITHMETIC_REWARDS, scoring=ScoringConfig(num_workers=1, stream_groups=2),
                              model=dataclasses.replace(base.model, path=str(ROOT / "models" / "tiny-arithmetic")),
                              data=dataclasses.replace(base.data, prompts_per_batch=4))
    policy = load_policy(cfg)
    sampler = GroupSampler(cfg, policy)
    try:
        batch = next(PromptLoader(build_prompt_dataset(cfg.data, policy.tokenizer), cfg.data))
        streamed = sampler.generate(JaxRolloutEngine(policy.model, pad_id=policy.pad_id), batch, step=0, seed=3)
        assert isinstance(streamed, StreamedRollout) and len(streamed.scoring) == 2
        g = cfg.algo.num_generations
        assert streamed.episodes is not None and len(streamed.episodes.rewards) == 4 * g
        scored = sampler.score(streamed, batch, 0)
        again = sampler.score(streamed.episodes, batch, 0)  # the same episodes, scored after the fact
        assert scored.reward_names == again.reward_names == ("exact_match", "format_reward", "env/higher_lower")
        np.testing.assert_array_equal(scored.rewards, again.rewards)
        np.testing.assert_array_equal(scored.rewards[:, -1], streamed.episodes.rewards)
        mask, loss = scored.rollout.completion_mask.astype(bool), scored.rollout.loss_mask.astype(bool)
        assert (loss <= mask).all() and (mask & ~loss).any()
        assert scored.failures["env/turns/mean"] >= 1
    finally:
        sampler.close()
