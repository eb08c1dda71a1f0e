"""A step's host arrays as one byte buffer per device, so that a jitted program starts after one host-to-device copy
per device instead of one per array and device (each copy is a separate transfer with ~0.1 ms of host work before
the program can start).

Without a mesh the buffer is one flat byte array the program copies to its device itself. On a mesh (:meth:`HostPack.of`
with the arrays' shardings) it is one row per device holding that device's blocks of every array, placed row by row on
the devices (on a multi-process mesh each process builds and places only its own devices' rows); inside the program
:meth:`HostPack.unpack` rebuilds the global arrays with those shardings from a ``shard_map`` of the same slices.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec


def _canonical(leaf) -> np.ndarray:
    """``leaf`` as a jitted call would take it (int64 -> int32 without x64)."""
    a = np.asarray(leaf)
    return a.astype(jax.dtypes.canonicalize_dtype(a.dtype), copy=False)


def _layout(blocks: list[np.ndarray]) -> tuple[tuple, int]:
    """(each block's (dtype, shape, offset) back to back in one byte buffer, the buffer's size)."""
    specs, offset = [], 0
    for a in blocks:
        specs.append((a.dtype, a.shape, offset))
        offset += a.nbytes
    return tuple(specs), offset


def _bytes_of(blocks: list[np.ndarray]) -> np.ndarray:
    """One uint8 buffer of ``blocks`` back to back (laid out as :func:`_layout` says)."""
    parts = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in blocks]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def _leaves_of(buffer, specs: tuple) -> list:
    """The arrays of a flat byte ``buffer`` laid out as ``specs`` (static slices and bitcasts)."""
    leaves = []
    for dtype, shape, offset in specs:
        raw = buffer[offset:offset + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize]
        if dtype == np.bool_:
            leaf = raw != 0
        elif dtype.itemsize == 1:
            leaf = jax.lax.bitcast_convert_type(raw, dtype)
        else:
            leaf = jax.lax.bitcast_convert_type(raw.reshape(-1, dtype.itemsize), dtype)
        leaves.append(leaf.reshape(shape))
    return leaves


@jax.tree_util.register_pytree_node_class
class HostPack:
    """A pytree of host arrays packed into one byte buffer (see the module docstring). Dtypes are canonicalised as a
    jitted call would; the layout (structure, dtypes, shapes, offsets, and on a mesh the arrays' partition specs) is
    static, part of the program's key."""

    def __init__(self, buffer, layout: tuple):
        self.buffer, self.layout = buffer, layout

    @classmethod
    def of(cls, tree: Any, shardings: Any = None) -> HostPack:
        """``tree`` packed; ``shardings``: a matching tree of :class:`NamedSharding` on one mesh, or None (one
        device: the buffer stays on the host)."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        arrays = [_canonical(leaf) for leaf in leaves]
        if shardings is None:
            return cls(_bytes_of(arrays), (treedef, _layout(arrays)[0], None))
        placed = treedef.flatten_up_to(shardings)
        mesh = placed[0].mesh
        rows = NamedSharding(mesh, PartitionSpec(mesh.axis_names))
        blocks = [s.devices_indices_map(a.shape) for a, s in zip(arrays, placed)]

        def blocks_of(device) -> list[np.ndarray]:
            return [a[b[device]] for a, b in zip(arrays, blocks)]

        specs, row_bytes = _layout(blocks_of(mesh.devices.flat[0]))  # every device's blocks have these shapes
        device_of_row = {index[0].start or 0: device
                         for device, index in rows.devices_indices_map((mesh.size, row_bytes)).items()}

        def row(index):
            return _bytes_of(blocks_of(device_of_row[index[0].start or 0]))[None]

        buffer = jax.make_array_from_callback((mesh.size, row_bytes), rows, row)
        return cls(buffer, (treedef, specs, (mesh, tuple(s.spec for s in placed))))

    def tree_flatten(self):
        return (self.buffer,), self.layout

    @classmethod
    def tree_unflatten(cls, layout, children):
        return cls(children[0], layout)

    def unpack(self) -> Any:
        """The packed tree (jax arrays; inside a jitted program, views of its one input buffer, on a mesh with the
        shardings it was packed with)."""
        treedef, specs, placement = self.layout
        if placement is None:
            return jax.tree_util.tree_unflatten(treedef, _leaves_of(self.buffer, specs))
        mesh, leaf_specs = placement
        per_device = jax.shard_map(lambda rows: tuple(_leaves_of(rows[0], specs)), mesh=mesh, check_vma=False,
                                   in_specs=PartitionSpec(mesh.axis_names), out_specs=leaf_specs)
        return jax.tree_util.tree_unflatten(treedef, list(per_device(self.buffer)))


def unpack(tree: Any) -> Any:
    """The arrays of a :class:`HostPack`; any other tree as it is."""
    return tree.unpack() if isinstance(tree, HostPack) else tree
