"""Explorer and trainer processes (``mode='explore'`` / ``mode='train'``): groups survive the queue as the trainer
needs them, published weights load back into an explorer's model, configs that cannot work are refused, and — with
real processes — a trainer fed by explorers that are killed, join and restart, and is itself killed with SIGKILL and
resumed, trains on every group it took exactly once."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import child_processes
import jax
import numpy as np
import pytest

from train_testlib import tiny_model

from jrl.models.lora import LoraConfig, apply_lora
from jrl.rollout.base import RolloutBatch
from jrl.train.algorithms.grpo import ScoredRollout
from jrl.train.config import TrainConfig
from jrl.explore.queue import open_queue
from jrl.explore.config import ExploreConfig
from jrl.train.exploration import experience_groups, scored_rollout
from jrl.explore.publication import (
    WeightPublisher,
    finished_version,
    load_weights,
    published_versions,
    read_weights,
    trainable,
)
from jrl.sources.rollout import RolloutConfig

REPO = Path(__file__).resolve().parents[2]
PAD = 0


def _scored(rng: np.random.Generator, prompts: int, g: int, version: int) -> ScoredRollout:
    """A scored rollout of ``prompts`` x ``g`` rows, prompts of different lengths (left-padded)."""
    lengths = rng.integers(1, 6, prompts)
    lp, t = int(lengths.max()), int(rng.integers(3, 8))
    p_mask = np.repeat((np.arange(lp)[None] >= lp - lengths[:, None]).astype(np.int32), g, 0)
    p_ids = np.where(p_mask > 0, rng.integers(1, 300, (prompts * g, lp)), PAD).astype(np.int32)
    for p in range(prompts):  # one prompt per group
        p_ids[p * g:(p + 1) * g] = p_ids[p * g]
    c_len = rng.integers(1, t + 1, prompts * g)
    c_mask = (np.arange(t)[None] < c_len[:, None]).astype(np.int32)
    rollout = RolloutBatch(
        prompt_ids=p_ids, prompt_mask=p_mask,
        completion_ids=np.where(c_mask > 0, rng.integers(1, 300, (prompts * g, t)), PAD).astype(np.int32),
        completion_mask=c_mask, sampling_logprobs=np.where(c_mask > 0, -rng.random((prompts * g, t)), np.nan
                                                           ).astype(np.float32),
        truncated=c_len == t, policy_version=version)
    return ScoredRollout(rollout, rng.random((prompts * g, 2)).astype(np.float32), ("right", "short"))


def test_groups_through_the_queue_rebuild_the_scored_rollout(tmp_path):
    rng = np.random.default_rng(0)
    queue = open_queue(f"sqlite:///{tmp_path}/queue.db")
    first, second = _scored(rng, 3, 4, version=2), _scored(rng, 2, 4, version=1)
    queue.put(experience_groups(first, [10, 11, 12], group_size=4, explorer="a"))
    queue.put(experience_groups(second, [20, 21], group_size=4, explorer="b"))
    groups = queue.take(5, step=1)
    assert [g.prompt_index for g in groups] == [10, 11, 12, 20, 21]
    got = scored_rollout(groups, pad_id=PAD, group_size=4, num_rewards=2)
    assert got.rollout.policy_version == 1 and got.reward_names == ("right", "short")
    want_prompts = first.rollout.prompt_lists() + second.rollout.prompt_lists()
    assert got.rollout.prompt_lists() == want_prompts
    for k in ("completion_ids", "completion_mask", "sampling_logprobs"):
        a, b = getattr(first.rollout, k), getattr(second.rollout, k)
        t = got.rollout.completion_ids.shape[1]
        fill = np.nan if k == "sampling_logprobs" else 0
        want = np.concatenate([np.pad(x.astype(float), ((0, 0), (0, t - x.shape[1])), constant_values=fill)
                               for x in (a, b)])
        np.testing.assert_array_equal(got.rollout.__dict__[k].astype(float), want)
    np.testing.assert_array_equal(got.rollout.truncated, np.concatenate([first.rollout.truncated,
                                                                         second.rollout.truncated]))
    np.testing.assert_array_equal(got.rewards, np.concatenate([first.rewards, second.rewards]))
    with pytest.raises(ValueError, match=r"explorer 'a' wrote a group of 4 completions.*groups of 8 completions"):
        scored_rollout(groups, pad_id=PAD, group_size=8, num_rewards=2)


def test_episode_groups_keep_their_loss_mask_through_the_queue(tmp_path):
    """Multi-turn episodes put the environment's tokens in the completion with loss mask 0: the queue keeps the loss
    mask (groups written without one still read back as None: their completion mask is their loss mask)."""
    rng = np.random.default_rng(3)
    queue = open_queue(f"sqlite:///{tmp_path}/queue.db")
    episodes, single = _scored(rng, 2, 3, version=1), _scored(rng, 1, 3, version=1)
    mask = episodes.rollout.completion_mask
    loss = (mask * (rng.random(mask.shape) < 0.6)).astype(np.int32)
    episodes = ScoredRollout(dataclasses.replace(episodes.rollout, loss_mask=loss), episodes.rewards,
                             episodes.reward_names)
    queue.put(experience_groups(episodes, [1, 2], group_size=3, explorer="e"))
    queue.put(experience_groups(single, [3], group_size=3, explorer="s"))
    groups = queue.take(3, step=1)
    assert groups[2].loss_mask is None
    np.testing.assert_array_equal(np.concatenate([g.loss_mask for g in groups[:2]]), loss)
    got = scored_rollout(groups, pad_id=PAD, group_size=3, num_rewards=2).rollout
    t = got.completion_ids.shape[1]
    plain = single.rollout.completion_mask
    want = np.concatenate([np.pad(loss, ((0, 0), (0, t - loss.shape[1]))), np.pad(plain, ((0, 0), (0, t - plain.shape[1])))])
    np.testing.assert_array_equal(got.loss_mask, want)


def test_published_weights_load_into_a_fresh_model_and_old_versions_go(tmp_path):
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"))
    trained, fresh = tiny_model(seed=0), tiny_model(seed=0)
    apply_lora(trained, lora, seed=1)
    apply_lora(fresh, lora, seed=2)
    _, params, _ = trainable(trained)
    params = jax.tree.map(lambda x: x + 0.5, params)  # as if trained: B is no longer zero
    root = tmp_path / "published"
    publisher = WeightPublisher(root, keep=2)
    for version in (0, 3, 6):
        publisher.publish(params, version, lora=True)
    assert published_versions(root) == [3, 6] and finished_version(root) is None
    before = jax.tree.leaves(trainable(fresh)[1])
    loaded = jax.tree.leaves(trainable(load_weights(fresh, read_weights(root, 6), where="test"))[1])
    assert len(loaded) == 4  # A and B of q_proj and v_proj, stacked over the layers
    for a, b, old in zip(jax.tree.leaves(params), loaded, before, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert not np.array_equal(np.asarray(a), np.asarray(old))
    publisher.withdraw_after(3)
    assert published_versions(root) == [3]
    publisher.finish(3)
    assert finished_version(root) == 3
    publisher.publish(params, 4, lora=True)  # a resumed run goes on: no longer finished
    assert finished_version(root) is None
    with pytest.raises(ValueError, match=r"do not fit this model.*trainer.s config"):
        load_weights(tiny_model(seed=0), read_weights(root, 4), where="test")


def test_configs_that_cannot_split_are_refused():
    with pytest.raises(ValueError, match=r"explore=.*mode='both' does not use it.*set mode='train'"):
        TrainConfig(explore=ExploreConfig(name="a"))
    with pytest.raises(ValueError, match=r"mode='train'.*algorithm='ebft_strided' runs in one process only"):
        TrainConfig(mode="train", algorithm="ebft_strided")
    with pytest.raises(ValueError, match=r"prefetch_depth=1.*already overlaps generation and training"):
        TrainConfig(mode="train", rollout=RolloutConfig(prefetch_depth=1))
    with pytest.raises(ValueError, match=r"eval_every=5.*no sampler to evaluate with"):
        TrainConfig(mode="train", eval_every=5)
    with pytest.raises(ValueError, match=r"name='a b'.*letters, digits"):
        ExploreConfig(name="a b")


# ---------------------------------------------------------------------------------------------------- processes

STEPS, PROMPTS, SAVE_EVERY = 8, 2, 2


def _args(model_dir: Path, out: Path) -> list[str]:
    return ["--config", str(REPO / "configs" / "grpo.py"), "--model.path", str(model_dir), "--output-dir", str(out),
            "--max-steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--data.prompts-per-batch", str(PROMPTS),
            "--algo.num-generations", "4", "--optim.micro-batch-size", "8", "--rollout.max-new-tokens", "8",
            "--rollout.max-staleness", "100", "--scoring.num-workers", "0", "--log-every", "1",
            "--explore.max-queued", "2", "--explore.timeout-s", "120"]


class Processes:
    """The run's processes, each logging to a file; :meth:`wait_for` polls the run's files while checking that
    none has died."""

    def __init__(self, tmp_path: Path, model_dir: Path):
        self.tmp, self.out, self.model_dir = tmp_path, tmp_path / "run", model_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.env = child_processes.worker_env(1)

    def start(self, name: str, *extra: str) -> None:
        script = "train.py" if name.startswith("trainer") else "explore.py"
        log = open(self.tmp / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen([sys.executable, str(REPO / "scripts" / script),
                                             *_args(self.model_dir, self.out), *extra], cwd=REPO, env=self.env,
                                            stdout=log, stderr=subprocess.STDOUT)

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def wait_for(self, what: str, ready, timeout: float = 120, alive: tuple[str, ...] = ("trainer",)) -> None:
        """Poll ``ready()``; fail when a process failed, one of ``alive`` exited, or after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while not ready():
            for name, p in self.procs.items():
                if p.poll() not in (None, 0, -signal.SIGKILL) or (name in alive and p.poll() is not None):
                    raise AssertionError(f"{name} exited {p.returncode} while waiting for {what}:\n"
                                         f"{self.log(name)[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s; logs:\n" + "\n".join(
                    f"--- {n}\n{self.log(n)[-1500:]}" for n in self.procs))
            time.sleep(0.2)

    def finish(self, name: str, timeout: float = 300) -> None:
        self.procs[name].wait(timeout=timeout)
        assert self.procs[name].returncode == 0, f"{name}:\n{self.log(name)[-4000:]}"

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def _steps_logged(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _resumed(log: str) -> int | None:
    """The step a trainer's log says it resumed at."""
    found = re.search(r"resumed at step (\d+): \d+ group", log)
    return int(found.group(1)) if found else None


def _trained_explorers(out: Path) -> set[str]:
    """The explorers of the groups in the trainer's ``experience.jsonl``."""
    path = out / "experience.jsonl"
    ids = [i for line in path.read_text().splitlines() for i in json.loads(line)["groups"]] if path.exists() else []
    with sqlite3.connect(out / "experience.db") as db:
        names = dict(db.execute("SELECT id, explorer FROM jrl_experience").fetchall())
    return {names[i] for i in ids}


def _written(out: Path, explorer: str) -> int:
    with sqlite3.connect(out / "experience.db") as db:
        return db.execute("SELECT COUNT(*) FROM jrl_experience WHERE explorer = ?", (explorer,)).fetchone()[0]


def test_explorers_killed_joining_and_a_killed_trainer_train_on_each_group_once(tiny_model_dir, tmp_path):
    run = Processes(tmp_path, tiny_model_dir)
    out = run.out
    try:
        run.start("trainer", "--mode", "train")
        # a and b write at most 5 batches = 5 steps of the 8: the trainer cannot finish without c.
        run.start("a", "--explore.name", "a", "--explore.max-batches", "3")
        run.start("b", "--explore.name", "b", "--explore.max-batches", "2")
        run.wait_for("step 1", lambda: _steps_logged(out) >= 1)
        run.kill("a")  # wherever it is: sampling, scoring, writing, waiting for room, or done
        run.wait_for("step 3", lambda: _steps_logged(out) >= 3)
        run.kill("trainer")  # in a step after 3, waiting for groups, or writing the checkpoint of step 4
        run.start("trainer2", "--mode", "train", "--resume")
        run.start("c", "--explore.name", "c")  # joins mid-run
        run.wait_for("a group of c trained on", lambda: "c" in _trained_explorers(out), alive=("trainer2", "c"))
        run.start("a2", "--explore.name", "a")  # a restarted
        run.finish("trainer2")
        for name in ("c", "a2"):
            run.finish(name, timeout=120)  # they see the run finished and exit
    finally:
        run.close()

    assert _resumed(run.log("trainer2")) in (2, 4)
    steps = [json.loads(x) for x in (out / "experience.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    trained = [i for s in steps for i in s["groups"]]
    assert len(trained) == STEPS * PROMPTS and len(set(trained)) == len(trained)  # no group twice
    with sqlite3.connect(out / "experience.db") as db:
        rows = db.execute("SELECT id, explorer, consumed_step FROM jrl_experience").fetchall()
    consumed = {i: step for i, _, step in rows if step is not None}
    assert consumed == {i: s["step"] for s in steps for i in s["groups"]}  # the queue agrees with the log
    by_explorer = {i: name for i, name, _ in rows}
    assert {by_explorer[i] for s in steps[:2] for i in s["groups"]} <= {"a", "b"}
    for name in ("a", "b", "c"):
        assert _written(out, name) % PROMPTS == 0  # whole batches only, also from the explorers killed
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert all(m["async/staleness"] >= 0 for m in metrics)
    assert all(sum(v for k, v in m.items() if k.startswith("explore/") and k.endswith("/groups")) == PROMPTS
               for m in metrics)
    assert finished_version(out / "published") == STEPS
    c_log = [json.loads(x) for x in (out / "explorers" / "c" / "metrics.jsonl").read_text().splitlines()]
    assert c_log and all(0 <= m["explorer/version"] <= STEPS and m["tokens_per_second"] > 0 for m in c_log)
    a_log = out / "explorers" / "a" / "metrics.jsonl"  # absent when a was killed and a2 stopped before a batch
    a_batches = [json.loads(x)["step"] for x in a_log.read_text().splitlines()] if a_log.exists() else []
    # the restarted a numbered its batches on after those in the queue: no batch index (prompts, seed) twice
    assert a_batches == sorted(set(a_batches)) and set(a_batches) <= set(range(_written(out, "a") // PROMPTS))


def test_an_explorer_follows_withdrawn_versions_and_stops_for_a_new_run(tiny_model_dir, tmp_path):
    from jrl.data.pipeline import DataConfig
    from jrl.losses import GRPOConfig
    from jrl.train.config import ModelSpec, ScoringConfig
    from jrl.train.exploration import Explorer
    from jrl.train.policy_loading import load_policy

    cfg = TrainConfig(mode="explore", model=ModelSpec(path=str(tiny_model_dir)), output_dir=str(tmp_path),
                      data=DataConfig(prompts_per_batch=2, max_prompt_length=64), algo=GRPOConfig(num_generations=2),
                      scoring=ScoringConfig(num_workers=0), explore=ExploreConfig(name="t", timeout_s=5.0))
    explorer = Explorer(cfg)
    try:
        _, params, _ = trainable(load_policy(cfg).model)
        publisher = WeightPublisher(tmp_path / "published", keep=3)
        publisher.reset()
        for version in (0, 1, 2):
            publisher.publish(jax.tree.map(lambda x, v=version: x + v, params), version, lora=False)
        assert explorer.pick_up() and explorer.version == 2 and not explorer.pick_up()
        publisher.withdraw_after(1)  # a trainer resumed from its checkpoint of step 1
        assert explorer.pick_up() and explorer.version == 1
        publisher.reset()  # a trainer started afresh in the same directory
        publisher.publish(params, 0, lora=False)
        with pytest.raises(RuntimeError, match=r"explorer t: a trainer started a new run"):
            explorer.pick_up()
    finally:
        explorer.close()
