"""Deferred re-roll of prompts every completion of which failed (docs/algorithms/grpo.md §14.10).

A group whose completions all got reward 0 from every function (each raw reward finite and ``|r| < 1e-6``)
teaches nothing now, but the prompt may be solvable by a later policy. Its prompt is buffered (FIFO); from
step ``max(1, ⌊max_steps · reroll.start_fraction⌋)`` on, each rollout batch takes up to ``reroll.max_groups``
buffered prompts in place of its **last** prompts (the loader's prompts there are skipped), so they are sampled
again with the newer policy. ``start_fraction = 1.0`` (the default) never re-rolls.

Which batch takes a buffered prompt is a function of the steps, not of thread timing: batch ``j`` takes only
prompts buffered by steps ``<= j - 1 - rollout.prefetch_depth`` (the producer generates batch ``j`` once step
``j - 1 - prefetch_depth`` is done), so prefetching runs and resumed runs re-roll exactly what the
uninterrupted run does. The producer thread takes, the trainer thread buffers: one lock.

Metrics: ``reroll_buffered`` (groups the step buffered), ``reroll_buffer_size`` (prompts that no batch up to this
step re-rolled), ``reroll_groups`` (groups of the step's batch that were re-rolls). The buffer is part of the
checkpoint (:meth:`RerollBuffer.state`).
"""

from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np

from jrl.validation import check_int, check_real

#: A reward this close to 0 counts as a failure.
ZERO_REWARD = 1e-6


@dataclasses.dataclass(frozen=True)
class RerollConfig:
    """Deferred re-roll of all-fail prompts (module docstring); ``grpo`` only."""

    start_fraction: float = 1.0
    """Re-roll from step ``max(1, ⌊max_steps · start_fraction⌋)`` on; 1.0 = never (the reference's default)."""
    max_groups: int = 1
    """Most buffered prompts one batch takes (each replaces one of its last prompts)."""

    def __post_init__(self):
        check_real(self, "start_fraction", ge=0, le=1, fix="use a fraction of max_steps in [0, 1] (1.0 = off)")
        check_int(self, "max_groups", lo=1)


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

    def add(self, step: int, indices: list[int]) -> dict[str, float]:
        """Buffer the prompts of step ``step``'s all-fail groups; the step's metrics. Forgets prompts re-rolled by
        batches up to ``step`` (trained on, so no checkpoint needs them)."""
        with self._lock:
            rerolled = sum(e.taken_by == step for e in self._entries)
            self._entries = [e for e in self._entries if e.taken_by is None or e.taken_by > step]
            self._entries += [_Entry(step, int(i)) for i in indices]
            # Not "not taken yet": the producer may already have taken prompts for the next batch, or not, by
            # thread timing; prompts no trained batch re-rolled are a function of the steps.
            waiting = len(self._entries)
        return {"reroll_buffered": float(len(indices)), "reroll_buffer_size": float(waiting),
                "reroll_groups": float(rerolled)}

    # ------------------------------------------------------------------ checkpoint
    def state(self, step: int) -> list[list[int]]:
        """``[buffering step, index]`` of each prompt not re-rolled by a batch before ``step`` (the checkpoint at
        step ``step``: prompts the producer took for later batches are waiting again)."""
        with self._lock:
            return [[e.step, e.index] for e in self._entries
                    if e.step < step and (e.taken_by is None or e.taken_by >= step)]

    def load_state(self, state: list[list[int]]) -> None:
        with self._lock:
            self._entries = [_Entry(int(s), int(i)) for s, i in state]
