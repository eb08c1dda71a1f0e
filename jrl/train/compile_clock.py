"""Seconds this process has spent compiling XLA programs: a step's ``time/compile``.

The first steps of a run compile its programs, and a later step compiles again when it meets a new shape (a new
length bucket, a paged generation's new slot or page count). The trainer logs the difference of
:func:`compiled_seconds` over each step, so a slow step can be told apart from a compiling one. Counted from JAX's
backend-compile events; programs read back from the persistent compilation cache do not count.
"""

from __future__ import annotations

import threading

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_total = [0.0]
_listening = [False]


def _count(event: str, seconds: float, **_) -> None:
    if event == _BACKEND_COMPILE:
        with _lock:
            _total[0] += seconds


def compiled_seconds() -> float:
    """Backend compile seconds of this process since the first call (any thread's compiles)."""
    with _lock:
        if not _listening[0]:
            from jax import monitoring

            monitoring.register_event_duration_secs_listener(_count)
            _listening[0] = True
        return _total[0]
