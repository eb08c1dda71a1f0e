"""The field checks every config runs in ``__post_init__``, with one error format.

Every invalid value raises ``ValueError("<Owner>.<field>=<value> is invalid: <fix>")`` (with a ``why``:
``"... is invalid: <why>. Fix: <fix>."``), so a user reads which field of which section is wrong, the
value given and what to write instead. The ``check_*`` helpers cover the common shapes of a knob
(an int with a lower bound, a finite number in a range, one of a set of names, a bool); checks
between fields stay in the config's ``__post_init__`` and use :func:`invalid` directly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def invalid(owner: str, field: str, value, fix: str, *, why: str | None = None) -> ValueError:
    """The error for ``owner.field = value``: what to do instead (``fix``) and, optionally, ``why``."""
    if why is None:
        return ValueError(f"{owner}.{field}={value!r} is invalid: {fix}")
    return ValueError(f"{owner}.{field}={value!r} is invalid: {why}. Fix: {fix}.")


def is_real(x) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_int(x, lo: int | None = None) -> bool:
    """An int (not a bool), at least ``lo`` when given."""
    return isinstance(x, int) and not isinstance(x, bool) and (lo is None or x >= lo)


def _owner(obj) -> str:
    return type(obj).__name__


def check_int(obj, field: str, *, lo: int, fix: str | None = None, optional: bool = False) -> None:
    """``obj.field`` is an int >= ``lo`` (or None when ``optional``)."""
    v = getattr(obj, field)
    if optional and v is None:
        return
    if not is_int(v, lo):
        raise invalid(_owner(obj), field, v, fix or f"use an int >= {lo}" + (", or None" if optional else ""))


def check_real(obj, field: str, *, fix: str, gt: float | None = None, ge: float | None = None,
               lt: float | None = None, le: float | None = None, optional: bool = False) -> None:
    """``obj.field`` is a finite number within the given bounds (or None when ``optional``)."""
    v = getattr(obj, field)
    if optional and v is None:
        return
    ok = is_real(v) and (gt is None or v > gt) and (ge is None or v >= ge) and (lt is None or v < lt) \
        and (le is None or v <= le)
    if not ok:
        raise invalid(_owner(obj), field, v, fix)


def check_choice(obj, field: str, options: Iterable[str]) -> None:
    """``obj.field`` is one of ``options``."""
    options = tuple(options)
    v = getattr(obj, field)
    if isinstance(v, bool) or v not in options:
        raise invalid(_owner(obj), field, v, f"use one of {options}")


def check_bool(obj, *fields: str) -> None:
    """Each of ``fields`` of ``obj`` is True or False."""
    for field in fields:
        if not isinstance(getattr(obj, field), bool):
            raise invalid(_owner(obj), field, getattr(obj, field), "use True or False")
