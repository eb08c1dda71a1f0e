"""Streaming scoring (docs/algorithms/grpo.md §14.7): a batch generated in chunks, each chunk's rewards sent to the
worker processes before the next chunk is generated, and the same experience as unchunked scoring."""

from __future__ import annotations

import dataclasses
import os
import time

import numpy as np
import pytest

from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig
from jrl.train.algorithms.group_sampler import StreamedRollout
from jrl.train.config import ModelSpec, OptimConfig, RolloutConfig, ScoringConfig, TrainConfig
from jrl.rewards.functions import RewardSpec

#: A reward that leaves a file in $JRL_TEST_MARKERS when a worker starts a call (then scores like low_ids).
MARKING_REWARD = '''
import os, uuid

def marked_low_ids(prompts, completions, completion_ids, **kw):
    open(os.path.join(os.environ["JRL_TEST_MARKERS"], uuid.uuid4().hex), "w").close()
    return [sum(i < 128 for i in ids) / max(1, len(ids)) for ids in completion_ids]
'''


def _cfg(model_dir, out, reward, stream: int) -> TrainConfig:
    return TrainConfig(
        model=ModelSpec(path=str(model_dir)), data=DataConfig(prompts_per_batch=4, max_prompt_length=64, seed=1),
        rollout=RolloutConfig(max_new_tokens=6, top_k=1),  # greedy: chunking does not change the completions
        rewards=(RewardSpec(path=f"{reward}:marked_low_ids"),), algo=GRPOConfig(num_generations=2),
        optim=OptimConfig(micro_batch_size=4), output_dir=str(out), max_steps=2,
        scoring=ScoringConfig(num_workers=1, stream_groups=stream))


def _wait_for(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class _AfterRewards:
    """The trainer's engine, except that each generate call after the first waits until as many reward calls have
    started (marker files) as generate calls came before it, and records whether they had."""

    def __init__(self, engine, markers):
        self.engine, self.markers, self.waited = engine, markers, []

    def generate(self, *args, **kwargs):
        calls = len(self.waited)
        self.waited.append(_wait_for(lambda: len(os.listdir(self.markers)) >= calls, timeout=30.0 if calls else 0))
        return self.engine.generate(*args, **kwargs)


def test_streamed_chunks_are_scored_while_the_next_is_generated_with_the_same_experience(
        tiny_model_dir, tmp_path, monkeypatch):
    from jrl.train.trainer import Trainer

    reward = tmp_path / "marking_reward.py"
    reward.write_text(MARKING_REWARD)
    monkeypatch.setenv("JRL_TEST_MARKERS", str(tmp_path / "markers"))
    (tmp_path / "markers").mkdir()
    out = {}
    for stream in (0, 2):
        trainer = Trainer(_cfg(tiny_model_dir, tmp_path / f"run{stream}", reward, stream), progress=False)
        try:
            alg = trainer.algorithm
            prompts = trainer.loader.dataset.batch([0, 1, 2, 3])
            engine = _AfterRewards(trainer.engine, tmp_path / "markers")
            rollout = alg.generate(engine, prompts, step=0, seed=11)
            assert isinstance(rollout, StreamedRollout) == bool(stream)
            batch, metrics = alg.make_experience(rollout, prompts, trainer.learner, 0)
            out[stream] = (batch, metrics, engine.waited)
        finally:
            trainer.close()
        for marker in (tmp_path / "markers").iterdir():
            marker.unlink()
    (plain, plain_metrics, plain_waits), (streamed, streamed_metrics, waits) = out[0], out[2]
    assert plain_waits == [True]  # one generate call, nothing to wait for
    # Two chunks of 2 prompts: the second was generated only after the first chunk's reward call had started.
    assert waits == [True, True]
    np.testing.assert_array_equal(streamed.completion_mask, plain.completion_mask)
    np.testing.assert_array_equal(streamed.completion_ids * streamed.completion_mask,
                                  plain.completion_ids * plain.completion_mask)
    np.testing.assert_allclose(streamed.advantages, plain.advantages, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(streamed.has_signal, plain.has_signal)
    assert streamed_metrics["reward/mean"] == pytest.approx(plain_metrics["reward/mean"], rel=1e-6)
    assert streamed_metrics["reward/marked_low_ids/errors"] == 0


def test_stream_groups_needs_workers_and_whole_chunks():
    with pytest.raises(ValueError, match=r"ScoringConfig\.stream_groups=2.*num_workers >= 1"):
        ScoringConfig(num_workers=0, stream_groups=2)
    with pytest.raises(ValueError, match=r"TrainConfig\.scoring\.stream_groups=3.*prompts_per_batch=8"):
        dataclasses.replace(TrainConfig(), data=DataConfig(prompts_per_batch=8), scoring=ScoringConfig(stream_groups=3))
