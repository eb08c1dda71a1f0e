"""A step that never ends ends the run (``step_timeout_s``, :mod:`jrl.train.watchdog`): the watchdog fires for the
step that overran and no other, its deadline follows the longest step, and through the command line a run whose
step is stuck leaves with status 1, the setting named and the threads' stacks printed, its reward workers gone."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from jrl.train.watchdog import StepWatchdog

ROOT = Path(__file__).resolve().parents[2]


def test_only_the_step_that_overruns_its_deadline_fires():
    fired, stuck = [], threading.Event()

    def on_expiry(what, elapsed, deadline):
        fired.append((what, elapsed, deadline))
        stuck.set()  # lets the stuck step below go on

    watchdog = StepWatchdog(0.2, on_expiry=on_expiry)
    try:
        with watchdog.step("step 1"):  # ends well before its deadline
            pass
        with watchdog.step("step 2"):
            assert stuck.wait(timeout=60), "the watchdog did not fire"
        ((what, elapsed, deadline),) = fired
        assert what == "step 2" and deadline == pytest.approx(0.2) and elapsed >= 0.2
    finally:
        watchdog.close()


def test_the_deadline_follows_the_longest_step_and_zero_watches_nothing():
    watchdog = StepWatchdog(10.0, on_expiry=lambda *a: None, longest_factor=4.0)
    try:
        assert watchdog.deadline() == 10.0
        with watchdog.step("step 1"):
            pass
        watchdog.longest = 5.0  # as after a 5 s step
        assert watchdog.deadline() == 20.0
    finally:
        watchdog.close()
    off = StepWatchdog(0, on_expiry=lambda *a: pytest.fail("a watchdog of timeout 0 fired"))
    assert off._thread is None
    with off.step("step 1"):
        pass


BLOCKING_REWARD = '''
import os
import threading


def blocking(prompts, completions, **kw):
    """Writes its process id, then never returns (a step stuck where no other timeout reaches)."""
    with open(os.environ["JRL_TEST_PID_FILE"], "a") as f:
        f.write(f"{os.getpid()}\\n")
    threading.Event().wait()
'''


def _gone(pid: int) -> bool:
    """The process is gone or a zombie (killed, not yet reaped by whoever adopted it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"


def test_a_stuck_step_ends_the_run_with_its_stacks(tmp_path):
    reward = tmp_path / "blocking_reward.py"
    reward.write_text(BLOCKING_REWARD)
    pids = tmp_path / "worker_pids"
    env = {**os.environ, "JRL_TEST_PID_FILE": str(pids)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", "configs/grpo.py", "--max-steps", "2",
         "--output-dir", str(tmp_path / "run"), "--rewards", f"{reward}:blocking", "--scoring.timeout-s", "3600",
         "--step-timeout-s", "20"],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "step 1 has run for" in proc.stderr and "step_timeout_s" in proc.stderr, proc.stderr[-3000:]
    assert "most recent call first" in proc.stderr  # the threads' stacks
    started = [int(x) for x in pids.read_text().split()]
    assert started, "no reward call started"
    assert all(_gone(pid) for pid in started), started
