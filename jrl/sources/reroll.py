"""Deferred re-roll of prompts every completion of which failed (docs/algorithms/grpo.md §14.10).

A group whose completions all got reward 0 from every function (each raw reward finite and ``|r| < 1e-6``)
teaches nothing now, but the prompt may be solvable by a later policy. Its prompt is buffered (FIFO); from
step ``max(1, ⌊max_steps · reroll.start_fraction⌋)`` on, each rollout batch takes up to ``reroll.max_groups``
buffered prompts in place of its **last** prompts (the loader's prompts there are skipped), so they are sampled
again with the newer policy. ``start_fraction = 1.0`` (the default) never re-rolls. A re-rolled prompt that fails
again is buffered again while it has been re-rolled fewer than ``reroll.max_rerolls`` times (the reference sets
no limit: a prompt the policy cannot solve comes back forever, each time in place of a fresh prompt).

Which batch takes a buffered prompt is a function of the steps, not of thread timing: batch ``j`` takes only
prompts buffered by steps ``<= j - 1 - rollout.prefetch_depth`` (the producer generates batch ``j`` once step
``j - 1 - prefetch_depth`` is done), so prefetching runs and resumed runs re-roll exactly what the
uninterrupted run does. The producer thread takes, the trainer thread buffers: one lock.

Metrics: ``reroll_buffered`` (groups the step buffered), ``reroll_buffer_size`` (prompts that no batch up to this
step re-rolled), ``reroll_groups`` (groups of the step's batch that were re-rolls), ``reroll_failed_again`` (those
of them that failed again), ``reroll_dropped`` (those that failed again with no re-roll left). The buffer is part
of the checkpoint (:meth:`RerollBuffer.state`).
"""

from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np

from jrl.sources.config import RerollConfig  # noqa: F401 (public name)

#: A reward this close to 0 counts as a failure.
ZERO_REWARD = 1e-6


def all_fail_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """[N // G] bool: every raw reward [N, K] of the group is finite and 0 (within 1e-6)."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size * np.shape(rewards)[-1])
    with np.errstate(invalid="ignore"):
        return np.all(np.abs(r) < ZERO_REWARD, axis=1)


@dataclasses.dataclass
class _Entry:
    step: int
    """The step that buffered the prompt."""
    index: int
    """The prompt's index in the training :class:`~jrl.data.PromptDataset`."""
    rerolls: int = 0
    """Times the prompt had been re-rolled when it failed this time (0: it failed in a fresh batch)."""
    taken_by: int | None = None
    """The batch that re-rolls it (None: waiting)."""


class RerollBuffer:
    """The buffered prompts (module docstring). ``lag``: ``rollout.prefetch_depth``."""

    def __init__(self, cfg: RerollConfig, *, max_steps: int, lag: int):
        self.cfg, self.lag = cfg, int(lag)
        self.start = max(1, math.floor(max_steps * cfg.start_fraction))
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()

    def take(self, batch: int) -> list[int]:
        """Dataset indices of the prompts batch ``batch`` re-rolls (oldest first; marked taken)."""
        if batch < self.start:
            return []
        with self._lock:
            ready = [e for e in self._entries if e.taken_by is None and e.step <= batch - 1 - self.lag]
            for e in ready[: self.cfg.max_groups]:
                e.taken_by = batch
            return [e.index for e in ready[: self.cfg.max_groups]]

    def add(self, step: int, indices: list[int], failed: np.ndarray) -> dict[str, float]:
        """Buffer the prompts of step ``step``'s all-fail groups (``indices``: each group's dataset index in batch
        order, ``failed`` [groups] bool); the step's metrics. Forgets prompts re-rolled by batches up to ``step``
        (trained on, so no checkpoint needs them)."""
        with self._lock:
            rerolled = [e for e in self._entries if e.taken_by == step]
            self._entries = [e for e in self._entries if e.taken_by is None or e.taken_by > step]
            # The batch's last groups are its re-rolls, in the order taken (RolloutSource puts them there).
            rerolls = [0] * (len(indices) - len(rerolled)) + [e.rerolls + 1 for e in rerolled]
            again = [(int(indices[k]), rerolls[k]) for k in np.flatnonzero(failed)]
            limit = self.cfg.max_rerolls
            kept = [_Entry(step, i, n) for i, n in again if limit is None or n < limit]
            self._entries += kept
            # Not "not taken yet": the producer may already have taken prompts for the next batch, or not, by
            # thread timing; prompts no trained batch re-rolled are a function of the steps.
            waiting = len(self._entries)
        failed_again = sum(n > 0 for _, n in again)
        return {"reroll_buffered": float(len(kept)), "reroll_buffer_size": float(waiting),
                "reroll_groups": float(len(rerolled)), "reroll_failed_again": float(failed_again),
                "reroll_dropped": float(len(again) - len(kept))}

    # ------------------------------------------------------------------ checkpoint
    def state(self, step: int) -> list[list[int]]:
        """``[buffering step, index, re-rolls]`` of each prompt not re-rolled by a batch before ``step`` (the
        checkpoint at step ``step``: prompts the producer took for later batches are waiting again)."""
        with self._lock:
            return [[e.step, e.index, e.rerolls] for e in self._entries
                    if e.step < step and (e.taken_by is None or e.taken_by >= step)]

    def load_state(self, state: list[list[int]]) -> None:
        """Entries of :meth:`state` (checkpoints written before the re-roll count have ``[step, index]``)."""
        with self._lock:
            self._entries = [_Entry(int(e[0]), int(e[1]), int(e[2]) if len(e) > 2 else 0) for e in state]
