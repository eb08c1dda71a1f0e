"""Asynchronous rollouts: which policy version generates each batch, and the background producer
(docs/algorithms/grpo.md §14.1, §14.4, §14.11).

**Versions.** The policy version is the number of training steps the weights have seen (version
``v`` = the weights after step ``v - 1``; rollout batch ``k`` is the one consumed by step ``k``, which
trains version ``k``). The rollout engine holds one version at a time; the trainer syncs it at the
*sync steps*: every ``sync_interval`` steps, at every checkpoint step and at the step a run starts
from.

**Which version generates batch k** (:meth:`RolloutSchedule.generating_version`) is a pure function of
the config, never of thread timing: the latest sync step at or before ``k - run_ahead``, but not
before the latest checkpoint step at or before ``k``. So

- the run is reproducible: the same seeds give the same batches whatever the speed of each thread;
- the lag ``k - version`` is at most ``run_ahead + sync_interval - 1 <= max_staleness``;
- generation never runs ahead across a checkpoint, so a run resumed from a checkpoint generates
  exactly what the uninterrupted run did (the price is one pipeline bubble per checkpoint);
- ``run_ahead = 0`` (``max_staleness = sync_interval - 1``) makes a prefetching run equal to the
  synchronous one.

**Producer.** :class:`RolloutProducer` runs ``make_rollout(k)`` (take prompt batch ``k`` from the
loader, generate with the sampling seed of step ``k``) for ``k = start, start + 1, ...`` in a
background thread, keeping at most ``depth`` batches produced but not yet consumed, and starting
batch ``k`` only once the engine holds ``generating_version(k)``. The trainer, before syncing version
``v``, waits (:meth:`RolloutProducer.release_weights`) until every batch that needs an older version
has been generated, so a sync never replaces weights a pending batch still needs. Every wait is a
bounded poll that also watches the producer: an exception in the producer surfaces in the trainer
with the producer's traceback, and :meth:`RolloutProducer.close` returns within its timeout.

The loader is used by the producer thread only; each produced batch carries the loader state right
after its prompts were taken, and the trainer checkpoints the state of the last *consumed* batch.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from jrl.rollout.base import RolloutBatch

logger = logging.getLogger(__name__)

#: Seconds between checks of the producer's health while a thread waits on the other.
POLL_SECONDS = 0.05


def is_checkpoint_step(step: int, every: int) -> bool:
    """Whether a run that checkpoints every ``every`` steps (0: never, but at its end) writes one after ``step``."""
    return every > 0 and step % every == 0


@dataclasses.dataclass(frozen=True)
class RolloutSchedule:
    """When the rollout engine gets new weights and which version generates each batch (module docstring)."""

    start: int
    """Step the run starts (or resumes) from: the engine holds this version at the start."""
    sync_interval: int = 1
    """Steps between weight syncs."""
    run_ahead: int = 0
    """Steps by which generation may run ahead of training (0: synchronous)."""
    checkpoint_every: int = 0
    """Steps between checkpoints (0: none); checkpoint steps are sync steps and generation barriers."""

    def __post_init__(self):
        if self.sync_interval < 1 or self.run_ahead < 0 or self.checkpoint_every < 0 or self.start < 0:
            raise ValueError(f"invalid RolloutSchedule {self}: need start >= 0, sync_interval >= 1, run_ahead >= 0, "
                             "checkpoint_every >= 0")

    def _latest_multiple(self, every: int, at_most: int) -> int:
        return self.start if every <= 0 else max(self.start, at_most // every * every)

    def is_sync_step(self, version: int) -> bool:
        """Whether the trainer syncs the engine after the step that makes ``version``."""
        return (version == self.start or version % self.sync_interval == 0
                or is_checkpoint_step(version, self.checkpoint_every))

    def generating_version(self, index: int) -> int:
        """The policy version the engine holds when it generates rollout batch ``index`` (>= start)."""
        if index < self.start:
            raise ValueError(f"batch {index} comes before the schedule's start step {self.start}")
        x = max(self.start, index - self.run_ahead)
        # Checkpoint steps are sync steps too; the latest one at or before ``index`` is also the latest at or
        # before ``x``, or later.
        return max(self._latest_multiple(self.sync_interval, x), self._latest_multiple(self.checkpoint_every, index))


@dataclasses.dataclass
class ProducedRollout:
    """One generated rollout batch with what the trainer needs besides the completions."""

    index: int
    """Batch number = the training step that consumes it (its sampling seed is that step's)."""
    prompt_batch: Any
    """The :class:`~jrl.data.PromptBatch` it was generated from (the rewards need its columns)."""
    rollout: RolloutBatch
    """The completions, tagged with the ``policy_version`` that generated them."""
    data_state: dict
    """Loader state right after this batch's prompts were taken (checkpointed once it is consumed)."""
    seconds: float
    """Wall time of the ``generate`` call."""
    metrics: dict = dataclasses.field(default_factory=dict)
    """What the source logs of the step besides the trainer's metrics."""


class RolloutProducerError(RuntimeError):
    """The background producer failed; the message carries its traceback, ``__cause__`` the exception."""


class RolloutProducer:
    """A background thread generating rollout batches ``start .. stop - 1`` ahead of the trainer.

    ``make_rollout(k)`` produces batch ``k`` (it runs in the producer thread, which alone uses the
    data loader and calls the engine's ``generate``). ``depth``: most batches produced but not consumed.
    ``synced_version``: the version the engine holds when the producer starts (``schedule.start``).
    """

    def __init__(self, make_rollout: Callable[[int], ProducedRollout], schedule: RolloutSchedule, *, depth: int,
                 stop: int, synced_version: int | None = None, name: str = "jrl-rollout-producer"):
        if depth < 1:
            raise ValueError(f"RolloutProducer depth={depth} must be >= 1 (0 means no producer: generate inline)")
        if schedule.run_ahead > depth:
            raise ValueError(f"the schedule runs {schedule.run_ahead} steps ahead, more than the producer's depth={depth}")
        self.schedule, self.depth, self.stop = schedule, int(depth), int(stop)
        self._make = make_rollout
        self._cond = threading.Condition()
        self._ready: collections.deque[ProducedRollout] = collections.deque()
        self._next = schedule.start  # next batch to generate
        self._consumed = schedule.start  # batches < this were taken by the trainer
        self._synced = schedule.start if synced_version is None else int(synced_version)
        self._error: BaseException | None = None
        self._error_text = ""
        self._failed_index: int | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ producer thread
    def _may_generate(self, k: int) -> bool:
        return k - self._consumed < self.depth and self._synced >= self.schedule.generating_version(k)

    def _run(self) -> None:
        k = None
        try:
            while True:
                with self._cond:
                    k = self._next
                    while not self._closed and k < self.stop and not self._may_generate(k):
                        self._cond.wait(POLL_SECONDS)
                    if self._closed or k >= self.stop:
                        return
                    want = self.schedule.generating_version(k)
                    if self._synced != want:  # the trainer synced past a version this batch needs
                        raise RuntimeError(f"internal: batch {k} needs policy version {want} but the engine holds "
                                           f"{self._synced}")
                item = self._make(k)
                if item.index != k:
                    raise RuntimeError(f"make_rollout({k}) returned batch {item.index}")
                with self._cond:
                    self._ready.append(item)
                    self._next = k + 1
                    self._cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 (handed to the trainer thread, which re-raises it)
            with self._cond:
                self._error, self._failed_index = exc, k
                self._error_text = "".join(traceback.format_exception(exc))
                self._cond.notify_all()

    # ------------------------------------------------------------------ trainer thread
    def _check(self) -> None:
        """Raise in the trainer thread if the producer failed, stopped or was closed (call under the lock)."""
        if self._error is not None:
            raise RolloutProducerError(
                f"the rollout producer failed while generating batch {self._failed_index}: "
                f"{type(self._error).__name__}: {self._error}\nProducer traceback:\n{self._error_text}") from self._error
        if self._closed:
            raise RolloutProducerError("the rollout producer is closed")
        if not self._thread.is_alive():
            raise RolloutProducerError(f"the rollout producer thread stopped after batch {self._next - 1} "
                                       f"(it produces batches {self.schedule.start} .. {self.stop - 1})")

    def get(self, index: int) -> tuple[ProducedRollout, float, int]:
        """(batch ``index``, seconds waited for it, batches that were ready when asked); the trainer
        must take batches in order."""
        if index != self._consumed:
            raise ValueError(f"asked for rollout batch {index}, but the next one is {self._consumed}")
        if index >= self.stop:
            raise ValueError(f"rollout batch {index} is past the last one ({self.stop - 1})")
        t0 = time.perf_counter()
        with self._cond:
            ready = len(self._ready)
            while not self._ready:
                self._check()
                self._cond.wait(POLL_SECONDS)
            item = self._ready.popleft()
            self._consumed = index + 1
            self._cond.notify_all()
        if item.index != index:
            raise RuntimeError(f"internal: the producer queue held batch {item.index} where {index} was expected")
        return item, time.perf_counter() - t0, ready

    def release_weights(self, version: int) -> float:
        """Wait until no batch still to be generated needs a version older than ``version`` (call
        before syncing ``version``); returns the seconds waited."""
        t0 = time.perf_counter()
        with self._cond:
            while self._next < self.stop and self.schedule.generating_version(self._next) < version:
                self._check()
                self._cond.wait(POLL_SECONDS)
        return time.perf_counter() - t0

    def weights_synced(self, version: int) -> None:
        """The engine now holds ``version`` (call right after ``sync_weights``)."""
        with self._cond:
            self._synced = int(version)
            self._cond.notify_all()

    @property
    def queued(self) -> int:
        """Batches generated and not yet taken."""
        with self._cond:
            return len(self._ready)

    def close(self, timeout: float = 30.0) -> bool:
        """Stop the producer: it finishes the ``generate`` call it is in (if any) and exits. Waits at
        most ``timeout`` seconds; returns whether the thread has stopped (if not, it is a daemon thread
        and is left to finish on its own)."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the rollout producer did not stop within %.1f s (a generate call is still running); "
                           "leaving it to finish in the background", timeout)
            return False
        return True
