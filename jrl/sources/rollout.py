"""Where the trainer's rollouts come from: a rollout engine (``rollout.backend``, from
:data:`jrl.rollout.ROLLOUT_ENGINES`) fed with prompt batches, the schedule of its weight syncs, and — with
``rollout.prefetch_depth > 0`` — the background producer that generates later batches while the trainer
trains (docs/architecture.md).

How weights travel is the engine's transport (``rollout.sync``, :mod:`jrl.rollout.weight_sync`); when
they travel is fixed here by :class:`~jrl.sources.prefetch.RolloutSchedule` (``sync_interval``,
``max_staleness``, checkpoints), so runs and resumes are reproducible. The engine is given a copy of the
trainable weights at each sync when it may still generate from them after the learner's next update
(when prefetching, or syncing less than every step), because that update donates the learner's buffers.

An engine that runs on the trainer's own devices (the embedded sampler: ``shares_trainer_devices``) on a
multi-device mesh takes turns with the update (one lock, :attr:`RolloutSource.device_lock`), since two
threads launching programs with collectives on the same devices can enqueue them in different orders on
different devices and deadlock; there the overlap is of host work (rewards, data, logging), and on one
device it is full.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flax import nnx

from jrl.data.pipeline import PromptBatch
from jrl.rollout import ROLLOUT_ENGINES, RolloutEngine
from jrl.rollout.base import step_seed
from jrl.rollout.config import RolloutConfig
from jrl.sources.prefetch import ProducedRollout, RolloutProducer, RolloutSchedule

logger = logging.getLogger(__name__)


def make_rollout_engine(rollout: RolloutConfig, model, *, pad_id: int, mesh=None, rules=None,
                        output_dir: str | Path = ".") -> RolloutEngine:
    """The engine registered as ``rollout.backend``, built for ``model``."""
    return ROLLOUT_ENGINES.get(rollout.backend)(model, pad_id=pad_id, mesh=mesh, rules=rules, rollout=rollout,
                                                output_dir=Path(output_dir))


class RolloutSource:
    """Rollout batches for the trainer's steps, and the weight syncs that keep the engine on policy.

    ``generate(engine, prompt_batch, seed=...)`` is the algorithm's sampling call; ``learner`` supplies the
    weights to sync; ``make_engine()`` builds the engine on first use (in the trainer's thread) unless an
    ``engine`` is passed in (then the caller closes it). ``rerolled(k)``, when given, names the dataset indices of
    prompts batch ``k`` samples in place of its last loader prompts (:mod:`jrl.sources.reroll`).
    """

    def __init__(self, rollout: RolloutConfig, *, loader, generate: Callable[..., Any], learner,
                 make_engine: Callable[[], RolloutEngine], seed: int, max_steps: int, checkpoint_every: int,
                 multi_device: bool, engine: RolloutEngine | None = None,
                 rerolled: Callable[[int], list[int]] | None = None):
        self.cfg, self.loader, self._generate, self.learner = rollout, loader, generate, learner
        self._rerolled = rerolled
        self._make_engine, self.seed, self.max_steps = make_engine, seed, max_steps
        self.checkpoint_every, self.multi_device = checkpoint_every, multi_device
        self._engine, self._owns_engine = engine, engine is None
        self.data_state = loader.get_state()  # loader state after the last consumed batch
        self._loader_ahead = False  # the producer has taken prompts of batches not consumed yet
        self.schedule: RolloutSchedule | None = None  # set when the rollouts start (first step)
        self._producer: RolloutProducer | None = None
        self.synced_version: int | None = None
        self.device_lock: contextlib.AbstractContextManager = contextlib.nullcontext()

    @property
    def engine(self) -> RolloutEngine:
        if self._engine is None:
            self._engine = self._make_engine()
        return self._engine

    @property
    def _engine_outlives_update(self) -> bool:
        """Whether the engine may generate from the weights of a sync after the learner's next update."""
        return self.cfg.prefetch_depth > 0 or self.cfg.sync_interval > 1

    @property
    def generates_apart(self) -> bool:
        """Whether generation runs in the producer thread on devices (or servers) the learner does not use, so the
        trainer may launch an update and take the next batch while it runs."""
        return self._producer is not None and not self.engine.shares_trainer_devices

    def produce(self, index: int) -> ProducedRollout:
        """Rollout batch ``index``: the loader's next prompt batch (its last prompts replaced by re-rolled ones; with
        ``rollout.partial`` the first step takes two batches), sampled with the seed of step ``index`` (in the
        producer thread when prefetching)."""
        prompt_batch = next(self.loader)
        if self.cfg.partial and index == 0:  # a second batch in flight from the start (jrl.sources.partial)
            prompt_batch = PromptBatch.join([prompt_batch, next(self.loader)])
        data_state = self.loader.get_state()
        again = self._rerolled(index) if self._rerolled is not None else []
        if again:
            prompt_batch = prompt_batch.with_last(self.loader.dataset.batch(again))
        with self.device_lock:
            t0 = time.perf_counter()
            rollout = self._generate(self.engine, prompt_batch, step=index, seed=step_seed(self.seed, index))
            seconds = time.perf_counter() - t0
        return ProducedRollout(index, prompt_batch, rollout, data_state, seconds)

    def start(self, step: int) -> None:
        """Fix the schedule from ``step`` and, when prefetching, start the producer."""
        r, engine = self.cfg, self.engine  # the engine is built here, in this thread
        self.schedule = RolloutSchedule(start=step, sync_interval=r.sync_interval, run_ahead=r.run_ahead,
                                        checkpoint_every=self.checkpoint_every)
        if step >= self.max_steps:
            return
        if r.prefetch_depth > 0 and engine.shares_trainer_devices and self.multi_device:
            self.device_lock = threading.Lock()  # see the module docstring
        if self._engine_outlives_update and self.synced_version != step:
            self.sync(step)  # the engine must hold a copy, not the learner's buffers
        if r.prefetch_depth == 0:
            return
        logger.info("rollout producer: %d batch(es) in flight, generation %d step(s) ahead, sync every %d step(s), "
                    "engine %s", r.prefetch_depth, r.run_ahead, r.sync_interval, type(engine).__name__)
        self._loader_ahead = True
        self._producer = RolloutProducer(self.produce, self.schedule, depth=r.prefetch_depth, stop=self.max_steps,
                                         synced_version=step)

    def stop(self) -> None:
        """Stop the producer and put the loader back after the last consumed batch (unless the producer is
        still inside a generate call, in which case checkpoints keep using the consumed state)."""
        if self._producer is not None and self._producer.close():
            self.loader.set_state(self.data_state)
            self._loader_ahead = False
        self._producer, self.schedule = None, None
        self.device_lock = contextlib.nullcontext()

    def next(self, index: int) -> tuple[ProducedRollout, float, int]:
        """(batch ``index``, seconds the trainer waited for it, batches that were ready)."""
        if self.schedule is None:
            self.start(index)
        if self._producer is None:
            item = self.produce(index)
            waited, ready = item.seconds, 0
        else:
            item, waited, ready = self._producer.get(index)
        expected = self.schedule.generating_version(index)
        if item.rollout.policy_version != expected:
            raise RuntimeError(
                f"rollout batch {index} is tagged policy_version={item.rollout.policy_version}, but the engine "
                f"({type(self.engine).__name__}) was synced to version {expected} when it generated it; "
                "RolloutEngine.generate must tag each batch with the version of its last sync_weights")
        return item, waited, ready

    def consumed(self, item: ProducedRollout) -> None:
        """The trainer has trained on ``item``: checkpoints now record the loader state after it."""
        self.data_state = item.data_state

    def checkpoint_data_state(self) -> dict:
        """The loader state a checkpoint records: after the last consumed batch."""
        return self.data_state if self._loader_ahead else self.loader.get_state()

    def restored(self, data_state: dict, step: int) -> None:
        """A checkpoint put the loader at ``data_state`` and the learner at ``step``: sync the engine to it."""
        self._loader_ahead = False
        self.data_state = data_state
        self.sync(step)

    def sync(self, version: int) -> None:
        """Point the engine at the learner's current weights, tagged ``version`` (a copy of the trainable
        arrays when an engine that samples from the learner's own arrays outlives the next update; other engines
        copy what they keep)."""
        learner, engine = self.learner, self.engine
        with self.device_lock:
            if self._engine_outlives_update and engine.shares_trainer_devices:
                model = nnx.merge(learner.graphdef, learner.snapshot(), learner.frozen)
            else:
                model = learner.model
            engine.sync_weights(model, version)
        self.synced_version = version

    def sync_after_step(self, version: int) -> tuple[float, float]:
        """Sync the engine if ``version`` is a sync step: (seconds waited for pending generation, seconds of
        the sync)."""
        if not self.schedule.is_sync_step(version):
            return 0.0, 0.0
        waited = 0.0 if self._producer is None else self._producer.release_weights(version)
        t0 = time.perf_counter()
        self.sync(version)
        if self._producer is not None:
            self._producer.weights_synced(version)
        return waited, time.perf_counter() - t0

    def served_version(self) -> int:
        """The version the engine holds (before its first sync: the weights it was built from)."""
        return self.schedule.start if self.synced_version is None else self.synced_version

    def finish(self, version: int) -> None:
        """The run is done at ``version``: nothing to tell (a queue-fed source tells its explorers)."""

    def close(self) -> None:
        """Stop the producer; close the engine if this source built it (a pending weight sync finishes)."""
        self.stop()
        if self._owns_engine and self._engine is not None:
            self._engine.close()
