"""Name → object registries, so a config picks an implementation by name.

Each registry sits next to the protocol it serves (loss types in :mod:`jrl.losses`, rollout engines and
weight transports in :mod:`jrl.rollout`, algorithms in :mod:`jrl.train.algorithms`). Entries register
with the decorator::

    @LOSS_TYPES.register("my_norm")
    def my_norm(mask, normalizers, max_completion_length): ...

and an unknown name raises a ``KeyError`` that names the config field and every registered name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class Registry:
    """A named table of functions or classes filled by a decorator; ``get`` fails with the list of names."""

    def __init__(self, kind: str, config_field: str, *, how_to_register: str | None = None):
        self.kind = kind
        self.config_field = config_field
        self.how_to_register = how_to_register or f"@<registry>.register(name) next to the {kind} protocol"
        self._entries: dict[str, Any] = {}

    def register(self, name: str, *, override: bool = False) -> Callable[[F], F]:
        """Decorator: register the object under ``name``. Re-registering a name needs ``override=True``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def deco(obj: F) -> F:
            if name in self._entries and not override and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is already registered; pass override=True to replace it")
            self._entries[name] = obj
            return obj

        return deco

    def get(self, name: str) -> Any:
        """The entry registered as ``name``; ``KeyError`` naming the config field and the valid names."""
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(
                f"unknown {self.kind} {name!r} (config field `{self.config_field}`); "
                f"registered: {', '.join(repr(n) for n in self.names())}. "
                f"Pick one of those or register yours with {self.how_to_register}."
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._entries))

    def in_order(self) -> tuple[str, ...]:
        """The names in the order they were registered."""
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
