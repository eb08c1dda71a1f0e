"""``curves.png``: each metric's raw points under a bias-corrected moving average, a held-out eval panel when eval
ran, and the best possible reward when the reward functions declare it (``max_reward``)."""

from __future__ import annotations

import numpy as np
from PIL import Image

from jrl.data.tasks.arithmetic import exact_match, format_reward
from jrl.train.observability import plot_curves, smooth
from jrl.rewards.functions import RewardFunction, best_total, load_reward_functions


def test_smooth_keeps_a_constant_and_lags_a_ramp_less_than_its_span():
    assert np.allclose(smooth([0.7] * 40), 0.7)  # bias-corrected: no pull towards 0 at the start
    ramp = list(np.arange(100.0))
    out = np.asarray(smooth(ramp))
    lag = np.asarray(ramp) - out
    assert np.all(lag >= -1e-9) and lag[-1] < 10  # span = 100 // 10 points
    noisy = np.random.default_rng(0).normal(1.0, 0.3, 300)
    assert np.std(smooth(list(noisy))[50:]) < 0.5 * np.std(noisy)


def test_best_total_needs_every_function_to_declare_its_best():
    fns = load_reward_functions(["jrl.data.tasks.arithmetic:exact_match", "jrl.data.tasks.arithmetic:format_reward"])
    assert exact_match.max_reward == 1.0 and format_reward.max_reward == 1.0
    assert best_total(fns, (1.0, 0.5)) == 1.5
    assert best_total(fns) == 2.0  # each function's own weight (1 here)
    undeclared = RewardFunction(fn=lambda prompts, completions, **kw: [0.0] * len(completions), name="x")
    assert best_total([*fns, undeclared]) is None


def test_plot_has_an_eval_panel_only_when_eval_ran(tmp_path):
    rng = np.random.default_rng(1)
    history = [{"step": i, "reward/mean": float(rng.uniform(0, 1.5)), "loss": float(rng.normal())}
               for i in range(1, 60)]
    evals = [{"step": s, "eval/greedy/reward/mean": 1.0 + s / 100} for s in (0, 20, 40)]
    two = Image.open(plot_curves(history, tmp_path / "a.png", eval_history=[], best_reward=1.5))
    three = Image.open(plot_curves(history, tmp_path / "b.png", eval_history=evals, best_reward=1.5))
    assert three.size[0] > 1.4 * two.size[0] and three.size[1] == two.size[1]
