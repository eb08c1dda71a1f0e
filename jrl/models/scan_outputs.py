"""Scan outputs allocated without a zero fill.

``jax.lax.scan`` writes every step's outputs (``ys``) into stacked buffers, and its lowering first fills those
buffers with zeros, although the loop then writes every slot. Under autodiff the forward's saved values are such
outputs, so a scanned model's train step zero-fills all of them on every step: 9 GiB for a Llama-3.2-1B shape at
8 x 1024 tokens with the GPU remat policy (the gate and up projections' outputs alone 4 GiB, 1.3 ms on an H100;
``benchmarks/RESULTS.md``). JAX has the primitive for an uninitialized buffer (:func:`jax.lax.empty`, an
``AllocateBuffer`` custom call on GPU) and its scan lowering is meant to switch to it; until it does,
:func:`uninitialized_scan_outputs` makes the scans lowered inside it (in the calling thread) allocate their
outputs with :func:`jax.lax.empty`.

It reaches one private function of JAX's scan lowering (``jax._src.lax.control_flow.loops._empty_array``); where
that is missing or has another signature the context changes nothing (:func:`available`). Outputs with a
sharding, a memory space other than device memory or ``shard_map`` varying axes keep the zero fill. On a mesh
only the scans that run per device (inside a ``shard_map``, :mod:`jrl.models.fsdp`) are switched
(``per_device_only``): a scan left to XLA's partitioner has unsharded outputs in the trace, and an uninitialized
buffer there is not partitioned like the zeros it replaces.
"""

from __future__ import annotations

import contextlib
import inspect
import threading

import jax

_state = threading.local()
_install_lock = threading.Lock()
_original = None


def _hook():
    """JAX's scan-output allocator module and function, or None when this JAX lowers scans differently."""
    try:
        from jax._src.lax.control_flow import loops
    except ImportError:
        return None
    fn = getattr(loops, "_empty_array", None)
    if fn is None or list(inspect.signature(fn).parameters) != ["prefix", "length_spec", "aval"]:
        return None
    return loops, fn


def available() -> bool:
    """Whether this JAX's scan lowering can be told to allocate its outputs uninitialized."""
    return _original is not None or _hook() is not None


def _per_device(mesh) -> bool:
    """Whether ``mesh`` (an aval's) is the manual mesh of code inside a ``shard_map``."""
    types = getattr(mesh, "axis_types", ())
    return bool(mesh.shape) and all(t == jax.sharding.AxisType.Manual for t in types)


def _plain(aval, per_device_only: bool) -> bool:
    """A device-memory value without sharding or ``shard_map`` varying axes (with ``per_device_only``: one inside
    a ``shard_map``)."""
    sharding = getattr(aval, "sharding", None)
    per_device = sharding is not None and _per_device(sharding.mesh)
    unsharded = sharding is None or ((per_device or not sharding.mesh.shape)
                                     and all(p is None for p in sharding.spec))
    varying = getattr(getattr(aval, "mat", None), "varying", None) or getattr(aval, "vma", None)
    space = getattr(aval, "memory_space", None)
    return (unsharded and not varying and (space is None or space.name == "Device")
            and (per_device or not per_device_only))


def _empty_array(prefix, length_spec, aval):
    mode = getattr(_state, "active", None)
    if mode is not None and _plain(aval, mode == "per_device"):
        return jax.lax.empty((*prefix, *aval.shape), aval.dtype)
    return _original(prefix, length_spec, aval)


def _install() -> bool:
    global _original
    with _install_lock:
        if _original is None:
            hook = _hook()
            if hook is None:
                return False
            loops, _original = hook
            loops._empty_array = _empty_array
    return True


@contextlib.contextmanager
def uninitialized_scan_outputs(enabled: bool = True, *, per_device_only: bool = False):
    """Within this block (this thread only), scans lowered allocate their stacked outputs uninitialized (with
    ``per_device_only``, only scans inside a ``shard_map``: a program on a mesh).

    Lowering happens on a jitted function's first call for given argument types: wrap the calls. JAX caches a
    lowering without regard to this switch, so a program lowered once keeps its allocation (the results are the
    same either way: only the initial contents of buffers the loop overwrites differ). ``enabled`` False makes it
    a no-op (callers pass their condition)."""
    if not enabled or not _install():
        yield
        return
    previous = getattr(_state, "active", None)
    _state.active = "per_device" if per_device_only else "all"
    try:
        yield
    finally:
        _state.active = previous
