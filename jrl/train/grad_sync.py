"""Whether an update's micro-batches accumulate their gradients per device (``OptimConfig.grad_sync``; the
programs are :mod:`jrl.train.update_programs`'): which updates can, and for ``auto`` which ones should.

Per-device accumulation runs the whole loss on each device's own rows, so it needs a loss that is a sum over rows
(a loss declares it with a true ``rows_separable`` attribute; one that does not is taken not to be), a mesh whose
only split axes are ``data`` and ``fsdp``, a dense model (a MoE model's router losses are batch-wide), and
micro-batches whose rows split evenly over the devices. ``auto`` also wants a GPU (where it was measured faster,
``benchmarks/RESULTS.md``) and room for the whole weights and a whole gradient: at most a quarter of a device's
memory, the rest being the activations' and, on a shared mesh, the sampler's. ``auto`` leaves an update of one
micro-batch to the per-device FSDP path: gathering the whole weights once for it (its gathers at the start, its
reduce-scatter at the end, neither beside compute) measured 0.894-0.918 of one GPU's speed per GPU on 2 H200s,
the per-device path's layers gathered two at a time 0.948 (:mod:`jrl.train.fsdp_gathers`; ``benchmarks/RESULTS.md``,
twenty-first session).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from jrl.kernels import backend as kernel_backend
from jrl.sharding import memory_limit
from jrl.sharding.collectives import batch_axes, only_axes

#: Share of a device's memory that ``auto`` lets the whole weights and gradient take.
AUTO_MEMORY_SHARE = 0.25


def refusal(mesh: Mesh, rules: Mapping, is_moe: bool, losses: Sequence, row_counts: Sequence[int]) -> str | None:
    """Why an update of micro-batches of ``row_counts`` rows on ``losses`` cannot accumulate per device (None: it
    can)."""
    if not only_axes(mesh, ("data", "fsdp")):
        return f"the mesh {dict(mesh.shape)} splits over axes other than data and fsdp"
    if is_moe:
        return "a MoE model's router losses are not sums over rows"
    for loss in losses:
        if not getattr(loss, "rows_separable", False):
            return f"the loss {type(loss).__name__} is not a sum over rows"
    for n in row_counts:
        if batch_axes(mesh, rules, n) is None:
            return f"a micro-batch of {n} rows does not split evenly over the mesh's batch axes {dict(mesh.shape)}"
    return None


def _whole_bytes(leaves) -> int:
    """Bytes per device that a whole copy of the not yet replicated ``leaves`` adds."""
    return sum(x.nbytes - x.addressable_shards[0].data.nbytes for x in leaves
               if isinstance(x, jax.Array) and not x.is_fully_replicated)


def auto_takes_update(params: Sequence[jax.Array], frozen: Sequence[jax.Array]) -> bool:
    """Whether ``auto`` accumulates per device where an update can: on a GPU, when the whole ``params`` and
    ``frozen`` weights and a whole gradient of ``params`` take at most :data:`AUTO_MEMORY_SHARE` of the first
    device's memory."""
    if kernel_backend() != "gpu":
        return False
    leaves = [x for x in params if isinstance(x, jax.Array)]
    if not leaves:
        return False
    limit = memory_limit(leaves[0].addressable_shards[0].device)
    if limit is None:
        return False
    gradient = sum(x.nbytes for x in leaves)
    return _whole_bytes(leaves) + _whole_bytes(frozen) + gradient <= AUTO_MEMORY_SHARE * limit


def local_axes(mode: str, mesh: Mesh | None, rules: Mapping, *, is_moe: bool, losses: Sequence,
               row_counts: Sequence[int], auto_local: bool) -> tuple[str, ...] | None:
    """The batch axes over which an update of ``row_counts`` micro-batches accumulates per device under ``mode``
    (``OptimConfig.grad_sync``; ``auto_local``: what :func:`auto_takes_update` said of the weights), or None to
    reduce every micro-batch's gradient. ``update`` that cannot run raises naming why."""
    if mode == "micro_batch" or (mode == "auto" and not auto_local):
        return None
    if mesh is None or mesh.size == 1 or (mode == "auto" and len(row_counts) < 2):
        return None
    why = refusal(mesh, rules, is_moe, losses, row_counts)
    if why is not None:
        if mode == "update":
            raise ValueError(f"OptimConfig.grad_sync='update' cannot accumulate this update per device: {why}; set "
                             f"grad_sync='auto' or 'micro_batch'")
        return None
    return batch_axes(mesh, rules, int(np.min(row_counts)))
