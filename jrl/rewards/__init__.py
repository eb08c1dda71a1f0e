"""Rewards: reward functions named by import path (:mod:`jrl.rewards.functions`) and the worker processes that run
them with timeouts and crash isolation (:mod:`jrl.rewards.pool`).

Names are imported lazily, so a reward worker process imports only what its functions need.
"""

from jrl._lazy import lazy_exports

_EXPORTS = {
    "RewardSpec": "jrl.rewards.functions",
    "RewardFunction": "jrl.rewards.functions",
    "load_reward_functions": "jrl.rewards.functions",
    "best_total": "jrl.rewards.functions",
    "RewardScorer": "jrl.rewards.pool",
}

__all__, __getattr__, __dir__ = lazy_exports("jrl.rewards", _EXPORTS)
