"""Shared dispatcher for kernel packages: pick an implementation by backend with an ordered fallback.

Each kernel package's ``api.py`` declares its implementations (name -> loader + availability check)
and an order per backend. :func:`select` resolves ``impl="auto"`` to the first available entry of the
backend's order, honours an explicit ``impl=`` (with an error naming the available ones when it
cannot run here) and logs one line per configuration saying what it picked and why the earlier
entries were skipped. Nothing here is traced: the choice is made in Python at trace time.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import Any, Callable, Mapping, Sequence

import jax

logger = logging.getLogger("jrl.kernels")

_LOGGED: set[tuple] = set()


def backend() -> str:
    """The default JAX backend as 'cpu', 'gpu' or 'tpu' (ROCm and CUDA are both 'gpu')."""
    b = jax.default_backend()
    return "gpu" if b in ("gpu", "cuda", "rocm") else b


def log_once(level: int, key: tuple, msg: str, *args: Any) -> None:
    """Log ``msg`` once per ``key`` for the life of the process."""
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    logger.log(level, msg, *args)


@dataclasses.dataclass(frozen=True)
class Impl:
    """One implementation of a kernel.

    ``module`` is imported lazily (``jrl.kernels.<pkg>.<module>``) so that a missing optional
    dependency (jax_triton) only disables that implementation. ``backends`` lists where it can run
    for real; ``interpret_ok`` marks Pallas kernels that also run anywhere in interpret mode.
    """

    name: str
    module: str
    backends: tuple[str, ...]
    interpret_ok: bool = False

    def load(self):
        return importlib.import_module(self.module)


class ImplUnavailable(RuntimeError):
    """An explicitly requested implementation cannot run here."""


def _why_unavailable(spec: Impl, here: str, call_check: Callable[[str], str | None] | None) -> str | None:
    if here not in spec.backends and not spec.interpret_ok:
        return f"needs {'/'.join(spec.backends)}, backend here is {here!r}"
    try:
        mod = spec.load()
    except Exception as e:  # ImportError of an optional dependency, or a broken install
        return f"import failed: {type(e).__name__}: {e}"
    check = getattr(mod, "unavailable_reason", None)
    if check is not None:
        reason = check()
        if reason:
            return reason
    if call_check is not None:
        reason = call_check(spec.name)
        if reason:
            return reason
    return None


def select(
    kernel: str,
    impls: Mapping[str, Impl],
    order: Mapping[str, Sequence[str]],
    impl: str,
    *,
    config: tuple = (),
    call_check: Callable[[str], str | None] | None = None,
):
    """Resolve ``impl`` to ``(name, module)``.

    Args:
      kernel: the kernel's name, for messages ("logprobs", "gmm").
      impls: every implementation, by name.
      order: backend -> names to try, best first, for ``impl="auto"``.
      impl: "auto" or one of ``impls``.
      config: a hashable description of the call (shapes, dtypes, flags); the pick is logged once
        per distinct ``(kernel, backend, config)``.
      call_check: optional ``name -> reason or None`` for call-specific constraints (e.g. a traced
        temperature that a kernel needs static).
    """
    here = backend()
    if impl != "auto" and impl not in impls:
        raise ValueError(
            f"unknown {kernel} impl {impl!r}; available: {', '.join(repr(n) for n in ['auto', *impls])}"
        )
    if impl != "auto":
        spec = impls[impl]
        reason = _why_unavailable(spec, here, call_check)
        if reason:
            runnable = [n for n, s in impls.items() if _why_unavailable(s, here, call_check) is None]
            raise ImplUnavailable(
                f"{kernel} impl {impl!r} cannot run here: {reason}. "
                f"Runnable on backend {here!r}: {', '.join(repr(n) for n in ['auto', *runnable])}"
            )
        log_once(logging.DEBUG, (kernel, here, impl, config), "jrl.kernels.%s: using %r on %s (requested) for %s",
                 kernel, impl, here, config)
        return impl, spec.load()
    skipped = []
    for name in order.get(here, order.get("default", ())):
        spec = impls[name]
        reason = _why_unavailable(spec, here, call_check)
        if reason is None:
            extra = f"; skipped {'; '.join(skipped)}" if skipped else ""
            level = logging.WARNING if skipped and any("import failed" in s for s in skipped) else logging.DEBUG
            log_once(level, (kernel, here, "auto", config), "jrl.kernels.%s: using %r on %s for %s%s",
                     kernel, name, here, config, extra)
            return name, spec.load()
        skipped.append(f"{name} ({reason})")
    raise ImplUnavailable(f"no {kernel} implementation can run on backend {here!r}: {'; '.join(skipped)}")
