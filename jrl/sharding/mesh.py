"""``MeshConfig`` and ``make_mesh``: one typed mesh description from 1 CPU device to a TPU pod.

The mesh always has the four axes of :data:`MESH_AXES` (size-1 axes included), so the logical-axis
rules never need to know which axes a given run uses: :func:`jrl.sharding.logical_to_spec` drops
axes of size 1. The axis order puts ``data`` outermost (slowest links: across slices / hosts) and
``tensor`` innermost (the most communication-hungry axis gets the nearest devices on the ICI torus).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jrl.sharding.rules import MeshAxes, merge_rules

#: Mesh axis names, outermost first.
MESH_AXES: tuple[str, ...] = ("data", "fsdp", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """How the devices are laid out. The product of the four sizes is the device count; one size may
    be ``-1`` ("all remaining devices"). The default (``fsdp=-1``) is pure FSDP over every device,
    which is right for a single host and a good start on a pod; for a mixture-of-experts model on the
    devices of one process the trainer makes the default sizes expert parallel (:func:`learner_mesh`)."""

    data: int = 1
    """Pure data parallelism: replicas of the (otherwise sharded) model, each on its own share of the
    batch. On a multi-slice TPU pod the slices are laid out along this axis (it must be a multiple
    of the slice count)."""
    fsdp: int = -1
    """Fully sharded data parallelism: parameters and optimizer state sharded on their ``embed``
    dimension, the batch split too. ``-1`` = all devices not used by the other axes."""
    tensor: int = 1
    """Tensor (model) parallelism: heads, MLP and vocabulary dimensions sharded; the batch is not
    split on it. Keep it within one host (it is the innermost axis)."""
    expert: int = 1
    """Expert parallelism for MoE layers: the expert dimension of expert weights sharded."""
    rules: tuple[tuple[str, MeshAxes], ...] = ()
    """Overrides of the logical-axis rules, e.g. ``(("vocab", None), ("batch", ("data", "fsdp",
    "expert")))``; merged over :data:`jrl.sharding.DEFAULT_RULES` by :meth:`logical_rules`."""

    def __post_init__(self):
        for name in MESH_AXES:
            size = getattr(self, name)
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or (size < 1 and size != -1):
                raise ValueError(
                    f"MeshConfig.{name}={size!r}: each axis size must be a positive integer, or -1 for "
                    "'all remaining devices'"
                )
        wild = [n for n in MESH_AXES if getattr(self, n) == -1]
        if len(wild) > 1:
            raise ValueError(
                f"MeshConfig: at most one axis may be -1, got {', '.join(f'{n}=-1' for n in wild)}; "
                "give all but one of them an explicit size"
            )
        object.__setattr__(self, "rules", tuple(tuple(r) for r in self.rules))
        for rule in self.rules:
            if len(rule) != 2 or not isinstance(rule[0], str):
                raise ValueError(
                    f"MeshConfig.rules entry {rule!r}: each rule is a (logical_name, mesh_axes) pair, "
                    "e.g. ('vocab', 'tensor') or ('batch', ('data', 'fsdp')) or ('vocab', None)"
                )
            target = rule[1]
            axes = (target,) if isinstance(target, str) else tuple(target or ())
            bad = [a for a in axes if a not in MESH_AXES]
            if bad or not (target is None or isinstance(target, (str, tuple, list))):
                raise ValueError(
                    f"MeshConfig.rules entry {rule!r}: mesh axes must be None, one of {MESH_AXES} or a "
                    f"tuple of them; unknown: {bad or target!r}"
                )

    @property
    def axis_names(self) -> tuple[str, ...]:
        return MESH_AXES

    def axis_sizes(self, num_devices: int) -> dict[str, int]:
        """The four axis sizes for ``num_devices`` devices (``-1`` resolved); a clear error when the
        sizes cannot tile that many devices."""
        sizes = {n: int(getattr(self, n)) for n in MESH_AXES}
        fixed = math.prod(s for s in sizes.values() if s != -1)
        desc = ", ".join(f"{n}={s}" for n, s in sizes.items())
        wild = [n for n, s in sizes.items() if s == -1]
        if wild:
            if num_devices % fixed:
                raise ValueError(
                    f"MeshConfig({desc}): the fixed axes multiply to {fixed}, which does not divide the "
                    f"{num_devices} available devices, so {wild[0]}=-1 cannot take the rest; choose "
                    f"sizes whose product divides {num_devices}"
                )
            sizes[wild[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ValueError(
                f"MeshConfig({desc}): the axis sizes multiply to {fixed} but there are {num_devices} "
                f"devices; make the product {num_devices}, or set one axis to -1 to take the rest"
            )
        return sizes

    def logical_rules(self) -> dict[str, MeshAxes]:
        """:data:`DEFAULT_RULES` with this config's ``rules`` overrides applied."""
        return merge_rules(self.rules)


#: The share of a device's memory that the expert-parallel default of :func:`learner_mesh` may fill with the training
#: state (parameters, gradients, optimizer state); the rest is left to activations. Past it the default stays FSDP.
EXPERT_DEFAULT_STATE_FRACTION = 0.5


def learner_mesh(mesh: MeshConfig, *, num_experts: int, devices: int, local_devices: int, dense_state_bytes: int,
                 expert_state_bytes: int, device_bytes: int | None) -> MeshConfig:
    """The layout the learner trains with on ``devices`` devices (``local_devices`` of them in this process):
    ``mesh`` as configured, except that the default sizes (FSDP over every device) become expert parallel over
    every device (``expert = devices``, ``fsdp = 1``) for a mixture-of-experts model whose ``num_experts`` they
    divide, when one process drives them all. On two H200s this ran a Qwen3-30B-A3B layer's forward + backward
    1.82x and its LoRA update 1.26x faster than the experts gathered over FSDP (``benchmarks/RESULTS.md``,
    nineteenth session). Every device then holds the non-expert weights whole, so the default stays FSDP where the
    training state per device, ``dense_state_bytes + expert_state_bytes / devices``, would take more than
    :data:`EXPERT_DEFAULT_STATE_FRACTION` of ``device_bytes`` (``None``, as CPU devices report: no limit). Expert
    parallelism with FSDP beside it (several processes or hosts, or more devices than the expert count divides)
    stays a choice (``--mesh.expert E --mesh.fsdp F``): its non-expert layers run on XLA's partitioner, not the
    per-device FSDP path, and it has not been measured."""
    if num_experts <= 0 or any(getattr(mesh, n) != getattr(_DEFAULT_SIZES, n) for n in MESH_AXES):
        return mesh
    if devices < 2 or devices != local_devices or num_experts % devices:
        return mesh
    if device_bytes and dense_state_bytes + expert_state_bytes / devices > EXPERT_DEFAULT_STATE_FRACTION * device_bytes:
        return mesh
    return dataclasses.replace(mesh, fsdp=1, expert=devices)


_DEFAULT_SIZES = MeshConfig()


def _slice_index(device: Any) -> int:
    return int(getattr(device, "slice_index", 0) or 0)


def device_grid(cfg: MeshConfig, devices: Sequence[Any]) -> np.ndarray:
    """The ``devices`` arranged as an array of shape ``(data, fsdp, expert, tensor)``.

    Uses ``mesh_utils`` so TPU devices are laid out along the physical torus; on a multi-slice pod
    (devices with several ``slice_index`` values) the slices go on the ``data`` axis (over DCN)."""
    from jax.experimental import mesh_utils

    devices = list(devices)
    sizes = cfg.axis_sizes(len(devices))
    shape = tuple(sizes[n] for n in MESH_AXES)
    slices = sorted({_slice_index(d) for d in devices})
    if len(slices) > 1:
        n_slices = len(slices)
        if sizes["data"] % n_slices:
            raise ValueError(
                f"MeshConfig: the devices span {n_slices} slices, which are laid out on the 'data' "
                f"axis, but data={sizes['data']} is not a multiple of {n_slices}; set data to a "
                f"multiple of {n_slices}"
            )
        ici = (sizes["data"] // n_slices, sizes["fsdp"], sizes["expert"], sizes["tensor"])
        dcn = (n_slices, 1, 1, 1)
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)
    if devices[0].platform == "tpu":
        try:
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        except (ValueError, NotImplementedError, AssertionError):
            pass  # unusual topology: fall back to the plain order below
    # CPU / GPU: keep the given order (process-major, so each host's devices stay contiguous).
    return np.asarray(devices, dtype=object).reshape(shape)


def make_mesh(cfg: MeshConfig | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``Mesh`` with axes ``('data', 'fsdp', 'expert', 'tensor')`` over ``devices`` (default: every
    device of every process, ``jax.devices()``), sized by ``cfg`` (default ``MeshConfig()``: all FSDP).

    The mesh uses ``AxisType.Auto`` axes: shardings are given by the placed parameters and by the
    logical constraints, and XLA's partitioner fills in the rest."""
    cfg = MeshConfig() if cfg is None else cfg
    devices = jax.devices() if devices is None else list(devices)
    grid = device_grid(cfg, devices)
    axis_type = getattr(jax.sharding, "AxisType", None)
    if axis_type is not None:
        return Mesh(grid, MESH_AXES, axis_types=(axis_type.Auto,) * len(MESH_AXES))
    return Mesh(grid, MESH_AXES)


def abstract_mesh(cfg: MeshConfig | None, num_devices: int) -> jax.sharding.AbstractMesh:
    """A device-free mesh of ``num_devices`` laid out by ``cfg``: for planning (e.g. a pod's
    :func:`jrl.sharding.memory_report`) on a machine that does not have those devices."""
    cfg = MeshConfig() if cfg is None else cfg
    sizes = cfg.axis_sizes(num_devices)
    axis_type = getattr(jax.sharding, "AxisType", None)
    kwargs = {"axis_types": (axis_type.Auto,) * len(MESH_AXES)} if axis_type is not None else {}
    return jax.sharding.AbstractMesh(tuple(sizes[n] for n in MESH_AXES), MESH_AXES, **kwargs)
