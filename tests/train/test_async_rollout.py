"""Asynchronous rollouts: the version schedule, the producer thread, and the GRPO trainer with prefetch."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest

from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig
from jrl.sources.prefetch import ProducedRollout, RolloutProducer, RolloutProducerError, RolloutSchedule
from jrl.train.config import ModelSpec, OptimConfig, RolloutConfig, ScoringConfig, TrainConfig
from jrl.rewards.functions import RewardSpec
from train_testlib import read_metrics_log, run_worker, write_reward_file

#: Per-step metrics that depend on timing, not on the computation.
TIMING = ("tokens_per_second", "async/queue_depth")

#: Rewards in the trainer's process, where the crash reward's KeyboardInterrupt kills the run.
IN_PROCESS = ScoringConfig(num_workers=0)


def _cfg(model_dir, out, reward, *, prefetch_depth=0, max_staleness=1, sync_interval=1, **kw) -> TrainConfig:
    cfg = TrainConfig(
        model=ModelSpec(path=str(model_dir)), data=DataConfig(prompts_per_batch=2, max_prompt_length=64, seed=1),
        rollout=RolloutConfig(max_new_tokens=6, temperature=0.9, prefetch_depth=prefetch_depth,
                              max_staleness=max_staleness, sync_interval=sync_interval),
        rewards=(RewardSpec(path=f"{reward}:low_ids"),), algo=GRPOConfig(num_generations=4, loss_type="grpo"),
        optim=OptimConfig(learning_rate=2e-2, micro_batch_size=4), output_dir=str(out), max_steps=3, save_every=0,
        seed=5)
    return dataclasses.replace(cfg, **kw)


def _log(out_dir) -> list[dict]:
    return read_metrics_log(out_dir, TIMING)


def _producer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "jrl-rollout-producer"]


# ---------------------------------------------------------------------------------------------- schedule
@pytest.mark.parametrize("start", [0, 3])
@pytest.mark.parametrize("interval,run_ahead,ckpt", [(1, 0, 0), (1, 1, 0), (1, 2, 4), (2, 1, 0), (3, 2, 5), (2, 0, 3)])
def test_schedule_bounds_lag_and_respects_syncs_and_checkpoints(start, interval, run_ahead, ckpt):
    s = RolloutSchedule(start=start, sync_interval=interval, run_ahead=run_ahead, checkpoint_every=ckpt)
    versions = [s.generating_version(k) for k in range(start, start + 40)]
    assert versions == sorted(versions)
    for k, v in zip(range(start, start + 40), versions):
        assert start <= v <= k and k - v <= run_ahead + interval - 1
        assert s.is_sync_step(v)  # the engine holds only synced versions
        if ckpt:  # never generated ahead across a checkpoint
            assert v >= max(start, k // ckpt * ckpt)
        # the freshest synced version allowed by run_ahead (nothing older than needed)
        fresher = [u for u in range(v + 1, k - run_ahead + 1) if s.is_sync_step(u)]
        assert not fresher
    if interval == 1 and run_ahead == 0:
        assert versions == list(range(start, start + 40))


def test_rollout_config_validation_names_the_field():
    with pytest.raises(ValueError, match=r"RolloutConfig.max_staleness=1 .*sync_interval=3"):
        RolloutConfig(sync_interval=3, max_staleness=1)
    with pytest.raises(ValueError, match="RolloutConfig.sync_interval=0"):
        RolloutConfig(sync_interval=0)
    with pytest.raises(ValueError, match="RolloutConfig.prefetch_depth=-1"):
        RolloutConfig(prefetch_depth=-1)
    with pytest.raises(ValueError, match="RolloutConfig.max_staleness=True"):
        RolloutConfig(max_staleness=True)
    with pytest.raises(ValueError, match=r"RolloutConfig.partial_kv='reuse' .*use one of \('keep', 'recompute'\)"):
        RolloutConfig(partial_kv="reuse")
    assert RolloutConfig(prefetch_depth=2, max_staleness=1).run_ahead == 1
    assert RolloutConfig(prefetch_depth=2, max_staleness=4, sync_interval=2).run_ahead == 2
    assert RolloutConfig(prefetch_depth=0, max_staleness=3).run_ahead == 0


# ---------------------------------------------------------------------------------------------- producer
def test_producer_error_surfaces_with_traceback_and_close_is_bounded():
    release = threading.Event()

    def make(k):
        if k == 1:
            raise ValueError("prompt batch 1 is broken")
        return ProducedRollout(k, None, None, {"k": k}, 0.0)

    def failing_deep_inside(k):
        return make(k)

    p = RolloutProducer(failing_deep_inside, RolloutSchedule(start=0, run_ahead=1), depth=1, stop=5)
    item, _, _ = p.get(0)
    assert item.index == 0 and item.data_state == {"k": 0}
    with pytest.raises(RolloutProducerError, match="generating batch 1: ValueError: prompt batch 1 is broken") as err:
        p.get(1)
    assert "failing_deep_inside" in str(err.value) and isinstance(err.value.__cause__, ValueError)
    assert p.close(timeout=5.0)

    # Blocked waiting for weights that never come: close() returns at once.
    p = RolloutProducer(lambda k: ProducedRollout(k, None, None, {}, 0.0), RolloutSchedule(start=0), depth=2, stop=5)
    p.get(0)
    t0 = time.perf_counter()
    assert p.close(timeout=5.0)
    assert time.perf_counter() - t0 < 2.0
    with pytest.raises(RolloutProducerError, match="closed"):
        p.get(1)

    # Stuck inside a generate call: close() gives up after its timeout and leaves a daemon thread.
    p = RolloutProducer(lambda k: release.wait(30) and ProducedRollout(k, None, None, {}, 0.0),
                        RolloutSchedule(start=0), depth=1, stop=5)
    time.sleep(0.1)
    t0 = time.perf_counter()
    assert not p.close(timeout=0.3)
    assert time.perf_counter() - t0 < 2.0
    release.set()
    for t in _producer_threads():
        t.join(5.0)
    assert not _producer_threads()


def test_producer_respects_depth_and_versions():
    made, lock = [], threading.Lock()

    def make(k):
        with lock:
            made.append(k)
        return ProducedRollout(k, None, None, {}, 0.0)

    s = RolloutSchedule(start=0, run_ahead=2)
    p = RolloutProducer(make, s, depth=2, stop=10)
    try:
        deadline = time.time() + 5
        while len(made) < 1 and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)
        assert made == [0, 1]  # depth 2; batch 2 needs version 0 too but the queue is full
        p.get(0)
        p.release_weights(1)  # batch 2 (version 0) must be generated before version 1 replaces it
        assert made == [0, 1, 2]
        p.weights_synced(1)
        time.sleep(0.2)
        assert made == [0, 1, 2]  # batch 3 needs version 1 and room: the queue holds 1 and 2
        p.get(1)
        p.release_weights(2)
        assert made == [0, 1, 2, 3]
    finally:
        assert p.close(timeout=5.0)


# ---------------------------------------------------------------------------------------------- trainer
def _reference_synchronous_run(cfg: TrainConfig) -> list[dict]:
    """The synchronous loop written out from the public pieces: generate batch k with version k, train, sync."""
    from jrl.losses import advantages_from_config, group_has_signal, sequence_has_signal
    from jrl.train.algorithms.group_sampler import completion_token_lists
    from jrl.train.algorithms.grpo_update import build_step_batch
    from jrl.rewards.functions import compute_rewards
    from jrl.sources.rollout import step_seed
    from jrl.train.trainer import Trainer

    tr = Trainer(cfg, progress=False)
    algo = tr.algorithm
    g, out = cfg.algo.num_generations, []
    try:
        for k in range(cfg.max_steps):
            pb = next(tr.loader)
            rollout = tr.engine.generate(pb.prompt_ids, algo.sampling, num_generations=g, seed=step_seed(cfg.seed, k))
            ids = completion_token_lists(rollout)
            rep = pb.repeat(g)
            texts = [tr.tokenizer.decode(x, skip_special_tokens=True) for x in ids]
            rewards, _ = compute_rewards(algo.sampler.scorer.fns, None, rep.prompts, texts, ids, rep.columns,
                                         batch=f"step {k}")
            signal = sequence_has_signal(group_has_signal(rewards, group_size=g, reward_weights=algo.algo.reward_weights),
                                         g)
            batch = build_step_batch(rollout, np.asarray(advantages_from_config(rewards, algo.algo)), pad_id=tr.pad_id,
                                     completion_length=cfg.rollout.max_new_tokens, has_signal=np.asarray(signal))
            out.append(algo.update(tr.learner, batch) | {"reward/mean": float(np.mean(rewards))})
            tr.engine.sync_weights(tr.learner.model, k + 1)
    finally:
        tr.close()
    return out


def test_synchronous_and_zero_staleness_prefetch_equal_the_reference_loop(tiny_model_dir, tmp_path):
    from jrl.train.trainer import train

    reward = write_reward_file(tmp_path, "reward_sync")
    ref = _reference_synchronous_run(_cfg(tiny_model_dir, tmp_path / "ref", reward))
    sync = train(_cfg(tiny_model_dir, tmp_path / "sync", reward), progress=False)
    assert any(r["skipped_zero_adv_batches"] < 2 for r in sync)  # some updates had learning signal
    for want, got in zip(ref, sync, strict=True):
        for key in ("loss", "grad_norm", "sampling/importance_sampling_ratio/mean"):
            assert got[key] == want[key], key
        assert got["reward/mean"] == pytest.approx(want["reward/mean"], rel=1e-6)
        assert got["async/staleness"] == 0 and got["async/queue_depth"] == 0
    assert [r["sync/version"] for r in sync] == [1, 2, 3]  # synced after every step
    # A producer thread that may not run ahead (max_staleness 0) gives exactly the synchronous run.
    train(_cfg(tiny_model_dir, tmp_path / "pre0", reward, prefetch_depth=1, max_staleness=0), progress=False)
    assert _log(tmp_path / "pre0") == _log(tmp_path / "sync")
    assert not _producer_threads()


def test_stale_prefetch_is_bounded_and_corrected(tiny_model_dir, tmp_path):
    from jrl.train.trainer import train

    reward = write_reward_file(tmp_path, "reward_stale")
    hist = train(_cfg(tiny_model_dir, tmp_path / "run", reward, prefetch_depth=1, max_staleness=1, max_steps=4),
                 progress=False)
    assert [r["async/staleness"] for r in hist] == [0, 1, 1, 1]
    assert all(np.isfinite(r["loss"]) and r["time/wait_rollout"] >= 0 and r["time/sync"] > 0 for r in hist)
    diff = [r["sampling/sampling_logp_difference/mean"] for r in hist]
    # Step 0 trains the sampler's own weights: trainer and sampler agree. Later batches come from the
    # previous version, so the sampler log-probs differ from the "old" ones, which are the current policy's
    # (deferred scoring: the PPO ratio is exactly 1 on the single update, the IS ratio carries the lag).
    assert diff[0] < 1e-5 and all(d > 1e-4 for d in diff[1:])
    for r in hist:
        assert r["kl_new_old"] == pytest.approx(0.0, abs=1e-6) and r["ratio_new_old"] == pytest.approx(1.0, abs=1e-6)
    assert any(r["sampling/importance_sampling_ratio/max"] != r["sampling/importance_sampling_ratio/min"]
               for r in hist[1:])
    assert not _producer_threads()


def test_sync_interval_logs_the_served_version(tiny_model_dir, tmp_path):
    from jrl.train.trainer import train

    reward = write_reward_file(tmp_path, "reward_interval")
    hist = train(_cfg(tiny_model_dir, tmp_path / "run", reward, sync_interval=2, max_staleness=1), progress=False)
    # Syncs after steps 2, 4, ...: the engine serves the starting weights (version 0) until then.
    assert [r["sync/version"] for r in hist] == [0, 2, 2]
    assert [r["async/staleness"] for r in hist] == [0, 1, 0]
    assert hist[0]["time/sync"] == 0 and hist[1]["time/sync"] > 0 and hist[2]["time/sync"] == 0


def test_producer_error_stops_training_with_the_cause(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from jrl.models import from_pretrained
    from jrl.rollout.jax_engine import JaxRolloutEngine
    from jrl.train.trainer import Trainer

    class FailsOnThirdBatch(JaxRolloutEngine):
        calls = 0

        def generate(self, *args, **kwargs):
            FailsOnThirdBatch.calls += 1
            if FailsOnThirdBatch.calls == 3:
                raise OSError("sampler device lost")
            return super().generate(*args, **kwargs)

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    engine = FailsOnThirdBatch(from_pretrained(tiny_model_dir, dtype="float32"), pad_id=tokenizer.pad_token_id)
    reward = write_reward_file(tmp_path, "reward_err")
    trainer = Trainer(_cfg(tiny_model_dir, tmp_path / "run", reward, prefetch_depth=1, max_steps=5),
                      engine=engine, progress=False)
    t0 = time.perf_counter()
    with pytest.raises(RolloutProducerError, match="generating batch 2: OSError: sampler device lost") as err:
        trainer.train()
    trainer.close()
    assert "in generate" in str(err.value)  # the producer's traceback
    assert time.perf_counter() - t0 < 120
    # Step 2 made its update, then waited for batch 2 (generated from version 1) before replacing the
    # engine's weights, and got the producer's error there; its metrics line was never written.
    assert trainer.step == 2 and len(_log(tmp_path / "run")) == 1
    assert not _producer_threads()


def test_engine_keeps_its_weights_through_updates_and_close_mid_run_stops_the_producer(tiny_model_dir, tmp_path):
    from train_testlib import random_step_batch

    from jrl.rollout.base import SamplingParams
    from jrl.train.trainer import Trainer

    reward = write_reward_file(tmp_path, "reward_close")
    trainer = Trainer(_cfg(tiny_model_dir, tmp_path / "run", reward, prefetch_depth=2, max_staleness=2,
                           max_steps=50), progress=False)
    trainer.train_step()
    assert _producer_threads()
    # The engine holds version 1 while the trainer goes on updating (and donating) its own buffers.
    trainer.algorithm.update(trainer.learner, random_step_batch(seed=3, n=8))
    out = trainer.engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2), num_generations=2, seed=0)
    assert out.policy_version == 1 and out.completion_ids.shape == (2, 2)
    t0 = time.perf_counter()
    trainer.close()
    assert time.perf_counter() - t0 < 35 and not _producer_threads()


def test_resume_with_prefetch_reproduces_the_uninterrupted_run(tiny_model_dir, tmp_path):
    from jrl.train.trainer import train

    kw = dict(prefetch_depth=1, max_staleness=1, max_steps=4, save_every=2)
    ok = write_reward_file(tmp_path, "reward_ok")
    straight = train(_cfg(tiny_model_dir, tmp_path / "a", ok, **kw), progress=False)
    # Generation never runs ahead across the step-2 checkpoint: batch 2 comes from version 2.
    assert [r["async/staleness"] for r in straight] == [0, 1, 0, 1]
    # The second run dies in step 4's rewards (its producer had already taken later prompts), then resumes.
    crash = write_reward_file(tmp_path, "reward_crash", crash=3)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny_model_dir, tmp_path / "b", crash, scoring=IN_PROCESS, **kw), progress=False)
    assert len(_log(tmp_path / "b")) == 3 and not _producer_threads()
    train(_cfg(tiny_model_dir, tmp_path / "b", ok, resume=True, **kw), progress=False)
    assert [r["step"] for r in _log(tmp_path / "b")] == [1, 2, 3, 4]
    assert _log(tmp_path / "b") == _log(tmp_path / "a")


@pytest.mark.parametrize("rollout_devices, partial", [(0, 0), (1, 0), (1, 1)],
                         ids=["shared", "split", "split-partial"])
def test_two_device_prefetch(tiny_model_dir, tmp_path, rollout_devices, partial):
    """Prefetching on 2 devices: the sampler and the update take turns on both (rollout.devices 0), or each has a
    device of its own and nothing waits for the other (rollout.devices 1: the weights are copied to device 1), also
    with partial rollouts (the sampler's device continues the rows the previous generation left)."""
    reward = write_reward_file(tmp_path, "reward_mesh")
    out = run_worker("async_mesh_worker.py", tiny_model_dir, tmp_path / "run", reward, str(rollout_devices),
                     str(partial))
    assert out["devices"] == 2
    if rollout_devices:
        assert out["device_lock"] == "nullcontext"
        assert (out["learner_devices"], out["sampler_devices"]) == ([0], [1])
    else:
        assert out["device_lock"] == "lock"
        assert out["learner_devices"] == out["sampler_devices"] == [0, 1]
    assert [r["async/staleness"] for r in out["history"]] == [0, 1, 1]
    # On devices of its own the sampler generates while the learner trains, and the trainer makes the next step's
    # batch and experience while the update runs: the same run as without it.
    assert [r["async/experience_ahead"] for r in out["history"]] == ([0, 1, 1] if rollout_devices else [0, 0, 0])
    if rollout_devices:
        plain = run_worker("async_mesh_worker.py", tiny_model_dir, tmp_path / "plain", reward, str(rollout_devices),
                           str(partial), "0")
        assert [r["async/experience_ahead"] for r in plain["history"]] == [0, 0, 0]
        timing = ("tokens_per_second", "async/experience_ahead", "async/queue_depth", "step")  # step: train()'s

        def computed(history):
            return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in timing} for r in history]

        assert computed(plain["history"]) == computed(out["history"])
    if partial:
        assert sum(r["partial/tokens_from_earlier_steps"] for r in out["history"]) > 0
        assert all(r["partial/oldest_token_lag"] <= 2 for r in out["history"])
    assert all(np.isfinite(r["loss"]) and np.isfinite(r["reward/mean"]) for r in out["history"])


def test_stop_during_a_look_ahead_runs_the_prepared_step_first(tiny_model_dir, tmp_path):
    """A sampler on a device of its own: SIGTERM arrives in step 2's rewards, which step 1 scores while its update
    runs; step 2 then runs (its experience is made) before the checkpoint, as the uninterrupted run does, and the
    resumed run finishes. (It does not log what the uninterrupted run does at step 3: that one's batch 3 came from
    version 1 of the weights, run ahead of the trainer; a resumed run's first batch comes from the checkpoint's.)"""
    straight = run_worker("async_mesh_worker.py", tiny_model_dir, tmp_path / "a",
                          write_reward_file(tmp_path, "reward_la"), "1", "0", "stop")
    assert [r["async/experience_ahead"] for r in straight["first"]] == [0, 1, 1]
    stopped = run_worker("async_mesh_worker.py", tiny_model_dir, tmp_path / "b",
                         write_reward_file(tmp_path, "reward_la_term", sigterm=2), "1", "0", "stop")
    assert [r["step"] for r in stopped["first"]] == [1, 2] and stopped["checkpoints"] == [2, 3]
    assert [r["async/experience_ahead"] for r in stopped["first"]] == [0, 1]
    assert [r["step"] for r in stopped["resumed"]] == [1, 2, 3]  # the whole log, the resumed step appended
    assert stopped["resumed"][2]["async/staleness"] == 0 and straight["first"][2]["async/staleness"] == 1
    skip = TIMING + ("async/experience_ahead",)
    assert read_metrics_log(tmp_path / "b", skip)[:2] == read_metrics_log(tmp_path / "a", skip)[:2]
