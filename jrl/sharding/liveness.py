"""Which process of a multi-process run died, so the survivors can say so.

When a process dies, the collective another one is waiting in fails at once (the peer's connection drops), but the
error names an address, not a process, and JAX's coordination service only declares the dead process after its
heartbeat timeout, then aborts every survivor with a fatal log. :class:`PeerWatch` lets a survivor name the dead
process itself within seconds: every process bumps a counter ``jrl/alive/<process>`` in the coordination service's
key-value store from a daemon thread; :meth:`PeerWatch.lost` returns the processes whose counter stops moving
(all of them, when the store itself is gone: process 0, which hosts it, died).
"""

from __future__ import annotations

import threading
import time

import jax

#: Seconds between two bumps of this process's counter.
STAMP_INTERVAL_S = 0.5


def _client():
    """JAX's coordination-service client (None when ``jax.distributed`` is not initialised)."""
    try:
        from jax._src.distributed import global_state
    except ImportError:  # pragma: no cover - private module moved
        return None
    return getattr(global_state, "client", None)


class PeerWatch:
    """Liveness counters of every process of the run (see the module docstring). Start it on every process."""

    def __init__(self, *, interval: float = STAMP_INTERVAL_S):
        self.client, self.interval = _client(), float(interval)
        self.index, self.count = jax.process_index(), jax.process_count()
        self._stop = threading.Event()
        self._thread = None
        if self.client is not None and self.count > 1:
            self._thread = threading.Thread(target=self._stamp, name="jrl-peer-watch", daemon=True)
            self._thread.start()

    def _stamp(self) -> None:
        key = f"jrl/alive/{self.index}"
        while not self._stop.is_set():
            try:
                self.client.key_value_increment(key, 1)
            except Exception:  # noqa: BLE001 - the store is gone (process 0 died): nothing left to stamp
                return
            self._stop.wait(self.interval)

    def _counters(self) -> dict[int, int | None]:
        out: dict[int, int | None] = {}
        for i in range(self.count):
            try:
                out[i] = int(self.client.key_value_try_get(f"jrl/alive/{i}"))
            except Exception:  # noqa: BLE001 - missing key or unreachable store
                out[i] = None
        return out

    def lost(self, wait: float = 4.0) -> list[int] | None:
        """The other processes that stopped stamping within ``wait`` seconds (process 0 alone when the store it
        hosts no longer answers); None when this cannot be told (single process, no coordination service)."""
        if self._thread is None:
            return None
        before = self._counters()
        if all(v is None for i, v in before.items() if i != self.index):
            return [0] if self.index != 0 else None
        deadline = time.monotonic() + wait
        moving: set[int] = {self.index}
        while time.monotonic() < deadline and len(moving) < self.count:
            time.sleep(self.interval)
            now = self._counters()
            moving |= {i for i, v in now.items() if v is not None and v != before[i]}
        return [i for i in range(self.count) if i not in moving]

    def close(self) -> None:
        self._stop.set()
