"""Stopping a run cleanly on SIGTERM / SIGINT (what a scheduler, a TPU preemption or Ctrl-C sends).

Inside :func:`stop_requests` the first SIGTERM or SIGINT is only recorded: the trainer finishes the step it
is in, writes a checkpoint at that step boundary and returns, so the process exits 0 and ``--resume``
continues exactly (where generation runs ahead of the trainer, from the scheduled checkpoints only: batches generated
ahead came from older weights than a resumed run's first ones, :mod:`jrl.sources.prefetch`). The first signal also
puts the previous handlers back, so a second one acts at once (SIGINT: ``KeyboardInterrupt``; SIGTERM: the default,
termination).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """The signal that asked the run to stop (``None`` until one arrives)."""

    def __init__(self):
        self.signal: signal.Signals | None = None

    @property
    def name(self) -> str:
        return "" if self.signal is None else self.signal.name


@contextlib.contextmanager
def stop_requests() -> Iterator[StopRequest]:
    """Record SIGTERM / SIGINT in the yielded :class:`StopRequest` while inside. Signal handlers can only be
    set from the main thread; elsewhere (a trainer run from a worker thread) signals keep their handlers."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {s: signal.getsignal(s) for s in SIGNALS}

    def restore():
        for s, handler in previous.items():
            signal.signal(s, handler)

    def record(signum, frame):
        request.signal = signal.Signals(signum)
        restore()

    for s in SIGNALS:
        signal.signal(s, record)
    try:
        yield request
    finally:
        restore()
