"""Name → function registries, so configs select algorithms by name (Tunix ``algo_core.py`` style).

Four registries exist, one per config knob that names an algorithm:

- ``OBJECTIVES`` (``GRPOConfig.objective``): the per-token surrogate of the policy ratio and the
  advantage, ``ppo_clip`` (registered in :mod:`jrl.losses.policy`) and ``cispo`` (:mod:`jrl.losses.cispo`);

- ``LOSS_TYPES`` (``GRPOConfig.loss_type``): ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``
  (registered in :mod:`jrl.losses.policy`);
- ``ADVANTAGE_ESTIMATORS`` (``GRPOConfig.advantage_estimator``, ``EBFTConfig.advantage_estimator``):
  ``grpo``, ``rloo``, ``reinforce`` (registered in :mod:`jrl.losses.advantages`);
- ``IS_MODES`` (``GRPOConfig.importance_sampling_mode``): ``token_truncate``, ``token_mask``,
  ``sequence_truncate``, ``sequence_mask`` (registered in :mod:`jrl.losses.importance`).

A user adds an algorithm with the decorator, e.g.::

    @register_loss_type("my_norm")
    def my_norm(mask, normalizers, max_completion_length): ...

and selects it with ``GRPOConfig(loss_type="my_norm")``. Importing :mod:`jrl.losses` registers the
built-ins; an unknown name raises a ``KeyError`` that lists every registered name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jrl.registry import Registry


def _registry(kind: str, field: str) -> Registry:
    return Registry(kind, field, how_to_register=f"@register_{field}(name)")


LOSS_TYPES = _registry("loss type", "loss_type")
ADVANTAGE_ESTIMATORS = _registry("advantage estimator", "advantage_estimator")
IS_MODES = _registry("importance-sampling mode", "importance_sampling_mode")
OBJECTIVES = _registry("objective", "objective")

register_loss_type = LOSS_TYPES.register
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
register_importance_sampling_mode = IS_MODES.register
register_objective = OBJECTIVES.register


def get_loss_type(name: str) -> Callable[..., Any]:
    return LOSS_TYPES.get(name)


def get_advantage_estimator(name: str) -> Callable[..., Any]:
    return ADVANTAGE_ESTIMATORS.get(name)


def get_importance_sampling_mode(name: str) -> Callable[..., Any]:
    return IS_MODES.get(name)


def get_objective(name: str) -> Callable[..., Any]:
    return OBJECTIVES.get(name)
