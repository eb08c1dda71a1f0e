"""Multi-host: start ``jax.distributed``, and give each process its share of a global batch.

Call :func:`initialize` first thing in a program that may run on several hosts (before any other JAX
call). On a TPU pod slice, SLURM, Open MPI or Kubernetes JAX finds the coordinator itself; elsewhere
set ``JRL_COORDINATOR_ADDRESS`` (``host:port`` of process 0), ``JRL_NUM_PROCESSES`` and
``JRL_PROCESS_ID`` on every process, or pass them as arguments. With one process it does nothing, so
the same script runs unchanged on a laptop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jrl.sharding.rules import DEFAULT_RULES, MeshAxes, logical_to_spec, mesh_axes

log = logging.getLogger(__name__)

ENV_COORDINATOR = "JRL_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JRL_NUM_PROCESSES"
ENV_PROCESS_ID = "JRL_PROCESS_ID"

_state: dict[str, Any] = {"initialized": False}


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def launched_processes() -> int | None:
    """The process count the ``JRL_*`` variables give the run before it is joined, or None (not set: one process,
    or a cluster JAX detects when :func:`initialize` joins it)."""
    return _env_int(ENV_NUM_PROCESSES)


def _detected_cluster() -> Any:
    """The cluster environment JAX's auto-detection would use (TPU pod, SLURM, ...), if any."""
    try:
        from jax._src import clusters
    except ImportError:  # pragma: no cover - private module moved
        return None
    for env in getattr(clusters.ClusterEnv, "_cluster_types", ()):
        try:
            if not getattr(env, "opt_in_only_method", False) and env.is_env_present():
                return env
        except Exception:  # noqa: BLE001 - a probe that fails means "not this environment"
            continue
    return None


def _distributed_is_initialized() -> bool:
    probe = getattr(jax.distributed, "is_initialized", None)
    if probe is not None:
        return bool(probe())
    return _state["initialized"]


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: Sequence[int] | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout: int = 30,
) -> bool:
    """Join the multi-process JAX runtime; returns ``True`` when running multi-process.

    Arguments win over the ``JRL_*`` environment variables; with neither, JAX's own cluster
    detection is used (TPU pod slices, SLURM, Open MPI, Kubernetes). A single process
    (``num_processes == 1``, or nothing configured and no cluster detected) is a no-op. Calling it
    again is a no-op too. It must run before anything touches a JAX device.

    ``heartbeat_timeout``: seconds after which the coordination service declares a silent process dead; every other
    process then stops with an error naming it (JAX's default, 100 s, is long for a run that waits on its peers)."""
    if _distributed_is_initialized():
        _state["initialized"] = True
        return jax.process_count() > 1
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    num_processes = num_processes if num_processes is not None else _env_int(ENV_NUM_PROCESSES)
    process_id = process_id if process_id is not None else _env_int(ENV_PROCESS_ID)
    explicit = coordinator_address is not None or num_processes is not None or process_id is not None

    if num_processes is not None and num_processes < 1:
        raise ValueError(f"num_processes={num_processes} must be >= 1")
    if num_processes == 1:
        log.info("jrl.sharding.initialize: single process, nothing to do")
        return False
    if explicit:
        missing = [
            n for n, v in (
                (f"coordinator_address / {ENV_COORDINATOR}", coordinator_address),
                (f"num_processes / {ENV_NUM_PROCESSES}", num_processes),
                (f"process_id / {ENV_PROCESS_ID}", process_id),
            ) if v is None
        ]
        if missing:
            raise ValueError(
                "jrl.sharding.initialize: a multi-process run needs the coordinator address, the number "
                f"of processes and this process's id; missing: {', '.join(missing)}"
            )
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id={process_id} must be in [0, num_processes={num_processes})")
    else:
        cluster = _detected_cluster()
        if cluster is None:
            log.info("jrl.sharding.initialize: no cluster detected and nothing configured; single process")
            return False
        try:
            count = cluster.get_process_count()
        except Exception:  # noqa: BLE001 - let jax.distributed find out
            count = None
        if count == 1:
            log.info("jrl.sharding.initialize: %s with a single process; nothing to do", cluster.__name__)
            return False
        log.info("jrl.sharding.initialize: %s detected, letting JAX find the coordinator", cluster.__name__)
    try:
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            local_device_ids=local_device_ids,
            initialization_timeout=initialization_timeout,
            heartbeat_timeout_seconds=heartbeat_timeout,
        )
    except RuntimeError as e:
        if "before" in str(e) or "already" in str(e):
            raise RuntimeError(
                f"jrl.sharding.initialize must be called before any other JAX call creates devices "
                f"(JAX said: {e}); call it first thing in the program"
            ) from e
        raise
    _state["initialized"] = True
    log.info("jrl.sharding.initialize: process %d of %d, %d local / %d global devices",
             jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count())
    return jax.process_count() > 1


def is_main_process() -> bool:
    """True on process 0 (the one that logs, writes checkpoints' metadata, exports)."""
    return jax.process_index() == 0


def host_allgather(x: Any) -> np.ndarray:
    """``[process_count, *x.shape]``: every process's host value ``x`` (same shape and dtype everywhere), in
    process order. A collective (every process must call it, in the same order as its other collectives); one
    process: ``x[None]`` without touching a device."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=False)).reshape((jax.process_count(),) + x.shape)


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (a collective; one process: ``flag``)."""
    return bool(host_allgather(np.asarray(bool(flag))).any())


def barrier(name: str) -> None:
    """Wait until every process has reached the barrier called ``name`` (one process: returns at once)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def process_shard(num_items: int, process_index: int | None = None, process_count: int | None = None) -> slice:
    """This process's contiguous share ``slice(start, stop)`` of ``num_items`` global items (a
    global batch, a dataset): equal parts in process order, matching how :func:`make_global_batch`
    assembles them for a batch sharded over ``data``/``fsdp``."""
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if num_items % process_count:
        raise ValueError(
            f"process_shard: {num_items} items do not split evenly over {process_count} processes; "
            f"use a global batch size that is a multiple of {process_count}"
        )
    per = num_items // process_count
    return slice(process_index * per, (process_index + 1) * per)


def batch_sharding(
    mesh: Mesh,
    ndim: int,
    rules: Mapping[str, MeshAxes] | None = None,
    logical_axes: Sequence[str | None] | None = None,
    shape: Sequence[int] | None = None,
) -> NamedSharding:
    """Sharding of a batch array: dimension 0 is ``batch`` (by default), the rest replicated."""
    axes = tuple(logical_axes) if logical_axes is not None else ("batch",) + (None,) * (ndim - 1)
    return NamedSharding(mesh, logical_to_spec(axes, mesh, DEFAULT_RULES if rules is None else rules, shape))


def process_batch_slice(global_batch: int, mesh: Mesh, rules: Mapping[str, MeshAxes] | None = None) -> slice:
    """The rows of a ``global_batch`` that live on this process's devices under the batch sharding
    (what this process must load). Equals :func:`process_shard` for the default meshes; differs when
    the batch is replicated over axes that span processes."""
    sharding = batch_sharding(mesh, 1, rules, shape=(global_batch,))
    idx = sharding.addressable_devices_indices_map((global_batch,))
    starts, stops = [], []
    for index in idx.values():
        s = index[0]
        starts.append(0 if s.start is None else s.start)
        stops.append(global_batch if s.stop is None else s.stop)
    lo, hi = min(starts), max(stops)
    if sum(b - a for a, b in set(zip(starts, stops, strict=True))) != hi - lo:
        raise ValueError("process_batch_slice: this process's batch rows are not contiguous on this mesh")
    return slice(lo, hi)


def make_global_batch(local: Any, mesh: Mesh, rules: Mapping[str, MeshAxes] | None = None) -> Any:
    """Assemble global ``jax.Array`` s from each process's local rows: ``local`` is a pytree of numpy
    arrays whose leading dimension holds this process's rows (its :func:`process_batch_slice` of the
    global batch, equal to :func:`process_shard` on the default meshes). Single process: a sharded
    ``device_put`` of the full batch. Every process must call it with the same structure."""

    def one(x):
        x = np.asarray(x)
        n_shards, n_local = _batch_blocks(mesh, rules)
        if x.shape[0] % n_local:
            raise ValueError(
                f"make_global_batch: {x.shape[0]} local rows do not split over this process's "
                f"{n_local} batch shards"
            )
        gshape = (x.shape[0] // n_local * n_shards,) + x.shape[1:]
        sharding = batch_sharding(mesh, x.ndim, rules, shape=gshape)
        return jax.make_array_from_process_local_data(sharding, x, gshape)

    return jax.tree_util.tree_map(one, local)


def batch_shards(mesh: Mesh | None, rules=None) -> int:
    """How many parts the batch sharding splits the rows of a batch into (1 without a mesh)."""
    if mesh is None:
        return 1
    spec = batch_sharding(mesh, 1, rules).spec
    axes = mesh_axes(spec[0] if len(spec) else None)
    return int(np.prod([mesh.shape[a] for a in axes])) if axes else 1


def _batch_blocks(mesh: Mesh, rules) -> tuple[int, int]:
    """(number of batch shards on the mesh, number of distinct ones on this process)."""
    n_shards = batch_shards(mesh, rules)
    sharding = batch_sharding(mesh, 1, rules, shape=(n_shards,))
    local = {(s[0].start, s[0].stop) for s in sharding.addressable_devices_indices_map((n_shards,)).values()}
    return n_shards, len(local)
