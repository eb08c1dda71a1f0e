"""Replay buffer and deferred re-roll (docs/algorithms/grpo.md §14.9, §14.10): hand-computed cases, the GRPO
experience they change, and a prefetching run with both on that resumes exactly."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from jrl.data.pipeline import DataConfig, PromptBatch
from jrl.losses import GRPOConfig, advantages_from_config
from jrl.rollout.base import RolloutBatch
from jrl.train.config import ModelSpec, OptimConfig, RolloutConfig, ScoringConfig, TrainConfig
from jrl.sources.replay import ReplayBuffer, ReplayConfig, group_scores
from jrl.sources.reroll import RerollBuffer, RerollConfig, all_fail_groups
from jrl.rewards.functions import RewardSpec
from train_testlib import read_metrics_log, write_reward_file

PAD = 0


def _rollout(prompts: list[list[int]], completions: list[list[int]], group_size: int, version: int = 0):
    """A RolloutBatch of one prompt per group (repeated) and the given completions (stop token last)."""
    rows = [p for p in prompts for _ in range(group_size)]
    width = max(map(len, rows))
    p_ids = np.array([[PAD] * (width - len(p)) + p for p in rows], np.int32)
    p_mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in rows], np.int32)
    t = max(map(len, completions))
    c_ids = np.array([c + [PAD] * (t - len(c)) for c in completions], np.int32)
    c_mask = np.array([[1] * len(c) + [0] * (t - len(c)) for c in completions], np.int32)
    logp = np.where(c_mask > 0, -np.arange(1, t + 1, dtype=np.float32)[None] * 0.1 - version, np.nan)
    return RolloutBatch(p_ids, p_mask, c_ids, c_mask, logp.astype(np.float32), np.zeros(len(rows), bool), version)


def test_group_scores_are_abs_advantages_times_reward_spread():
    rewards = np.array([[1, 0], [0, 0], [1, 1], [0, 1], [2, np.nan], [2, np.nan]], np.float32)
    adv = np.array([1, -1, 0.5, -0.5, 0, 0], np.float32)
    # group 0: fn0 std 0.5, fn1 0 -> 0.5 x (1 + 1); group 1: fn0 0.5, fn1 0 -> 0.5 x 1; group 2: no spread
    np.testing.assert_allclose(group_scores(rewards, adv, 2), [1.0, 0.5, 0.0])


def test_exchange_puts_kept_groups_in_place_of_groups_without_signal():
    g, width = 2, 5
    buf = ReplayBuffer(ReplayConfig(buffer_size=4), group_size=g, seed=0)
    # step 0: groups 0 and 2 have signal, group 1 none; nothing kept yet, so nothing is replaced
    r0 = _rollout([[7], [8, 8], [9, 9, 9]], [[40, 2], [41], [42, 2], [43, 2], [44], [45, 46]], g)
    rw0 = np.array([[1.0], [0.0], [0.0], [0.0], [0.0], [3.0]], np.float32)
    out, rewards, n = buf.exchange(r0, rw0, np.array([1, -1, 0, 0, -1, 1]), np.array([True, False, True]), step=0,
                                   pad_id=PAD, width=width)
    assert n == 0 and len(buf) == 2 and out.completion_ids.shape == (6, width)
    np.testing.assert_array_equal(rewards, rw0)
    # step 1: groups 0 and 1 without signal take the two kept groups (drawn without replacement), group 2 stays
    r1 = _rollout([[5], [6], [4, 4]], [[50], [51], [52], [53], [54, 2], [55]], g, version=1)
    rw1 = np.array([[0], [0], [1], [1], [2], [0]], np.float32)
    out, rewards, n = buf.exchange(r1, rw1, np.array([0, 0, 0, 0, 1, -1]), np.array([False, False, True]), step=1,
                                   pad_id=PAD, width=width)
    assert n == 2 and len(buf) == 3  # the step's own group with signal is kept after the draw
    placed = sorted((tuple(out.completion_ids[2 * k]), k) for k in (0, 1))
    assert [c[0] for c, _ in placed] == [40, 44]
    for first, k in placed:
        src = 0 if first[0] == 40 else 4  # step 0's rows of that group
        rows = slice(2 * k, 2 * k + 2)
        np.testing.assert_array_equal(out.completion_ids[rows, :2], r0.completion_ids[src:src + 2])
        np.testing.assert_array_equal(out.completion_mask[rows, :2], r0.completion_mask[src:src + 2])
        np.testing.assert_array_equal(out.sampling_logprobs[rows, :2], r0.sampling_logprobs[src:src + 2])
        assert np.isnan(out.sampling_logprobs[rows, 2:]).all() and (out.completion_mask[rows, 2:] == 0).all()
        np.testing.assert_array_equal(rewards[rows], rw0[src:src + 2])
        prompt = out.prompt_ids[2 * k][out.prompt_mask[2 * k] > 0]
        assert list(prompt) == ([7] if src == 0 else [9, 9, 9])
    # untouched group 2, its prompt re-padded to the longest prompt of the batch
    np.testing.assert_array_equal(out.completion_ids[4:, :2], r1.completion_ids[4:])
    assert list(out.prompt_ids[4][out.prompt_mask[4] > 0]) == [4, 4] and out.prompt_ids.shape[1] == 3
    assert out.policy_version == 1


def test_a_full_buffer_keeps_the_higher_scores_and_forgets_old_groups():
    g = 2
    buf = ReplayBuffer(ReplayConfig(buffer_size=2, max_age=3), group_size=g, seed=0)

    def add(step, spreads):  # one group per spread s: rewards (s, 0), advantages (1, -1) -> score 2 x s / 2 = s
        rows = [[s] for s in spreads for s in (s, 0.0)]
        r = _rollout([[1]] * len(spreads), [[10 + step]] * (g * len(spreads)), g)
        buf.exchange(r, np.array(rows, np.float32), np.tile([1.0, -1.0], len(spreads)),
                     np.ones(len(spreads), bool), step=step, pad_id=PAD, width=2)

    add(0, [1.0, 3.0])
    add(1, [2.0, 0.5])  # 2.0 replaces the lowest (1.0); 0.5 is lower than both kept, dropped
    assert sorted(x.score for x in buf.groups) == [2.0, 3.0]
    add(4, [0.25])  # step 0's group is 4 steps old > max_age 3: dropped, which leaves room for a low score
    assert sorted((x.step, x.score) for x in buf.groups) == [(1, 2.0), (4, 0.25)]


def test_draws_follow_the_scores_and_the_step_seed():
    buf = ReplayBuffer(ReplayConfig(buffer_size=3), group_size=2, seed=7)
    r = _rollout([[1], [2], [3]], [[11], [12], [21], [22], [31], [32]], 2)
    buf.exchange(r, np.array([[9], [0], [1], [0], [0], [0]], np.float32), np.array([1, -1, 1, -1, 0, 0]),
                 np.array([True, True, True]), step=0, pad_id=PAD, width=2)
    assert sorted(x.score for x in buf.groups) == [0.0, 1.0, 9.0]
    firsts = [buf._draw(1, step)[0].completion_ids[0, 0] for step in range(400)]
    share = {c: firsts.count(c) / 400 for c in (11, 21, 31)}
    assert share[31] == 0 and abs(share[11] - 0.9) < 0.05 and abs(share[21] - 0.1) < 0.05
    assert [x.completion_ids[0, 0] for x in buf._draw(3, 5)] == [x.completion_ids[0, 0] for x in buf._draw(3, 5)]


def test_replay_state_round_trips_exactly():
    buf = ReplayBuffer(ReplayConfig(buffer_size=2), group_size=2, seed=0)
    r = _rollout([[3, 4]], [[5, 6], [7]], 2)
    buf.exchange(r, np.array([[1, np.nan], [0, np.nan]], np.float32), np.array([1, -1]), np.array([True]), step=3,
                 pad_id=PAD, width=4)
    again = ReplayBuffer(ReplayConfig(buffer_size=2), group_size=2, seed=0)
    again.load_state(json.loads(json.dumps(buf.state())))
    (a,), (b,) = buf.groups, again.groups
    assert (a.score, a.step, a.prompt_ids) == (b.score, b.step, b.prompt_ids) == (1.0, 3, [3, 4])
    for f in ("completion_ids", "completion_mask", "sampling_logprobs", "truncated", "rewards"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
        assert getattr(a, f).dtype == getattr(b, f).dtype


def test_episode_groups_keep_their_loss_mask_through_the_buffer_and_a_checkpoint():
    """Episodes (the environment's tokens in the completion, loss mask 0 on them): a kept group brings its loss mask
    where it is replayed, the batch's own rows keep theirs, and the buffer's state keeps it."""
    g, width = 2, 6
    buf = ReplayBuffer(ReplayConfig(buffer_size=2), group_size=g, seed=0)
    r0 = _rollout([[7], [8]], [[40, 41, 42, 2], [43, 2], [44, 2], [45, 2]], g)
    loss0 = (r0.completion_mask * np.array([[1, 0, 0, 1]], np.int32)).astype(np.int32)  # tokens 1-2: observation
    buf.exchange(dataclasses.replace(r0, loss_mask=loss0), np.array([[1], [0], [0], [0]], np.float32),
                 np.array([1, -1, 0, 0]), np.array([True, False]), step=0, pad_id=PAD, width=width)
    again = ReplayBuffer(ReplayConfig(buffer_size=2), group_size=g, seed=0)
    again.load_state(json.loads(json.dumps(buf.state())))
    np.testing.assert_array_equal(again.groups[0].loss_mask[:, :4], loss0[:2])
    r1 = _rollout([[5], [6]], [[50, 2], [51, 2], [52, 53, 2], [54]], g, version=1)
    loss1 = r1.completion_mask.copy()
    loss1[2, 1] = 0
    for buffer in (buf, again):  # group 0 of step 1 has no signal: step 0's group 0 takes its place
        out, _, n = buffer.exchange(dataclasses.replace(r1, loss_mask=loss1), np.array([[0], [0], [1], [0]], np.float32),
                                    np.array([0, 0, 1, -1]), np.array([False, True]), step=1, pad_id=PAD, width=width)
        assert n == 1 and out.loss_mask.shape == (4, width)
        np.testing.assert_array_equal(out.loss_mask[:2, :4], loss0[:2])
        np.testing.assert_array_equal(out.loss_mask[2:, :3], loss1[2:])
        assert (out.loss_mask[:, 4:] == 0).all() and (out.loss_mask <= out.completion_mask).all()


def test_all_fail_groups_need_every_reward_zero_and_finite():
    rewards = np.array([[0, 0], [0, 1e-7], [0, 0], [0, 1], [0, np.nan], [0, 0]], np.float32)
    np.testing.assert_array_equal(all_fail_groups(rewards, 2), [True, False, False])


def _failed(indices, failing):
    """(each group's dataset index, all-fail flags) of a batch whose groups ``failing`` failed."""
    return list(indices), np.isin(indices, failing)


def test_reroll_takes_from_the_start_step_with_the_prefetch_lag():
    cfg = RerollConfig(start_fraction=0.25, max_groups=2)
    buf = RerollBuffer(cfg, max_steps=10, lag=1)  # start = max(1, floor(2.5)) = 2
    assert buf.start == 2
    counts = {"reroll_failed_again": 0.0, "reroll_dropped": 0.0}
    assert buf.add(0, *_failed([4, 5, 6, 7], [5, 6, 7])) == {
        "reroll_buffered": 3.0, "reroll_buffer_size": 3.0, "reroll_groups": 0.0, **counts}
    assert buf.take(1) == []  # before the start step
    assert buf.add(1, *_failed([8, 3], [8])) == {
        "reroll_buffered": 1.0, "reroll_buffer_size": 4.0, "reroll_groups": 0.0, **counts}
    assert buf.take(2) == [5, 6]  # FIFO, at most max_groups
    assert buf.take(3) == [7, 8]  # step 1's prompt: from batch 1 + 1 + lag = 3 on
    # 7 and 8 are taken by batch 3, which step 2 has not trained on: still in the buffer's size, whatever the thread
    # timing of the producer's take. Batch 2 = two fresh prompts, then the re-rolls 5 and 6; 5 solved, 6 failed again.
    assert buf.add(2, *_failed([9, 1, 5, 6], [9, 6])) == {
        "reroll_buffered": 2.0, "reroll_buffer_size": 4.0, "reroll_groups": 2.0, "reroll_failed_again": 1.0,
        "reroll_dropped": 0.0}
    assert buf.take(4) == [9, 6]
    # A checkpoint at step 3 has batches 3 and 4 not trained yet: their prompts wait again, in their order, and a
    # resumed run's batches take them again, 6 with its re-roll counted.
    assert buf.state(3) == [[0, 7, 0], [1, 8, 0], [2, 9, 0], [2, 6, 1]]
    again = RerollBuffer(cfg, max_steps=10, lag=1)
    again.load_state(buf.state(3))
    assert again.take(3) == [7, 8] and again.take(4) == [9, 6]
    # checkpoints written before re-rolls were counted hold [step, index]
    old = RerollBuffer(cfg, max_steps=10, lag=1)
    old.load_state([[0, 7], [1, 8]])
    assert old.state(2) == [[0, 7, 0], [1, 8, 0]]


def test_max_rerolls_drops_a_prompt_that_keeps_failing():
    # Prompt 2 fails in a fresh batch, then in each of its re-rolls; with max_rerolls 2 it is sampled again twice.
    buf = RerollBuffer(RerollConfig(start_fraction=0.0, max_rerolls=2), max_steps=10, lag=0)
    assert buf.add(0, *_failed([1, 2], [2]))["reroll_buffered"] == 1.0
    for step, dropped in ((1, 0.0), (2, 1.0)):
        assert buf.take(step) == [2]
        out = buf.add(step, *_failed([10 + step, 2], [2]))
        assert out == {"reroll_buffered": 1.0 - dropped, "reroll_buffer_size": 1.0 - dropped, "reroll_groups": 1.0,
                       "reroll_failed_again": 1.0, "reroll_dropped": dropped}
    assert buf.take(3) == []
    # without a limit it comes back every time
    unlimited = RerollBuffer(RerollConfig(start_fraction=0.0), max_steps=10, lag=0)
    unlimited.add(0, *_failed([1, 2], [2]))
    for step in range(1, 6):
        assert unlimited.take(step) == [2]
        assert unlimited.add(step, *_failed([10 + step, 2], [2]))["reroll_dropped"] == 0.0


def test_reroll_never_takes_at_start_fraction_one():
    buf = RerollBuffer(RerollConfig(), max_steps=5, lag=0)
    buf.add(0, *_failed([1], [1]))
    assert [buf.take(k) for k in range(1, 5)] == [[], [], [], []]


def test_prompt_batch_with_last_replaces_the_tail():
    a = PromptBatch([[1], [2], [3]], ["a", "b", "c"], ["a", "b", "c"], {"q": ["a", "b", "c"], "ans": [1, 2, 3]},
                    [0, 1, 2])
    b = PromptBatch([[9]], ["z"], ["z"], {"q": ["z"], "ans": [9]}, [7])
    out = a.with_last(b)
    assert out.prompt_ids == [[1], [2], [9]] and out.indices == [0, 1, 7] and out.columns["ans"] == [1, 2, 9]
    with pytest.raises(ValueError, match="columns"):
        a.with_last(PromptBatch([[9]], ["z"], ["z"], {"q": ["z"]}, [7]))


# ---------------------------------------------------------------------------------------------- in the trainer
def _cfg(model_dir, out, reward, **kw) -> TrainConfig:
    cfg = TrainConfig(
        model=ModelSpec(path=str(model_dir)), data=DataConfig(prompts_per_batch=2, max_prompt_length=64, seed=1),
        rollout=RolloutConfig(max_new_tokens=6, temperature=0.9, prefetch_depth=1, max_staleness=1),
        rewards=(RewardSpec(path=f"{reward}:rare_low_id"),), algo=GRPOConfig(num_generations=4, loss_type="grpo"),
        optim=OptimConfig(learning_rate=1e-3, micro_batch_size=4), output_dir=str(out), max_steps=8, save_every=4,
        seed=3, replay=ReplayConfig(buffer_size=2), reroll=RerollConfig(start_fraction=0.0, max_groups=1),
        scoring=ScoringConfig(num_workers=0))
    return dataclasses.replace(cfg, **kw)


def test_prefetching_run_with_replay_and_reroll_resumes_exactly(tiny_model_dir, tmp_path):
    from jrl.train.trainer import train

    ok = write_reward_file(tmp_path, "reward_ok")
    straight = train(_cfg(tiny_model_dir, tmp_path / "a", ok), progress=False)
    # Both mechanisms did something, and across the step-4 checkpoint.
    assert sum(r["reroll_buffered"] for r in straight[:4]) > 0 and sum(r["reroll_groups"] for r in straight[4:]) > 0
    assert sum(r["replay_buffer_replacements"] for r in straight[4:]) > 0
    assert [r["replay_buffer_size"] for r in straight][-1] == 2
    # Killed in step 6 (the producer had taken later prompts, maybe re-rolled ones), resumed from step 4.
    crash = write_reward_file(tmp_path, "reward_crash", crash=5)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny_model_dir, tmp_path / "b", crash), progress=False)
    assert len(read_metrics_log(tmp_path / "b")) == 5
    train(_cfg(tiny_model_dir, tmp_path / "b", ok, resume=True), progress=False)
    timing = ("tokens_per_second", "async/queue_depth")
    assert read_metrics_log(tmp_path / "b", timing) == read_metrics_log(tmp_path / "a", timing)
    # Resuming with replay off is refused, naming the setting.
    with pytest.raises(ValueError, match="replay on, this run has it off"):
        train(_cfg(tiny_model_dir, tmp_path / "b", ok, resume=True, max_steps=9, replay=ReplayConfig()),
              progress=False)


def test_a_replayed_group_gets_advantages_from_its_raw_rewards_in_the_new_batch(tiny_model_dir, tmp_path):
    from jrl.train.trainer import Trainer

    trainer = Trainer(_cfg(tiny_model_dir, tmp_path / "run", write_reward_file(tmp_path, "reward_ok"),
                           rollout=RolloutConfig(max_new_tokens=6)), progress=False)
    try:
        alg, prompts = trainer.algorithm, trainer.loader.dataset.batch([0, 1])
        # rare_low_id: 1 for a completion holding a token id < 8. Step 0: group 0 has signal, group 1 none.
        r0 = _rollout(prompts.prompt_ids, [[3, 100], [100], [100], [100], [100], [100], [100], [100]], 4)
        batch0, m0 = alg.make_experience(r0, prompts, trainer.learner, 0)
        assert m0["replay_buffer_replacements"] == 0 and m0["reroll_buffered"] == 1
        # Step 1: group 0 has no signal and takes step 0's group 0; group 1 has its own signal.
        r1 = _rollout(prompts.prompt_ids, [[100]] * 4 + [[3], [4], [100], [100]], 4, version=1)
        batch1, m1 = alg.make_experience(r1, prompts, trainer.learner, 1)
    finally:
        trainer.close()
    assert m1["replay_buffer_replacements"] == 1 and m1["reward/mean"] == 0.25  # the metric is of the generated batch
    np.testing.assert_array_equal(batch1.completion_mask[:4], batch0.completion_mask[:4])
    np.testing.assert_array_equal(batch1.completion_ids[:4] * batch1.completion_mask[:4],
                                  batch0.completion_ids[:4] * batch0.completion_mask[:4])
    np.testing.assert_array_equal(batch1.sampler_logprobs[:4], batch0.sampler_logprobs[:4])
    expected = advantages_from_config(np.array([[1], [0], [0], [0], [1], [1], [0], [0]], np.float32), alg.algo)
    np.testing.assert_allclose(batch1.advantages, expected, rtol=1e-6)
    assert batch1.has_signal.all() and not batch0.has_signal[4:].any()
