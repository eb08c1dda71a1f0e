"""Lazy package exports: a package lists ``{name: module}`` and its names import on first use.

Used where importing a light submodule (e.g. a reward function in a worker process) must not pull in
heavy siblings (grain, transformers, the models).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[list[str], Callable, Callable]:
    """``(__all__, __getattr__, __dir__)`` for ``package`` exporting ``exports`` lazily."""
    names = sorted(exports)

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__():
        return names

    return names, __getattr__, __dir__
