"""Name → function registries, so configs select algorithms by name (Tunix ``algo_core.py`` style).

Three registries exist, one per config knob that names an algorithm:

- ``LOSS_TYPES`` (``GRPOConfig.loss_type``): ``grpo``, ``bnpo``, ``dr_grpo``, ``dapo``
  (registered in :mod:`jrl.losses.policy`);
- ``ADVANTAGE_ESTIMATORS`` (``GRPOConfig.advantage_estimator``): ``grpo``, ``rloo``
  (registered in :mod:`jrl.losses.advantages`);
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
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry:
    """A named table of functions filled by a decorator; ``get`` fails with the list of names."""

    def __init__(self, kind: str, config_field: str):
        self.kind = kind
        self.config_field = config_field
        self._fns: dict[str, Callable[..., Any]] = {}

    def register(self, name: str, *, override: bool = False) -> Callable[[F], F]:
        """Decorator: register ``fn`` under ``name``. Re-registering a name needs ``override=True``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def deco(fn: F) -> F:
            if name in self._fns and not override and self._fns[name] is not fn:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered; pass override=True to replace it"
                )
            self._fns[name] = fn
            return fn

        return deco

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered as ``name``; ``KeyError`` naming the field and the valid names."""
        try:
            return self._fns[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r} (config field `{self.config_field}`); "
                f"registered: {', '.join(repr(n) for n in self.names())}. "
                f"Pick one of those or register yours with @register_{self.config_field}(name)."
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._fns))

    def __contains__(self, name: object) -> bool:
        return name in self._fns


LOSS_TYPES = Registry("loss type", "loss_type")
ADVANTAGE_ESTIMATORS = Registry("advantage estimator", "advantage_estimator")
IS_MODES = Registry("importance-sampling mode", "importance_sampling_mode")

register_loss_type = LOSS_TYPES.register
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
register_importance_sampling_mode = IS_MODES.register


def get_loss_type(name: str) -> Callable[..., Any]:
    return LOSS_TYPES.get(name)


def get_advantage_estimator(name: str) -> Callable[..., Any]:
    return ADVANTAGE_ESTIMATORS.get(name)


def get_importance_sampling_mode(name: str) -> Callable[..., Any]:
    return IS_MODES.get(name)
