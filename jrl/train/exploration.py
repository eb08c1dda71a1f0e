"""Explorers and a trainer as separate processes, coupled by an experience queue and published weights
(Trinity-RFT's asynchronous mode; ``mode='explore'`` / ``mode='train'``, docs/exploration.md).

- An **explorer** (:class:`Explorer`, ``jrl explore --config FILE``) loads the policy, takes the newest weights the
  trainer published (:mod:`jrl.explore.publication`), samples and scores batches of prompts with the algorithm's
  ``explorer`` part (GRPO's :class:`~jrl.train.algorithms.grpo.GroupSampler`) and puts each batch's groups in the
  queue in one transaction (:mod:`jrl.explore.queue`). It waits while the queue holds
  ``explore.max_queued`` untrained groups, picks up a newer version before each batch, and exits when the trainer
  marks the run finished (or on SIGTERM, after its batch). Explorers can be started and stopped at any time.
- The **trainer** (``mode='train'``) reads its steps from a :class:`QueueSource` in place of the
  :class:`~jrl.sources.rollout.RolloutSource`: ``data.prompts_per_batch`` whole groups per step, of policy
  versions within ``rollout.max_staleness`` of its own (older and newer ones are marked stale), and publishes its
  weights after every ``rollout.sync_interval`` steps. A restarted trainer hands the groups of steps after its
  checkpoint back to the queue and withdraws the versions it published after it, so each group is trained on once.

Each explorer writes ``<output_dir>/explorers/<name>/metrics.jsonl`` (per batch: version, lag behind the newest
published version, throughput, rewards); the trainer logs per step how many groups each explorer gave and their
staleness (``explore/<name>/groups``, ``explore/<name>/staleness``) and records the ids of the groups it trained on
in ``experience.jsonl``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import time
import zlib
from pathlib import Path

import numpy as np

from jrl.data.pipeline import PromptLoader, build_prompt_dataset
from jrl.rollout.base import RolloutBatch, concat_rollouts
from jrl.train import compile_cache
from jrl.train.algorithms import ALGORITHMS
from jrl.sources.scored import ScoredRollout, rollout_metrics
from jrl.sources.prefetch import ProducedRollout
from jrl.explore.queue import ExperienceGroup, open_queue
from jrl.train.observability import MetricsWriter, truncate_jsonl_after
from jrl.train.policy_loading import load_policy
from jrl.train.preemption import stop_requests
from jrl.train.watchdog import StepWatchdog
from jrl.explore.publication import (
    WeightPublisher,
    finished_version,
    load_weights,
    published_versions,
    read_meta,
    read_weights,
)
from jrl.sources.rollout import make_rollout_engine, step_seed

logger = logging.getLogger(__name__)

#: Seconds between looks at the queue or the weights directory while waiting on the other side.
POLL_SECONDS = 0.1
#: The trainer's record of the groups each step trained on (under output_dir).
EXPERIENCE_LOG = "experience.jsonl"


def experience_groups(scored: ScoredRollout, prompt_indices: list[int], *, group_size: int,
                      explorer: str) -> list[ExperienceGroup]:
    """The queue's groups of a scored rollout (rows ``p*G .. p*G+G-1`` are prompt ``p``'s)."""
    r, g = scored.rollout, group_size
    prompts = r.prompt_lists()
    return [ExperienceGroup(
        prompt_ids=np.asarray(prompts[p * g], np.int32), completion_ids=np.asarray(r.completion_ids[p * g:(p + 1) * g]),
        completion_mask=np.asarray(r.completion_mask[p * g:(p + 1) * g]),
        sampling_logprobs=np.asarray(r.sampling_logprobs[p * g:(p + 1) * g], np.float32),
        truncated=np.asarray(r.truncated[p * g:(p + 1) * g], bool), rewards=scored.rewards[p * g:(p + 1) * g],
        policy_version=r.policy_version, explorer=explorer, prompt_index=int(index), reward_names=scored.reward_names,
        loss_mask=None if r.loss_mask is None else np.asarray(r.loss_mask[p * g:(p + 1) * g]))
        for p, index in enumerate(prompt_indices)]


def scored_rollout(groups: list[ExperienceGroup], *, pad_id: int, group_size: int,
                   num_rewards: int) -> ScoredRollout:
    """One step's :class:`ScoredRollout` of queue groups (prompts left-padded, completions right-padded to the
    longest; tagged with the oldest policy version among them), after checking they fit this trainer's config."""
    for grp in groups:
        g, cols = grp.completion_ids.shape[0], grp.rewards.shape[1]
        if g != group_size or cols != num_rewards or grp.reward_names != groups[0].reward_names:
            raise ValueError(f"explorer {grp.explorer!r} wrote a group of {g} completions scored by "
                             f"{list(grp.reward_names)}; this trainer takes groups of {group_size} completions and "
                             f"{num_rewards} reward functions {list(groups[0].reward_names)}: start explorers and "
                             "trainer with the same config")
    prompts = [np.repeat(grp.prompt_ids[None], group_size, 0) for grp in groups]
    parts = [RolloutBatch(prompt_ids=ids, prompt_mask=np.ones_like(ids),
                          completion_ids=grp.completion_ids, completion_mask=grp.completion_mask,
                          sampling_logprobs=grp.sampling_logprobs, truncated=grp.truncated,
                          policy_version=grp.policy_version, loss_mask=grp.loss_mask)
             for grp, ids in zip(groups, prompts)]
    rollout = concat_rollouts(parts, pad_id, policy_version=min(grp.policy_version for grp in groups))
    return ScoredRollout(rollout, np.concatenate([grp.rewards for grp in groups]).astype(np.float32),
                         groups[0].reward_names)


def explorer_metrics(groups: list[ExperienceGroup], step: int) -> dict[str, float]:
    """Per explorer: groups in the step and their mean staleness (``step`` minus the version that generated them)."""
    out: dict[str, float] = {}
    for name in sorted({g.explorer for g in groups}):
        mine = [g for g in groups if g.explorer == name]
        out[f"explore/{name}/groups"] = float(len(mine))
        out[f"explore/{name}/staleness"] = float(np.mean([step - g.policy_version for g in mine]))
    return out


class QueueSource:
    """The trainer's rollouts with ``mode='train'``: scored groups from the experience queue, and its weights
    published for the explorers. It offers what the trainer asks of a
    :class:`~jrl.sources.rollout.RolloutSource` (``next``, ``consumed``, ``sync_after_step``,
    ``restored``...)."""

    def __init__(self, cfg, *, loader, learner, pad_id: int, output_dir: Path):
        self.cfg, self.loader, self.learner, self.pad_id = cfg, loader, learner, pad_id
        self.url = cfg.explore.queue_url(output_dir)
        self.queue = open_queue(self.url)
        self.publisher = WeightPublisher(cfg.explore.weights_path(output_dir), keep=cfg.explore.keep_versions)
        self.log_path = Path(output_dir) / EXPERIENCE_LOG
        self.schedule = None  # no engine to schedule syncs of
        self.device_lock = contextlib.nullcontext()
        self.generates_apart = False  # the next batch is taken when the step that needs it starts
        self.published: int | None = None
        self._group_ids: dict[int, list[int]] = {}  # step index -> queue ids of its groups, until consumed

    @property
    def engine(self):
        raise RuntimeError("mode='train' has no rollout engine: the explorers sample (mode='explore')")

    def start(self, step: int) -> None:
        """A fresh run: the queue must hold no earlier run's training, and version ``step`` is published."""
        consumed = self.queue.counts().consumed
        if consumed:
            raise RuntimeError(f"experience queue {self.url} holds {consumed} groups an earlier run trained on; "
                               "pass --resume to continue that run, or give this one a new queue (delete the file, "
                               "or --explore.queue URL?table=NEW_NAME)")
        self.publisher.reset()
        self.publish(step)

    def publish(self, version: int) -> None:
        self.publisher.publish(self.learner.params, version, lora=self.learner.lora)
        self.published = version

    def next(self, index: int) -> tuple[ProducedRollout, float, int]:
        """Step ``index``'s groups: (the batch, seconds waited for it, groups still available after it)."""
        if self.published is None:
            self.start(index)
        cfg = self.cfg
        t0 = time.perf_counter()
        groups = self.queue.take(cfg.data.prompts_per_batch, step=index + 1,
                                 min_version=max(0, index - cfg.rollout.max_staleness), max_version=index,
                                 timeout=cfg.explore.timeout_s)
        waited = time.perf_counter() - t0
        scored = scored_rollout(groups, pad_id=self.pad_id, group_size=cfg.samples_per_prompt,
                                num_rewards=len(cfg.reward_weights))
        counts = self.queue.counts()
        metrics = {**explorer_metrics(groups, index), "queue/stale": float(counts.stale),
                   "async/staleness_mean": float(np.mean([index - g.policy_version for g in groups]))}
        self._group_ids[index] = [g.group_id for g in groups]
        return ProducedRollout(index, None, scored, self.loader.get_state(), waited, metrics), waited, counts.available

    def consumed(self, item: ProducedRollout) -> None:
        """The trainer trained on ``item``: record its groups (one flushed line per step)."""
        with self.log_path.open("a") as f:
            f.write(json.dumps({"step": item.index + 1, "groups": self._group_ids.pop(item.index)}) + "\n")

    def sync_after_step(self, version: int) -> tuple[float, float]:
        """Publish the weights after sync steps and the last one."""
        if version % self.cfg.rollout.sync_interval and version != self.cfg.max_steps:
            return 0.0, 0.0
        t0 = time.perf_counter()
        self.publish(version)
        return 0.0, time.perf_counter() - t0

    def finish(self, version: int) -> None:
        """The run is done and checkpointed at ``version``: explorers may exit."""
        self.publisher.finish(version)

    def served_version(self) -> int:
        return -1 if self.published is None else self.published

    def checkpoint_data_state(self) -> dict:
        return self.loader.get_state()

    def restored(self, data_state: dict, step: int) -> None:
        """A checkpoint put the learner at ``step``: the groups of later steps go back to the queue, the versions
        published after it are withdrawn, and ``step`` is published."""
        again = self.queue.rollback_after(step)
        truncate_jsonl_after(self.log_path, step)
        self.publisher.withdraw_after(step)
        self.publish(step)
        logger.info("resumed at step %d: %d group(s) trained on after it are back in the queue", step, again)

    def stop(self) -> None:
        pass

    def close(self) -> None:
        self.queue.close()


def explorer_seed(seed: int, name: str) -> int:
    """The seed of an explorer's prompt order and sampling: the run's seed and the explorer's name."""
    return int(np.random.SeedSequence([seed, zlib.crc32(name.encode())]).generate_state(1)[0])


class Explorer:
    """Sample and score prompt batches with the newest published weights and put them in the queue (module
    docstring); :meth:`run` until the trainer finishes."""

    def __init__(self, cfg):
        import jax

        if jax.process_count() > 1:
            raise ValueError("an explorer is one process (start several explorers instead of one multi-process one)")
        self.cfg = cfg
        compile_cache.enable(cfg.compile_cache_dir)
        self.name = cfg.explore.explorer_name()
        out = Path(cfg.output_dir)
        self.root = cfg.explore.weights_path(out)
        self.seed = explorer_seed(cfg.seed, self.name)
        policy = load_policy(cfg)
        self.model = policy.model
        self.sampler = ALGORITHMS.get(cfg.algorithm).explorer(cfg, policy)
        data = dataclasses.replace(cfg.data, seed=self.seed % 2**31)
        self.loader = PromptLoader(build_prompt_dataset(data, policy.tokenizer), data)
        self.log_dir = out / "explorers" / self.name
        self._make_engine = lambda: make_rollout_engine(cfg.rollout, self.model, pad_id=policy.pad_id,
                                                        mesh=policy.rollout_mesh, rules=policy.rollout_rules,
                                                        output_dir=self.log_dir)
        # The engine (which may write its sync files under output_dir) and the queue are made once the trainer has
        # published: nothing is written before the trainer has claimed output_dir.
        self._engine = None
        self.queue = None
        self.limit = cfg.explore.queue_limit(cfg.data.prompts_per_batch)
        self.version: int | None = None
        self.run_id: str | None = None  # the run id of the versions this explorer loads
        self._synced_at = time.monotonic()  # when the engine last got a new version

    @property
    def engine(self):
        if self._engine is None:
            self._engine = self._make_engine()
        return self._engine

    def _newest(self) -> int | None:
        versions = published_versions(self.root)
        return versions[-1] if versions else None

    def pick_up(self) -> bool:
        """Sync the engine to the newest published version when it holds another; whether it did."""
        while True:
            newest = self._newest()
            if newest is None or newest == self.version:
                return False
            try:
                run, tensors = read_meta(self.root, newest)["run"], read_weights(self.root, newest)
            except FileNotFoundError:  # deleted between listing and reading: a newer one is there
                continue
            if self.run_id not in (None, run):
                raise RuntimeError(f"explorer {self.name}: a trainer started a new run in {self.root} (its weights "
                                   "are not those of the run this explorer joined); start the explorer again")
            self.run_id = run
            model = load_weights(self.model, tensors, where=f"{self.root} (version {newest})")
            self.engine.sync_weights(model, newest)
            self.version, self._synced_at = newest, time.monotonic()
            return True

    def _wait_first_weights(self) -> None:
        deadline = time.monotonic() + self.cfg.explore.timeout_s
        logger.info("explorer %s: waiting for the trainer's weights in %s", self.name, self.root)
        while not self.pick_up():
            if time.monotonic() > deadline:
                raise TimeoutError(f"explorer {self.name}: no weights were published in {self.root} within "
                                   f"{self.cfg.explore.timeout_s:.0f} s; start the trainer (mode='train') with the "
                                   "same config, or point explore.weights_dir at its directory")
            time.sleep(POLL_SECONDS)

    def _room(self) -> bool:
        """Whether the queue holds fewer untrained groups than ``explore.max_queued``; an error when it has been
        full for ``explore.timeout_s`` without a new version (the trainer is gone)."""
        if self.queue.counts().available < self.limit:
            return True
        if not self.pick_up() and time.monotonic() - self._synced_at > self.cfg.explore.timeout_s:
            raise TimeoutError(f"explorer {self.name}: the queue has held {self.limit} untrained groups and no new "
                               f"weights appeared in {self.root} for {self.cfg.explore.timeout_s:.0f} s; is the "
                               "trainer running? (restart it with --resume)")
        return False

    def explore_batch(self, batch: int, writer: MetricsWriter) -> None:
        """Sample, score and write one prompt batch (sampling seed of ``batch``); log its metrics."""
        prompt_batch = next(self.loader)
        t0 = time.perf_counter()
        rollout = self.sampler.generate(self.engine, prompt_batch, step=batch,
                                       seed=step_seed(self.seed, batch))
        t1 = time.perf_counter()
        scored = self.sampler.score(rollout, prompt_batch, batch)
        t2 = time.perf_counter()
        g = self.cfg.samples_per_prompt
        self.queue.put(experience_groups(scored, prompt_batch.indices, group_size=g, explorer=self.name))
        t3 = time.perf_counter()
        tokens = float(np.asarray(scored.rollout.completion_mask).sum())
        metrics = rollout_metrics(scored.rollout, scored.rewards, group_size=g,
                                  reward_weights=self.cfg.reward_weights, reward_names=scored.reward_names)
        newest = self._newest()
        metrics.update({"explorer/version": float(self.version),
                        "explorer/lag": float((newest if newest is not None else self.version) - self.version),
                        "explorer/groups": float(len(prompt_batch)), "tokens_per_second": tokens / max(t3 - t0, 1e-9),
                        "time/generate": t1 - t0, "time/score": t2 - t1, "time/put": t3 - t2, **scored.failures})
        writer.write(batch, metrics)
        if (batch + 1) % self.cfg.log_every == 0:
            logger.info("explorer %s: batch %d from version %d, reward %.4f, %.0f tokens/s", self.name, batch + 1,
                        self.version, metrics["reward/mean"], metrics["tokens_per_second"])

    def run(self) -> int:
        """Explore until the trainer marks the run finished, ``explore.max_batches`` are written or a stop signal
        arrives; returns the batches written."""
        self._wait_first_weights()
        self.queue = open_queue(self.cfg.explore.queue_url(self.cfg.output_dir))
        writer = MetricsWriter(self.log_dir, tensorboard=False)
        # A restarted explorer goes on after the batches the queue holds from it (each put is one whole batch; a
        # kill between the put and the metrics line must not sample that batch's prompts and seed again).
        batch = self.queue.written_by(self.name) // self.cfg.data.prompts_per_batch
        for _ in range(batch):
            next(self.loader)
        first, budget = batch, self.cfg.explore.max_batches
        watchdog = StepWatchdog(self.cfg.step_timeout_s)
        try:
            logger.info("explorer %s: exploring from version %d (queue %s)", self.name, self.version,
                        self.cfg.explore.queue_url(self.cfg.output_dir))
            with stop_requests() as stop:
                while (stop.signal is None and finished_version(self.root) is None
                       and (budget is None or batch - first < budget)):
                    if not self._room():
                        time.sleep(POLL_SECONDS)
                        continue
                    self.pick_up()
                    with watchdog.step(f"explorer {self.name}'s batch {batch + 1}"):
                        self.explore_batch(batch, writer)
                    batch += 1
        finally:
            watchdog.close()
            writer.close()
        why = ("the trainer finished" if finished_version(self.root) is not None
               else "explore.max_batches reached" if batch - first == budget else "stopped")
        logger.info("explorer %s: %d batch(es) written; %s", self.name, batch - first, why)
        return batch - first

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()
        self.sampler.close()
        if self.queue is not None:
            self.queue.close()


def explore(cfg) -> int:
    """Build the :class:`Explorer` of ``cfg`` and run it; the batches it wrote."""
    explorer = Explorer(cfg)
    try:
        return explorer.run()
    finally:
        explorer.close()
