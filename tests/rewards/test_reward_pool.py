"""Reward functions in real worker processes: hangs killed at the timeout, crashes and exceptions isolated to
their rows and counted, malformed output reported, the run stopped after repeated failure."""

from __future__ import annotations

import os
import textwrap
import time

import numpy as np
import pytest

from jrl.rewards.pool import RewardPool, RewardScorer, group_blocks
from jrl.rewards.functions import RewardError, compute_rewards, load_reward_functions, split_call

FUNCTIONS = textwrap.dedent(
    """
    import math
    import os
    import time

    def length(prompts, completions, completion_ids, **kw):
        return [float(len(c)) for c in completions]

    def pid(prompts, completions, completion_ids, **kw):
        return [float(os.getpid())] * len(completions)

    def hang(prompts, completions, completion_ids, **kw):
        time.sleep(10_000)

    def hang_on_b(prompts, completions, completion_ids, **kw):
        if "b" in completions:
            time.sleep(10_000)
        return [1.0] * len(completions)

    def exit_hard(prompts, completions, completion_ids, **kw):
        os._exit(3)

    def boom(prompts, completions, completion_ids, **kw):
        raise ZeroDivisionError("bad verifier")

    def nan(prompts, completions, completion_ids, **kw):
        return [math.nan] * len(completions)

    def short(prompts, completions, completion_ids, **kw):
        return [0.0] * (len(completions) - 1)

    def fail_when(prompts, completions, completion_ids, fail, **kw):
        if any(fail):
            raise RuntimeError("asked to fail")
        return [2.0] * len(completions)
    """
)


@pytest.fixture(scope="module")
def functions(tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "pool_rewards.py"
    path.write_text(FUNCTIONS)
    return lambda *names: load_reward_functions([f"{path}:{n}" for n in names])


def _batch(n=8, fail=False):
    completions = ["a", "bb", "b", "dddd", "ccc", "e", "ff", "g"][:n]
    return dict(prompts=["p"] * n, completions=completions, completion_ids=[[1] * len(c) for c in completions],
                columns={"fail": [fail] * n})


def test_blocks_keep_groups_whole():
    assert group_blocks(8, 2, 2) == [(0, 4), (4, 8)]
    assert group_blocks(6, 2, 4) == [(0, 2), (2, 4), (4, 6)]
    assert group_blocks(8, 4, 1) == [(0, 8)]
    with pytest.raises(ValueError, match="group_size=3 does not divide the 8 completions"):
        group_blocks(8, 3, 2)


def test_workers_score_like_this_process_on_whole_groups(functions):
    fns = functions("length", "nan")
    b = _batch()
    here, names = compute_rewards(fns, None, **b)
    scorer = RewardScorer(fns, num_workers=2, timeout_s=60, max_failed_steps=3)
    try:
        rewards, names2, metrics = scorer.score(**b, step=1, group_size=2)
        np.testing.assert_array_equal(rewards, here)
        assert names2 == names == ["length", "nan"] and np.isnan(rewards[:, 1]).all()
        assert metrics == {"reward/length/errors": 0.0, "reward/length/timeouts": 0.0,
                           "reward/nan/errors": 0.0, "reward/nan/timeouts": 0.0}
    finally:
        scorer.close()
    (pid_fn,) = functions("pid")
    pool = RewardPool([pid_fn], 2, timeout_s=60)
    try:
        got = pool.run([(0, split_call(b["prompts"], b["completions"], None, {}, a, z)) for a, z in [(0, 4), (4, 8)]])
    finally:
        pool.close()
    seen = {int(r.values[0]) for r in got}
    assert len(seen) == 2 and os.getpid() not in seen  # two other processes, one block each


def test_a_hanging_call_is_killed_at_the_timeout_and_the_rest_scores(functions):
    fns = functions("length", "hang_on_b")
    scorer = RewardScorer(fns, num_workers=2, timeout_s=1.5, max_failed_steps=2)
    try:
        t0 = time.monotonic()
        rewards, _, metrics = scorer.score(**_batch(), step=4, group_size=2)
        took = time.monotonic() - t0
        # blocks [0:4] (holds "b") and [4:8]: only the first block of hang_on_b is lost
        np.testing.assert_array_equal(rewards[:, 0], [1, 2, 1, 4, 3, 1, 2, 1])
        assert np.isnan(rewards[:4, 1]).all() and (rewards[4:, 1] == 1).all()
        assert metrics["reward/hang_on_b/timeouts"] == 1 and metrics["reward/hang_on_b/errors"] == 0
        assert took < 1.5 + 20  # the timeout plus starting the workers, never the 10_000 s sleep
        # the killed worker is replaced: the next step scores normally
        rewards, _, metrics = scorer.score(**{**_batch(), "completions": list("acdefghi")}, step=5, group_size=2)
        assert (rewards[:, 1] == 1).all() and metrics["reward/hang_on_b/timeouts"] == 0
    finally:
        scorer.close()


@pytest.mark.parametrize("name, error", [
    ("exit_hard", "crashed its worker process (exit code 3)"),
    ("boom", "raised ZeroDivisionError: bad verifier"),
    ("short", "returned 3 values for 4 completions"),
])
def test_a_failing_call_costs_its_rows_is_counted_and_logged(functions, caplog, name, error):
    fns = functions("length", name)
    scorer = RewardScorer(fns, num_workers=2, timeout_s=60, max_failed_steps=2)
    try:
        with caplog.at_level("WARNING", logger="jrl.rewards.pool"):
            rewards, _, metrics = scorer.score(**_batch(), step=9, group_size=4)
        assert np.isnan(rewards[:, 1]).all() and np.isfinite(rewards[:, 0]).all()
        assert metrics[f"reward/{name}/errors"] == 2 and metrics[f"reward/{name}/timeouts"] == 0
        (msg,) = [r.getMessage() for r in caplog.records]
        assert f"step 9: reward function '{name}'" in msg and "failed on 2 of 2 calls (8 completions" in msg
        assert error in msg
        # the second step in a row with every call failed stops the run, naming the function and the error
        escaped = error.replace("(", ".").replace(")", ".")
        with pytest.raises(RewardError, match=rf"'{name}' .* failed on every call of 2 consecutive steps "
                                              rf"\(steps 9-10\); the last error: {escaped}"):
            scorer.score(**_batch(), step=10, group_size=4)
    finally:
        scorer.close()


def test_only_steps_where_every_call_failed_count_toward_the_stop(functions):
    (fn,) = functions("fail_when")
    scorer = RewardScorer([fn], num_workers=0, timeout_s=120, max_failed_steps=2)
    b = _batch(4)
    ok = b
    half = {**b, "columns": {"fail": [True, True, False, False]}}
    failing = _batch(4, fail=True)
    scorer2 = RewardScorer([fn], num_workers=2, timeout_s=60, max_failed_steps=2)
    try:
        # in this process (one call per step): a failure is caught the same way (no timeout)
        for step, batch in enumerate([failing, ok, failing, ok, failing], 1):
            rewards, _, metrics = scorer.score(**batch, step=step, group_size=2)
        assert metrics["reward/fail_when/errors"] == 1 and np.isnan(rewards).all()
        with pytest.raises(RewardError, match=r"steps 5-6"):
            scorer.score(**failing, step=6, group_size=2)
        # in workers: one of two calls failing does not count, and resets the streak
        for step, batch in enumerate([failing, half, failing], 1):
            rewards, _, metrics = scorer2.score(**batch, step=step, group_size=2)
        assert metrics["reward/fail_when/errors"] == 2
        _, _, metrics = scorer2.score(**half, step=4, group_size=2)
        assert metrics["reward/fail_when/errors"] == 1
    finally:
        scorer2.close()


def test_scoring_started_in_parts_finishes_like_one_call(functions):
    fns = functions("length", "boom")
    b = _batch()
    scorer = RewardScorer(fns, num_workers=2, timeout_s=60, max_failed_steps=3)
    try:
        whole, names, metrics = scorer.score(**b, step=1, group_size=2)

        def part(a, z):
            return scorer.start(b["prompts"][a:z], b["completions"][a:z], b["completion_ids"][a:z],
                                {"fail": b["columns"]["fail"][a:z]}, group_size=2)

        # three parts in flight at once; the pool hands each call its own answer
        parts = [part(0, 2), part(2, 6), part(6, 8)]
        rewards, _, parted = scorer.finish(parts, step=2)
        np.testing.assert_array_equal(rewards, whole)
        assert parted["reward/boom/errors"] == 4 and metrics["reward/boom/errors"] == 2  # one call per block
        # the streak counts steps, not parts: this is the third step in a row on which boom failed every call
        with pytest.raises(RewardError, match=r"steps 1-3"):
            scorer.finish([part(0, 4), part(4, 8)], step=3)
    finally:
        scorer.close()


def test_a_worker_that_cannot_load_the_functions_is_a_clear_error(tmp_path):
    path = tmp_path / "gone.py"
    path.write_text("def f(prompts, completions, completion_ids, **kw):\n    return [1.0] * len(completions)\n")
    fns = load_reward_functions([f"{path}:f"])
    path.unlink()  # loaded here, but a fresh worker process cannot import it any more
    pool = RewardPool(fns, 1, timeout_s=60)
    try:
        with pytest.raises(RuntimeError, match=r"a reward worker process failed to load them: RewardLoadError: reward "
                                               r"file .*gone.py.* does not exist .*scoring.num_workers=0"):
            pool.run([(0, split_call(["p"], ["c"], None, {}, 0, 1))])
    finally:
        pool.close()
    with pytest.raises(ValueError, match="cannot be sent to worker processes"):
        RewardPool([lambda **kw: [1.0]], 1, timeout_s=1)
