"""JAX's persistent compilation cache for a run (``TrainConfig.compile_cache_dir``).

A run compiles the same programs every time it starts (on a GPU a 1B model's first step spends most of its time
compiling); with the cache a program compiled once is read back on the next start. On GPUs the cache key leaves out
which device a program was compiled for, so the devices of a data-parallel sampler, which each compile their own
copy of a program, can share one entry.

The directory is bounded (:data:`MAX_BYTES`, least recently used entries evicted), which also makes JAX take a file
lock around every read and write: processes and threads that share the directory never read a half-written entry.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading

logger = logging.getLogger(__name__)

#: Most bytes the cache directory holds; older entries are evicted past it.
MAX_BYTES = 8 << 30

# JAX's events: an entry read back, the compile seconds that saved, and an entry written (which JAX names a miss).
_HIT, _SAVED, _WRITE = ("/jax/compilation_cache/cache_hits", "/jax/compilation_cache/compile_time_saved_sec",
                        "/jax/compilation_cache/cache_misses")


@dataclasses.dataclass
class CacheUse:
    """What the cache did in this process since :func:`enable`: programs read back, the compile seconds that saved,
    and programs compiled and written."""

    directory: str
    loaded: int = 0
    saved_s: float = 0.0
    written: int = 0

    def summary(self) -> str:
        return (f"compilation cache {self.directory}: {self.loaded} programs loaded ({self.saved_s:.1f} s of "
                f"compiling saved), {self.written} compiled and written")


_lock = threading.Lock()
_use: CacheUse | None = None


def enable(directory: str | None) -> CacheUse | None:
    """Point JAX's persistent compilation cache at ``directory`` (``~`` expanded, created) unless it is None, and
    count its use (:class:`CacheUse`) from the next compilation on (JAX opens the directory at its first read or
    write, so programs compiled before are no obstacle). A directory that cannot be created is a warning and None; a
    second call in the same process keeps the first directory (and says so)."""
    global _use
    if directory is None:
        return None
    import jax
    from jax import monitoring

    path = os.path.abspath(os.path.expanduser(directory))
    with _lock:
        if _use is not None:
            if _use.directory != path:
                logger.warning("compile_cache_dir=%r: this process already uses the compilation cache in %s, which "
                               "it keeps", directory, _use.directory)
            return _use
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            logger.warning("compile_cache_dir=%r cannot be created (%s), so this run compiles every program: point "
                           "--compile-cache-dir at a writable directory, or pass None", directory, e)
            return None
        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
        use = _use = CacheUse(path)

    def count(event: str, **_) -> None:
        if event == _HIT:
            use.loaded += 1
        elif event == _WRITE:
            use.written += 1

    def seconds(event: str, duration: float, **_) -> None:
        if event == _SAVED:
            use.saved_s += max(0.0, duration)

    monitoring.register_event_listener(count)
    monitoring.register_event_duration_secs_listener(seconds)
    return use
