"""Logical-axis rules: how the logical names carried by every parameter map to mesh axes.

Every parameter of a jrl model carries a ``logical_axes`` metadata tuple (one name or ``None`` per
dimension, e.g. ``("embed", "mlp")``). A rule table maps each logical name to a mesh axis, a tuple of
mesh axes, or ``None`` (replicated). Mesh axes of size 1 or absent from the mesh are dropped, so one
table serves every mesh from a single CPU device to a pod.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MeshAxes = str | tuple[str, ...] | None

#: Default logical -> mesh axis rules: tensor parallelism on heads / MLP / vocab, expert parallelism on the expert
#: dimension, FSDP on the leading dimension of the layers' weights (``embed`` of the q/k/v and gate/up kernels,
#: ``heads`` and ``mlp`` of the output projections, whose ``embed`` comes last and then finds ``fsdp`` taken). A
#: weight split on its leading dimension is gathered and its gradient reduce-scattered as contiguous blocks; split on
#: its last one, every step transposed the stacked weights, their gradients and the optimizer update around the
#: collectives (a GPU's NCCL moves contiguous blocks only; ``benchmarks/RESULTS.md``, "Scale-out"); PyTorch's FSDP2
#: shards dimension 0 of every parameter for the same reason. The embedding table keeps FSDP on ``embed``: split on
#: the vocabulary, XLA's partitioning of the token lookup gathers the whole table and all-reduces its gradient. The
#: batch is split over every axis but ``tensor``: with expert parallelism the attention and dense layers still use
#: all devices, and the MoE layers gather tokens over the expert axis.
DEFAULT_RULES: dict[str, MeshAxes] = {
    "batch": ("data", "fsdp", "expert"),
    "activation_length": None,
    "embed": "fsdp",
    "vocab": "tensor",
    "mlp": ("tensor", "fsdp"),
    "heads": ("tensor", "fsdp"),
    "kv_heads": "tensor",
    "head_dim": None,
    "expert": "expert",
    "expert_mlp": "tensor",
    "norm": None,
    "lora_rank": None,
    "layers": None,
}


def mesh_axes(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of a rule's target or of one PartitionSpec entry (None, an axis name, or names)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def merge_rules(
    overrides: Mapping[str, MeshAxes] | Sequence[tuple[str, MeshAxes]] = (),
    base: Mapping[str, MeshAxes] | None = None,
) -> dict[str, MeshAxes]:
    """``base`` (default :data:`DEFAULT_RULES`) updated with ``overrides`` (a mapping or pairs)."""
    merged = dict(DEFAULT_RULES if base is None else base)
    items = overrides.items() if isinstance(overrides, Mapping) else overrides
    for name, target in items:
        merged[name] = tuple(target) if isinstance(target, list) else target
    return merged


def logical_to_spec(
    logical_axes: Sequence[str | None],
    mesh: Mesh,
    rules: Mapping[str, MeshAxes] | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """PartitionSpec for a tensor with ``logical_axes`` on ``mesh``.

    A mesh axis is used at most once per tensor (the first dimension that asks for it wins), axes of
    size 1 are dropped, and when ``shape`` is given a dimension that does not divide evenly by its mesh
    axes stays replicated rather than failing at placement time; a later dimension may then take those
    axes (:func:`undivided_dims` lists the axes no dimension took; model placement warns of them,
    :func:`jrl.sharding.check_placement`).
    """
    return _resolve(logical_axes, mesh, rules, shape)[0]


def undivided_dims(
    logical_axes: Sequence[str | None],
    mesh: Mesh,
    rules: Mapping[str, MeshAxes] | None,
    shape: Sequence[int],
) -> list[tuple[int, str, tuple[str, ...], int]]:
    """(dimension, logical name, mesh axes, their size) of each dimension of a ``shape`` tensor that its rule would
    shard but that stays replicated because its size does not divide by the mesh axes' product, where no other
    dimension of the tensor took those axes instead."""
    return _resolve(logical_axes, mesh, rules, shape)[1]


def _resolve(logical_axes, mesh, rules, shape):
    rules = DEFAULT_RULES if rules is None else rules
    used: set[str] = set()
    spec: list[MeshAxes] = []
    undivided = []
    for dim, name in enumerate(logical_axes):
        target = rules.get(name) if name is not None else None
        axes = tuple(a for a in mesh_axes(target) if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        if shape is not None and axes:
            # The longest leading run of the axes that divides the dimension ("tensor" kept where "fsdp" too
            # would not divide it).
            kept = next(axes[:k] for k in range(len(axes), -1, -1)
                        if shape[dim] % math.prod(mesh.shape[a] for a in axes[:k]) == 0)
            if kept != axes:
                undivided.append((dim, name, axes, math.prod(mesh.shape[a] for a in axes)))
            axes = kept
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec), [u for u in undivided if not used.issuperset(u[2])]


def logical_sharding(
    logical_axes: Sequence[str | None],
    mesh: Mesh,
    rules: Mapping[str, MeshAxes] | None = None,
    shape: Sequence[int] | None = None,
) -> NamedSharding:
    """NamedSharding for a tensor with ``logical_axes`` on ``mesh`` (see :func:`logical_to_spec`)."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, mesh, rules, shape))


def with_logical_constraint(x: jax.Array, logical_axes: Sequence[str | None], mesh: Mesh | None,
                            rules: Mapping[str, MeshAxes] | None = None) -> jax.Array:
    """Activation sharding constraint by logical names; a no-op without a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, logical_sharding(logical_axes, mesh, rules, x.shape))
