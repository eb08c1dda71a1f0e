"""A run's reward functions as its config names them (:class:`RewardSpec`)."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """One reward function of a run."""

    path: str
    """Import path: ``package.module:function`` or ``path/to/file.py:function``."""
    weight: float = 1.0
    """Weight of this reward in the combined reward."""
    name: str | None = None
    """Name in metrics (``rewards/<name>/mean``); default: the function's attribute name."""

    def __post_init__(self):
        if not isinstance(self.path, str) or ":" not in self.path or not self.path.rsplit(":", 1)[1]:
            raise ValueError(
                f"RewardSpec.path={self.path!r} is invalid: use 'package.module:function' or 'path/to/file.py:function'"
            )
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            raise ValueError(f"RewardSpec.weight={self.weight!r} is invalid for {self.path!r}: use a finite number")
        if self.name is not None and (not isinstance(self.name, str) or not self.name):
            raise ValueError(
                f"RewardSpec.name={self.name!r} is invalid for {self.path!r}: use a non-empty string or None"
            )

    @classmethod
    def parse(cls, text: str) -> RewardSpec:
        """The spec written ``path:function[=weight]`` (the command line's form, e.g. ``my_rewards.py:fn=0.5``)."""
        path, sep, weight = text.rpartition("=")
        if not sep:
            return cls(path=text)
        try:
            value = float(weight)
        except ValueError:
            raise ValueError(f"reward {text!r}: the weight after '=' must be a number "
                             f"(write path:function or path:function=weight)") from None
        return cls(path=path, weight=value)

    def format(self) -> str:
        """``path:function=weight``, the form :meth:`parse` reads."""
        return f"{self.path}={self.weight:g}"
