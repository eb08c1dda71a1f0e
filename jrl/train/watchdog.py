"""A training step that never ends ends the run.

Host-side waits of a run have timeouts of their own (reward calls, the experience queue, peers of a multi-process
run), but a program on the devices can hang where Python cannot reach it: when one GPU of a one-process mesh runs
out of memory, the others wait for it in a collective (an NCCL rendezvous), and XLA neither fails the call nor ends
the process. :class:`StepWatchdog` times each step from a thread of its own; a step still running past its deadline
calls ``on_expiry``, by default :func:`exit_stuck` (say so, print every thread's stack, stop the reward workers,
leave the process with exit status 1: the run continues from its last checkpoint with ``--resume``).

The deadline of a step is ``timeout_s``, or ``longest_factor`` times the longest step so far when that is longer
(runs whose steps grow long keep their margin).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

logger = logging.getLogger(__name__)

#: A step may take this many times the longest step before it (when that exceeds the timeout) before it counts as stuck.
LONGEST_FACTOR = 4.0


def exit_stuck(what: str, elapsed: float, deadline: float) -> None:
    """Report a stuck step, print the stacks of every thread, kill this process's child processes (reward workers
    blocked in user code would outlive it) and leave with status 1 at once: the interpreter's own exit would wait
    for the stuck device call."""
    logger.error("%s has run for %.0f s (its deadline: %.0f s, from step_timeout_s): a device is likely stuck, e.g. "
                 "one GPU out of memory while the others wait for it in a collective. Stopping the run; continue "
                 "from its last checkpoint with --resume, or raise --step-timeout-s if steps of this run take this "
                 "long. The stacks of its threads follow.", what, elapsed, deadline)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    for child in multiprocessing.active_children():
        child.kill()
    logging.shutdown()
    sys.stderr.flush()
    os._exit(1)


class StepWatchdog:
    """Deadlines for the steps of a run (see the module docstring); ``timeout_s`` 0 watches nothing."""

    def __init__(self, timeout_s: float, *, on_expiry: Callable[[str, float, float], None] = exit_stuck,
                 longest_factor: float = LONGEST_FACTOR):
        self.timeout_s, self.longest_factor, self.on_expiry = float(timeout_s), float(longest_factor), on_expiry
        self.longest = 0.0
        self._cond = threading.Condition()
        self._armed: tuple[str, float, float] | None = None  # (what, start, deadline in seconds)
        self._closed = False
        self._thread = None
        if self.timeout_s > 0:
            self._thread = threading.Thread(target=self._watch, name="jrl-step-watchdog", daemon=True)
            self._thread.start()

    def deadline(self) -> float:
        """Seconds the next step may take."""
        return max(self.timeout_s, self.longest_factor * self.longest)

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        """Watch the code of the ``with`` block as the step ``what`` (e.g. ``"step 12"``)."""
        if self._thread is None:
            yield
            return
        start = time.monotonic()
        with self._cond:
            self._armed = (what, start, self.deadline())
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._armed = None
                self.longest = max(self.longest, time.monotonic() - start)
                self._cond.notify()

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._closed:
                    return
                if self._armed is None:
                    self._cond.wait()
                    continue
                what, start, deadline = self._armed
                left = start + deadline - time.monotonic()
                if left <= 0:
                    self._armed = None
                    break
                self._cond.wait(left)
        self.on_expiry(what, time.monotonic() - start, deadline)

    def close(self) -> None:
        """Stop watching (the thread ends)."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)
