"""Explicit FSDP collectives for code that runs per device (inside ``jax.shard_map``): a weight's shards gathered
for compute, its gradient reduce-scattered back to the shards.

Under XLA's automatic partitioning the place and the form of these collectives are the partitioner's choice; for
the LM head it may split the matmul on the hidden dimension and all-reduce float32 logits. Code that calls
:func:`gather_shards` itself decides where the gather happens (:mod:`jrl.models.fsdp`: inside each layer's
rematerialisation checkpoint) and that the backward moves each gradient once, in a chosen dtype.

The functions here must run inside ``jax.shard_map(..., check_vma=False)``: the gradient of a gathered weight is
reduce-scattered over the axes it was gathered over; over the mesh axes its shard is replicated on (``data``,
say), shard_map's own transpose sums it when the backward leaves the map.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from jrl.sharding.rules import logical_to_spec, mesh_axes, undivided_dims

#: (dimension, mesh axes) pairs: where a shard is split, as read from its PartitionSpec.
Gathers = tuple[tuple[int, tuple[str, ...]], ...]


def spec_gathers(spec: PartitionSpec, ndim: int, skip: int = 0) -> Gathers:
    """The sharded dimensions of an array of rank ``ndim`` placed with ``spec``, each with its mesh axes; the first
    ``skip`` dimensions are left out and the rest numbered from 0 (``skip=1``: one layer of a stacked parameter)."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    out = []
    for dim, axes in enumerate(entries[skip:]):
        if axes is not None:
            out.append((dim, mesh_axes(axes)))
    return tuple(out)


def _dtype(name: str | None, default) -> jnp.dtype:
    return jnp.dtype(default if name is None else name)


def gather_shards(shard: jax.Array, gathers: Gathers, dtype: str | None = None,
                  reduce_dtype: str | None = None) -> jax.Array:
    """The whole array of a per-device ``shard`` split as ``gathers`` says (:func:`spec_gathers`), cast to ``dtype``
    before it moves (None: its own; integer arrays are never cast); the backward reduce-scatters the gradient over
    the same axes in ``reduce_dtype`` (None: the shard's dtype) and returns it in the shard's dtype.

    Without ``gathers`` it is a cast whose gradient shard_map's transpose sums (module docstring)."""
    if not jnp.issubdtype(shard.dtype, jnp.floating):
        dtype = None
    return _gather(shard, tuple(gathers), dtype, reduce_dtype, jnp.dtype(shard.dtype).name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _gather(shard, gathers, dtype, reduce_dtype, shard_dtype):
    return _gather_fwd(shard, gathers, dtype, reduce_dtype, shard_dtype)[0]


def _gather_fwd(shard, gathers, dtype, reduce_dtype, shard_dtype):
    x = shard.astype(_dtype(dtype, shard_dtype))
    for dim, axes in gathers:
        x = jax.lax.all_gather(x, axes, axis=dim, tiled=True)
    return x, None


def _gather_bwd(gathers, dtype, reduce_dtype, shard_dtype, _, ct):
    ct = ct.astype(_dtype(reduce_dtype, shard_dtype))
    for dim, axes in reversed(gathers):
        ct = jax.lax.psum_scatter(ct, axes, scatter_dimension=dim, tiled=True)
    return (ct.astype(shard_dtype),)


_gather.defvjp(_gather_fwd, _gather_bwd)


def batch_axes(mesh: Mesh, rules: Mapping, rows: int) -> tuple[str, ...] | None:
    """The mesh axes of size > 1 that the ``batch`` rule splits rows over, or None when ``rows`` does not divide
    among them (the caller then keeps the automatic partitioning)."""
    if undivided_dims(("batch",), mesh, rules, (rows,)):
        return None
    return mesh_axes(logical_to_spec(("batch",), mesh, rules, (rows,))[0])


def only_axes(mesh: Mesh, allowed: Sequence[str]) -> bool:
    """Whether every mesh axis of size > 1 is one of ``allowed``."""
    return all(size == 1 or name in allowed for name, size in mesh.shape.items())
