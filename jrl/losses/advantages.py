"""Rewards → advantages (docs/algorithms/grpo.md §1), the per-group signal flags and the reward metrics (§13.1).

Layout: ``rewards`` is ``[N, K]`` (N completions, K reward functions; ``[N]`` means K = 1), with the
G completions of a prompt in consecutive rows (axolotl's ``mini_repeat_count = G``). A reward
function that returned ``None`` is stored as NaN and skipped by every aggregation (nan-aware sums,
means and stds). All statistics use the Bessel-corrected std (divide by count − 1); a std over one
value (G = 1, or one non-NaN entry) is 0. Every function is a pure, jit-able function of arrays with
static shapes; ``group_size`` must be a Python int.

There is exactly one definition of each aggregation (docs/algorithms/grpo.md §21 open point 5), used everywhere:

- ``sum_then_normalize`` (§1.2): r_i = nansum_k w_k r_ik; A_i = (r_i − mean_group r) / (σ_i + 1e-4)
  with σ_i the group std (``scale_rewards="group"``), the batch std (``"batch"``) or no division
  (``"none"``). A completion whose rewards are all NaN sums to 0 (§1.1).
- ``normalize_then_sum`` (GDPO, §1.3): r̃_ik = (r_ik − nanmean_group r_·k) / (nanstd_group r_·k + 1e-4);
  s_i = nansum_k w_k r̃_ik; A_i = (s_i − mean_batch s) / (std_batch s + 1e-4). The second
  normalisation is always over the whole batch passed in, which must be the whole generation batch
  (open point 5). ``scale_rewards`` does not apply to it (as in TRL).
- RLOO (§1.4): A_i = G/(G−1) · (r_i − mean_group r) on the weighted sum r, no std scaling (the pure
  form; ``scale_rewards`` is ignored). Needs G ≥ 2 and ``sum_then_normalize``.
- REINFORCE: A_i = r_i, the weighted sum itself (no baseline). Needs ``sum_then_normalize``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jrl.losses.registry import ADVANTAGE_ESTIMATORS, register_advantage_estimator

ADV_EPS = 1e-4
"""Added to every std before dividing (docs/algorithms/grpo.md §1.2, §1.3)."""
ZERO_STD_ATOL = 1e-8
"""``torch.isclose(σ, 0)`` tolerance (atol; rtol·0 = 0) used by the zero-std flags (§1.5)."""

SCALE_REWARDS = ("group", "batch", "none")
AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


# ----------------------------------------------------------------------------------------------
# helpers


def _rewards_2d(rewards: jax.Array, group_size: int) -> jax.Array:
    rewards = jnp.asarray(rewards)
    rewards = rewards.astype(jnp.promote_types(rewards.dtype, jnp.float32))
    if rewards.ndim == 1:
        rewards = rewards[:, None]
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [N] or [N, K], got shape {rewards.shape}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a Python int >= 1, got {group_size!r}")
    if rewards.shape[0] % group_size:
        raise ValueError(
            f"rewards has N={rewards.shape[0]} rows, not a multiple of group_size={group_size}; "
            "pass whole groups (G consecutive completions per prompt)"
        )
    return rewards


def _weights(reward_weights, k: int, dtype) -> jax.Array:
    if reward_weights is None:
        return jnp.ones((k,), dtype)
    w = jnp.asarray(reward_weights, dtype)
    if w.shape != (k,):
        raise ValueError(
            f"reward_weights has shape {w.shape} but rewards has K={k} functions; give one weight per function"
        )
    return w


def _nansum_weighted(x: jax.Array, w: jax.Array) -> jax.Array:
    """Σ_k w_k x_k skipping NaN entries; an all-NaN row gives 0 (§1.1)."""
    return jnp.sum(jnp.where(jnp.isnan(x), 0.0, x * w), axis=-1)


def _nanmean(x: jax.Array, axis: int, keepdims: bool = False) -> jax.Array:
    valid = ~jnp.isnan(x)
    cnt = valid.sum(axis, keepdims=keepdims)
    tot = jnp.where(valid, x, 0.0).sum(axis, keepdims=keepdims)
    return jnp.where(cnt > 0, tot / jnp.maximum(cnt, 1), jnp.nan)


def _nanstd(x: jax.Array, axis: int, keepdims: bool = False) -> jax.Array:
    """Bessel-corrected nan-aware std; 0 for one valid value, NaN for none."""
    valid = ~jnp.isnan(x)
    cnt = valid.sum(axis, keepdims=True)
    mean = jnp.where(valid, x, 0.0).sum(axis, keepdims=True) / jnp.maximum(cnt, 1)
    sq = jnp.where(valid, (x - mean) ** 2, 0.0).sum(axis, keepdims=True)
    std = jnp.sqrt(sq / jnp.maximum(cnt - 1, 1))
    std = jnp.where(cnt > 1, std, jnp.where(cnt == 1, 0.0, jnp.nan))
    return std if keepdims else jnp.squeeze(std, axis)


def _std(x: jax.Array, axis=None, keepdims: bool = False) -> jax.Array:
    """Bessel-corrected std (torch's default); 0 over a single value."""
    n = x.size if axis is None else x.shape[axis]
    if n <= 1:
        return jnp.zeros_like(x.mean(axis, keepdims=keepdims))
    return jnp.std(x, axis=axis, ddof=1, keepdims=keepdims)


def combined_rewards(rewards: jax.Array, *, group_size: int = 1, reward_weights=None) -> jax.Array:
    """r_i = nansum_k w_k r_ik, the combined raw reward [N] (§1.2; all-NaN rows give 0)."""
    r = _rewards_2d(rewards, group_size)
    return _nansum_weighted(r, _weights(reward_weights, r.shape[1], r.dtype))


def _zero_std(std: jax.Array, grouped: jax.Array) -> jax.Array:
    """isclose(σ, 0), made exact for constant groups whose float mean is off by an ulp."""
    rng = jnp.nanmax(grouped, axis=1) - jnp.nanmin(grouped, axis=1)
    return (jnp.abs(std) <= ZERO_STD_ATOL) | (rng == 0)


# ----------------------------------------------------------------------------------------------
# estimators


def _group_relative(r: jax.Array, group_size: int, scale_rewards: str) -> jax.Array:
    g = r.reshape(-1, group_size)
    centred = (g - g.mean(axis=1, keepdims=True)).reshape(-1)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        sigma = jnp.repeat(_std(g, axis=1), group_size)
    elif scale_rewards == "batch":
        sigma = _std(r)
    else:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    return centred / (sigma + ADV_EPS)


def _normalize_then_sum(r: jax.Array, w: jax.Array, group_size: int) -> jax.Array:
    n, k = r.shape
    g = r.reshape(-1, group_size, k)
    if group_size > 1:
        std_k = _nanstd(g, axis=1, keepdims=True)
    else:
        std_k = jnp.zeros_like(g[:, :1])
    r_tilde = ((g - _nanmean(g, axis=1, keepdims=True)) / (std_k + ADV_EPS)).reshape(n, k)
    s = _nansum_weighted(r_tilde, w)
    return (s - s.mean()) / (_std(s) + ADV_EPS)


def _check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def _weighted_sum(estimator: str, rewards: jax.Array, group_size: int, reward_weights, aggregation: str) -> jax.Array:
    """r_i = Σ_k w_k r_ik [N] for an estimator that works on the weighted sum (needs ``sum_then_normalize``)."""
    _check_aggregation(aggregation)
    if aggregation != "sum_then_normalize":
        raise ValueError(
            f"advantage_estimator={estimator!r} works on the weighted reward sum; "
            "set multi_objective_aggregation='sum_then_normalize'"
        )
    r = _rewards_2d(rewards, group_size)
    return _nansum_weighted(r, _weights(reward_weights, r.shape[1], r.dtype))


@register_advantage_estimator("grpo")
def group_relative_advantages(
    rewards: jax.Array,
    *,
    group_size: int,
    reward_weights=None,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> jax.Array:
    """GRPO group-relative advantages [N] (§1.2 ``sum_then_normalize`` or §1.3 ``normalize_then_sum``)."""
    _check_aggregation(aggregation)
    r = _rewards_2d(rewards, group_size)
    w = _weights(reward_weights, r.shape[1], r.dtype)
    if aggregation == "normalize_then_sum":
        return _normalize_then_sum(r, w, group_size)
    return _group_relative(_nansum_weighted(r, w), group_size, scale_rewards)


@register_advantage_estimator("rloo")
def rloo_advantages(
    rewards: jax.Array,
    *,
    group_size: int,
    reward_weights=None,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> jax.Array:
    """Leave-one-out advantages [N] (§1.4): G/(G−1)·(r_i − mean_group r). ``scale_rewards`` is ignored."""
    del scale_rewards  # the pure RLOO form has no std scaling (§1.4)
    if group_size < 2:
        raise ValueError(f"advantage_estimator='rloo' needs num_generations >= 2, got {group_size}")
    r = _weighted_sum("rloo", rewards, group_size, reward_weights, aggregation)
    return group_size / (group_size - 1) * _group_relative(r, group_size, "none")


@register_advantage_estimator("reinforce")
def reinforce_advantages(
    rewards: jax.Array,
    *,
    group_size: int,
    reward_weights=None,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> jax.Array:
    """A_i = r_i, the weighted reward sum itself (no baseline; EBFT with one sample per document)."""
    del scale_rewards  # no group statistics
    return _weighted_sum("reinforce", rewards, group_size, reward_weights, aggregation)


@functools.partial(jax.jit, static_argnames=("group_size", "estimator", "scale_rewards", "aggregation"))
def compute_advantages(
    rewards: jax.Array,
    *,
    group_size: int,
    estimator: str = "grpo",
    reward_weights=None,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
) -> jax.Array:
    """Advantages [N] from rewards [N, K] (NaN = None) with the estimator registered as ``estimator``.

    Call it once per optimizer step on the whole generation batch (all groups, all processes),
    after every reward of the step is in; never on a chunk (docs/algorithms/grpo.md §21 open point 5).
    Jitted (``group_size`` and the names are static); it nests inside a caller's ``jax.jit``.
    """
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    return fn(
        rewards,
        group_size=group_size,
        reward_weights=reward_weights,
        scale_rewards=scale_rewards,
        aggregation=aggregation,
    )


def advantages_from_config(rewards: jax.Array, config) -> jax.Array:
    """:func:`compute_advantages` with the estimator and knobs of a :class:`GRPOConfig`."""
    return compute_advantages(
        rewards,
        group_size=config.num_generations,
        estimator=config.advantage_estimator,
        reward_weights=config.reward_weights,
        scale_rewards=config.scale_rewards,
        aggregation=config.multi_objective_aggregation,
    )


# ----------------------------------------------------------------------------------------------
# signal flags and reward metrics


@functools.partial(jax.jit, static_argnames=("group_size",))
def group_zero_std(rewards: jax.Array, *, group_size: int, reward_weights=None) -> jax.Array:
    """[N // G] bool: the group's combined raw reward r has std ≈ 0 (docs/algorithms/grpo.md §21 open point 12).

    Computed before any normalisation and independent of ``scale_rewards`` / aggregation.
    """
    r = combined_rewards(rewards, group_size=group_size, reward_weights=reward_weights)
    g = r.reshape(-1, group_size)
    return _zero_std(_std(g, axis=1), g)


@functools.partial(jax.jit, static_argnames=("group_size", "aggregation"))
def group_has_signal(
    rewards: jax.Array,
    *,
    group_size: int,
    reward_weights=None,
    aggregation: str = "sum_then_normalize",
) -> jax.Array:
    """[N // G] bool: the group carries a learning signal; from raw rewards, never ``A == 0``.

    This is the flag for the zero-advantage skip and replay/re-roll (docs/algorithms/grpo.md §14.8, §21 open
    point 13). ``sum_then_normalize`` (and RLOO): the combined raw reward varies in the group.
    ``normalize_then_sum``: some weighted function varies in the group, because GDPO normalises
    each function separately, so a group whose weighted sum is constant can still get non-zero
    advantages (e.g. r1 = [1, 0], r2 = r3 = [0, 0.5]).
    """
    _check_aggregation(aggregation)
    if aggregation == "sum_then_normalize":
        return ~group_zero_std(rewards, group_size=group_size, reward_weights=reward_weights)
    r = _rewards_2d(rewards, group_size)
    w = _weights(reward_weights, r.shape[1], r.dtype)
    g = r.reshape(-1, group_size, r.shape[1])
    std = _nanstd(g, axis=1)  # [groups, K]; NaN when all NaN
    rng = jnp.nanmax(g, axis=1) - jnp.nanmin(g, axis=1)
    varies = ~((jnp.abs(std) <= ZERO_STD_ATOL) | (rng == 0)) & ~jnp.isnan(std)
    return jnp.any(varies & (w != 0), axis=1)


def sequence_has_signal(group_flags: jax.Array, group_size: int) -> jax.Array:
    """Broadcast per-group flags [N // G] to the completions [N]."""
    return jnp.repeat(group_flags, group_size)


@functools.partial(jax.jit, static_argnames=("group_size", "reward_names"))
def reward_metrics(
    rewards: jax.Array,
    *,
    group_size: int,
    reward_weights=None,
    reward_names: Sequence[str] | None = None,
) -> dict[str, jax.Array]:
    """Reward metrics of docs/algorithms/grpo.md §13.1 as a flat dict of scalars.

    - ``reward``: mean_i r_i (combined weighted nan-sum);
    - ``reward_std``: mean over groups of the group std of r;
    - ``frac_reward_zero_std``: fraction of groups whose combined raw reward has std ≈ 0
      (open point 12; one definition whatever the mode);
    - ``rewards/<name>/mean`` and ``/std`` (``reward_names`` a tuple, static): nanmean and nanstd of r_·k over the batch (NaN when a
      function returned ``None`` for every completion).
    """
    r2 = _rewards_2d(rewards, group_size)
    k = r2.shape[1]
    names = tuple(reward_names) if reward_names is not None else tuple(f"reward_{i}" for i in range(k))
    if len(names) != k:
        raise ValueError(f"reward_names has {len(names)} names but rewards has K={k} functions")
    r = _nansum_weighted(r2, _weights(reward_weights, k, r2.dtype))
    g = r.reshape(-1, group_size)
    out = {
        "reward": r.mean(),
        "reward_std": _std(g, axis=1).mean(),
        "frac_reward_zero_std": _zero_std(_std(g, axis=1), g).astype(r.dtype).mean(),
    }
    means, stds = _nanmean(r2, axis=0), _nanstd(r2, axis=0)
    for i, name in enumerate(names):
        out[f"rewards/{name}/mean"] = means[i]
        out[f"rewards/{name}/std"] = stds[i]
    return out
