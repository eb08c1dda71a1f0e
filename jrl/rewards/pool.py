"""Reward functions of a training run in worker processes: a call that hangs is killed after ``timeout_s``, a
call that crashes its process costs only its own rows, a call that raises or returns malformed output is
reported; the run never waits on a reward function for longer than the timeout.

:class:`RewardScorer` is what an algorithm holds. Per step it splits the batch into calls (one function on
one contiguous block of whole groups, one block per worker), runs them in a :class:`RewardPool` of
``num_workers`` processes (or one after another in this process when 0), gives the rows of every failed
call no reward (NaN, which every later aggregation skips), counts the failures per function
(``reward/<fn>/errors``, ``reward/<fn>/timeouts``), logs them with the function's name and first error,
and stops the run with :class:`~jrl.rewards.functions.RewardError` once a function has failed on every call of
``max_failed_steps`` consecutive steps.

Workers are started with ``spawn`` (no forked JAX state), load the functions once (by import path), and
ignore SIGINT and SIGTERM: a Ctrl-C or a scheduler's signal reaches the trainer, which finishes the step
with its rewards. A worker exits when the trainer's end of its pipe closes, also when the trainer dies.
In asynchronous runs the next step's generation runs in the rollout thread while this one is scored. With
``scoring.stream_groups`` the calls of each generated chunk of a batch are sent (:meth:`RewardScorer.start`) while
the next chunk is generated, and collected once the batch is done (:meth:`RewardScorer.finish`); the pool's
:meth:`RewardPool.submit` / :meth:`RewardPool.collect` take a lock, as the rollout thread and the trainer thread
(evaluation) may both score.

With several trainer processes (:func:`jrl.sharding.initialize`) every process holds the whole batch's completions
(the rollout is gathered to every host) and scores only its share: a contiguous block of whole groups, the
``process_index``-th of :func:`group_blocks` over ``process_count`` parts. :meth:`RewardScorer.finish` then gathers
the rows and the failure counts of every process (:func:`jrl.sharding.host_allgather`), so each process returns the
same rewards and metrics and a function that fails everywhere stops every process at the same step. A reward
function is thus called once per completion, not once per process.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jrl.sharding import host_allgather
from jrl.rewards.functions import (
    CallResult,
    RewardCall,
    RewardError,
    check_inputs,
    describe,
    run_call,
    split_call,
    unique_names,
)

logger = logging.getLogger(__name__)

#: Seconds a new worker may take to import the reward functions before the run stops with an error.
START_TIMEOUT_S = 300.0


def _worker_main(conn, fns_pickle: bytes) -> None:
    """A worker's loop: load the functions, then answer ``(index, RewardCall)`` messages with a
    :class:`CallResult` until the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        fns = pickle.loads(fns_pickle)
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            j, call = conn.recv()
        except (EOFError, OSError):
            return
        conn.send(run_call(fns[j], call)._replace(exception=None))


@dataclasses.dataclass
class _Worker:
    process: Any
    conn: Any


class RewardPool:
    """``num_workers`` processes that run calls of ``fns`` (see the module docstring); :meth:`run` returns one
    :class:`CallResult` per call, never raising for what a function does. Close with :meth:`close`."""

    def __init__(self, fns: Sequence[Callable], num_workers: int, timeout_s: float):
        if num_workers < 1:
            raise ValueError(f"RewardPool needs num_workers >= 1, got {num_workers}")
        try:
            self._payload = pickle.dumps(list(fns))
        except Exception as e:
            raise ValueError(f"the reward functions cannot be sent to worker processes ({type(e).__name__}: {e}); "
                             "load them by import path, or run them in this process") from e
        self.timeout_s = float(timeout_s)
        self._what = ", ".join(describe(n, f) for n, f in zip(unique_names(fns), fns))
        self._workers: list[_Worker | None] = [None] * num_workers
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()  # the rollout thread (streaming) and the trainer thread share the pool
        self._issued = 0  # tickets handed out
        self._calls: dict[int, tuple[int, RewardCall]] = {}  # queued calls by ticket
        self._pending: collections.deque[int] = collections.deque()  # tickets not sent to a worker yet
        self._busy: dict[int, tuple[int, float]] = {}  # slot -> (ticket, deadline)
        self._results: dict[int, CallResult] = {}  # answers not collected yet

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def _start_missing(self) -> None:
        """Start a process in every empty slot and wait until each has loaded the functions."""
        started = []
        for slot, w in enumerate(self._workers):
            if w is None:
                parent, child = self._ctx.Pipe()
                p = self._ctx.Process(target=_worker_main, args=(child, self._payload), daemon=True,
                                      name=f"jrl-reward-worker-{slot}")
                p.start()
                child.close()
                self._workers[slot] = _Worker(p, parent)
                started.append(slot)
        deadline = time.monotonic() + START_TIMEOUT_S
        for slot in started:
            w = self._workers[slot]
            try:
                kind, detail = w.conn.recv() if w.conn.poll(max(0.0, deadline - time.monotonic())) else (None, None)
            except (EOFError, OSError):
                kind, detail = "exited", None
            if kind != "ready":
                self._discard(slot)
                why = {None: f"did not load them within {START_TIMEOUT_S:.0f} s",
                       "exited": "exited while loading them (its error is above)",
                       "failed": f"failed to load them: {detail}"}[kind]
                raise RuntimeError(f"a reward worker process {why} ({self._what}); run them in the trainer's "
                                   "process with scoring.num_workers=0 to debug")

    def _discard(self, slot: int) -> int | None:
        """Kill the slot's process (if it still runs) and empty the slot; its exit code."""
        w = self._workers[slot]
        self._workers[slot] = None
        if w is None:
            return None
        if w.process.is_alive():
            w.process.kill()
        w.process.join()
        w.conn.close()
        return w.process.exitcode

    def run(self, calls: Sequence[tuple[int, RewardCall]]) -> list[CallResult]:
        """Run ``(function index, call)`` pairs, as many at once as there are workers; the results in order."""
        return self.collect(self.submit(calls))

    def submit(self, calls: Sequence[tuple[int, RewardCall]]) -> list[int]:
        """Queue ``(function index, call)`` pairs and send as many as there are idle workers, without waiting for
        any answer; their ticket numbers, for :meth:`collect`. A call's timeout runs from when a worker gets it."""
        with self._lock:
            tickets = list(range(self._issued, self._issued + len(calls)))
            self._issued += len(calls)
            self._calls.update(zip(tickets, calls))
            self._pending.extend(tickets)
            self._guarded(block=False)
        return tickets

    def collect(self, tickets: Sequence[int]) -> list[CallResult]:
        """The results of :meth:`submit`'s ``tickets``, in order (waiting for them, and running queued calls)."""
        with self._lock:
            while any(t not in self._results for t in tickets):
                if not self._pending and not self._busy:
                    raise RuntimeError(f"reward calls {sorted(set(tickets) - set(self._results))} were dropped "
                                       "(an earlier call on the pool failed); they have no result")
                self._guarded(block=True)
            return [self._results.pop(t) for t in tickets]

    def _guarded(self, *, block: bool) -> None:
        try:
            self._pump(block)
        except BaseException:  # e.g. a worker that cannot start, a second Ctrl-C: no answer may reach a later call
            for slot in self._busy:
                self._discard(slot)
            self._busy.clear()
            self._pending.clear()
            self._calls.clear()
            raise

    def _pump(self, block: bool) -> None:
        """Give queued calls to idle workers, then take the answers that are in (``block``: wait for at least one
        answer or deadline), killing calls past their deadline."""
        if self._pending:
            self._start_missing()
        for slot in range(self.num_workers):
            if self._pending and slot not in self._busy:
                t = self._pending[0]
                try:
                    self._workers[slot].conn.send(self._calls[t])
                except OSError:  # the idle worker died (killed from outside): start another, send again next time
                    self._discard(slot)
                    return
                self._pending.popleft()
                del self._calls[t]
                self._busy[slot] = (t, time.monotonic() + self.timeout_s)
        if not self._busy:
            return
        wait_s = max(0.0, min(d for _, d in self._busy.values()) - time.monotonic()) if block else 0.0
        ready = set(multiprocessing.connection.wait([self._workers[s].conn for s in self._busy], timeout=wait_s))
        for slot, (t, deadline) in list(self._busy.items()):
            conn = self._workers[slot].conn
            if conn in ready:
                try:
                    self._results[t] = conn.recv()
                except (EOFError, OSError):
                    code = self._discard(slot)
                    self._results[t] = CallResult(None, f"crashed its worker process (exit code {code})")
            elif time.monotonic() >= deadline:
                self._discard(slot)
                self._results[t] = CallResult(None, f"timed out after {self.timeout_s:g} s (its worker was killed)",
                                              timed_out=True)
            else:
                continue
            del self._busy[slot]

    def close(self) -> None:
        """Stop every worker: close its pipe (it exits), kill it if it does not within 5 s."""
        for slot, w in enumerate(self._workers):
            if w is not None:
                w.conn.close()
                w.process.join(5.0)
                self._discard(slot)


def group_blocks(n: int, group_size: int, parts: int) -> list[tuple[int, int]]:
    """Up to ``parts`` contiguous ``(start, stop)`` blocks of ``n`` rows that never split a group."""
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size={group_size} does not divide the {n} completions")
    groups = n // group_size
    per = max(1, -(-groups // parts))
    return [(a * group_size, min(groups, a + per) * group_size) for a in range(0, groups, per)]


def process_rows(n: int, group_size: int) -> tuple[int, int]:
    """``(start, stop)`` of the rows of ``n`` completions this process scores: its block of whole groups (all of
    them with one process; an empty block when there are fewer groups than processes)."""
    blocks = group_blocks(n, group_size, jax.process_count())
    index = jax.process_index()
    return blocks[index] if index < len(blocks) else (n, n)


@dataclasses.dataclass
class StartedScoring:
    """Reward calls of some completions, sent (``tickets`` in the pool) or already run (``results``)."""

    rows: int
    blocks: list[tuple[int, int]]
    """The row blocks of each function's calls (within this process's rows)."""
    tickets: list[int] | None = None
    results: list[CallResult] | None = None


class RewardScorer:
    """A run's reward functions, scoring a step's completions (see the module docstring).

    Args:
      fns: the loaded functions (:func:`jrl.rewards.functions.load_reward_functions`).
      num_workers: worker processes; 0 runs the calls in this process (no timeout, no crash isolation).
      timeout_s: seconds one call may run in a worker.
      max_failed_steps: consecutive steps in which every call of one function failed before the run stops.
    """

    def __init__(self, fns: Sequence[Callable], *, num_workers: int, timeout_s: float, max_failed_steps: int):
        self.fns = list(fns)
        self.names = unique_names(self.fns)
        self.max_failed_steps = int(max_failed_steps)
        self.pool = RewardPool(self.fns, num_workers, timeout_s) if num_workers > 0 else None
        self._failed_steps = [0] * len(self.fns)  # consecutive steps in which each function failed every call

    def score(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None,
              columns: Mapping[str, Sequence[Any]] | None, *, step: int, group_size: int,
              count_failures: bool = True) -> tuple[np.ndarray, list[str], dict[str, float]]:
        """``(rewards [N, F] float32 with NaN for no reward, the functions' names, failure metrics)`` of one
        step; raises :class:`RewardError` when a function has now failed for ``max_failed_steps`` steps (only
        calls with ``count_failures`` count: an evaluation's do not)."""
        started = self.start(prompts, completions, completion_ids, columns, group_size=group_size)
        return self.finish([started], step=step, count_failures=count_failures)

    def start(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Sequence[Sequence[int]] | None,
              columns: Mapping[str, Sequence[Any]] | None, *, group_size: int) -> StartedScoring:
        """Send the calls that score these completions to the workers and return without waiting (in this process,
        with ``num_workers=0``: run them now); :meth:`finish` collects them."""
        n, kwargs = check_inputs(prompts, completions, completion_ids, columns)
        lo, hi = process_rows(n, group_size)
        workers = self.pool.num_workers if self.pool else 1
        blocks = [(lo + a, lo + b) for a, b in group_blocks(hi - lo, group_size, workers)]
        calls = [(j, split_call(prompts, completions, completion_ids, kwargs, a, b))
                 for j in range(len(self.fns)) for a, b in blocks]
        if self.pool is not None:
            return StartedScoring(n, blocks, tickets=self.pool.submit(calls))
        return StartedScoring(n, blocks, results=[run_call(self.fns[j], call) for j, call in calls])

    def finish(self, parts: Sequence[StartedScoring], *, step: int,
               count_failures: bool = True) -> tuple[np.ndarray, list[str], dict[str, float]]:
        """What :meth:`score` returns, for the rows of ``parts`` (started scorings, their rows in this order)."""
        rows = [0]
        for part in parts:
            rows.append(rows[-1] + part.rows)
        rewards = np.full((rows[-1], len(self.fns)), np.nan, np.float32)
        scored = np.zeros(rows[-1], bool)  # the rows this process scored
        done: list[list] = [[] for _ in self.fns]  # per function: (row block in the whole batch, result)
        for part, offset in zip(parts, rows):
            got = part.results if part.tickets is None else self.pool.collect(part.tickets)
            k = len(part.blocks)
            for a, b in part.blocks:
                scored[offset + a: offset + b] = True
            for j, mine in enumerate(done):
                mine += [((offset + a, offset + b), res) for (a, b), res in zip(part.blocks, got[j * k: (j + 1) * k])]
                for (a, b), res in mine[len(mine) - k:]:
                    if res.values is not None:
                        rewards[a:b, j] = res.values
        failed = [[(blk, res) for blk, res in mine if res.error is not None] for mine in done]
        # per function: calls, failed calls, timed-out calls (this process's; summed over the processes below)
        counts = np.asarray([[len(mine), len(bad), sum(res.timed_out for _, res in bad)]
                             for mine, bad in zip(done, failed)], np.int64).reshape(len(self.fns), 3)
        if jax.process_count() > 1:
            rewards, counts = self._gather(rewards, scored, counts)
        metrics: dict[str, float] = {}
        for j, name in enumerate(self.names):
            calls, bad, timeouts = (int(c) for c in counts[j])
            metrics[f"reward/{name}/errors"] = float(bad - timeouts)
            metrics[f"reward/{name}/timeouts"] = float(timeouts)
            self._account(j, step, failed[j], len(done[j]), calls > 0 and bad == calls, count_failures)
        return rewards, self.names, metrics

    @staticmethod
    def _gather(rewards: np.ndarray, scored: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every process's rewards (each row from the process that scored it) and summed failure counts."""
        all_rewards, all_scored = host_allgather(rewards), host_allgather(scored)
        if not np.all(all_scored.sum(0) == 1):
            raise RuntimeError("reward scoring: the processes' shares of the batch overlap or leave rows out; every "
                               "process must score the same completions")
        return all_rewards[all_scored.argmax(0), np.arange(len(scored))], host_allgather(counts).sum(0)

    def _account(self, j: int, step: int, failed: list, calls: int, every_call_failed: bool, count: bool) -> None:
        """Log this process's failed calls (of its ``calls``) of function ``j`` at step ``step``; when failures
        ``count`` (training, not an evaluation), stop the run after ``max_failed_steps`` consecutive steps in which
        ``every_call_failed`` (on every process)."""
        what = describe(self.names[j], self.fns[j])
        if failed:
            logger.warning("step %d%s: %s failed on %d of %d calls (%d completions got no reward): %s", step,
                           "" if count else " (eval)", what, len(failed), calls, sum(b - a for (a, b), _ in failed),
                           failed[0][1].error)
        if not count:
            return
        self._failed_steps[j] = self._failed_steps[j] + 1 if every_call_failed else 0
        if self._failed_steps[j] >= self.max_failed_steps:
            last = failed[0][1].error if failed else "(on another process)"
            raise RewardError(f"{what} failed on every call of {self._failed_steps[j]} consecutive steps "
                              f"(steps {step + 1 - self._failed_steps[j]}-{step}); the last error: "
                              f"{last}. Fix the function, or raise scoring.timeout_s if it is only slow "
                              "(scoring.max_failed_steps sets how many failed steps stop a run)",
                              function=self.names[j], batch=f"step {step}")

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
