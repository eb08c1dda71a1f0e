"""Meshes, logical-axis rules, multi-host initialisation, placement and gathering.

One :class:`MeshConfig` describes the device layout from 1 CPU device to a TPU pod; parameters carry
logical axis names (``logical_axes`` metadata) that the rules map to mesh axes. Typical use::

    from jrl import sharding
    sharding.initialize()                                   # first thing; no-op for one process
    mesh_cfg = sharding.MeshConfig(fsdp=-1, tensor=2)
    mesh, rules = sharding.make_mesh(mesh_cfg), mesh_cfg.logical_rules()
    model = sharding.init_sharded(
        lambda: Transformer(cfg, rngs=nnx.Rngs(0), mesh=mesh, rules=rules), mesh, rules)
    batch = sharding.make_global_batch(local_rows, mesh, rules)  # rows: process_shard(global_batch)
    print(sharding.memory_report(model, mesh, rules))
"""

from jrl.sharding.distributed import (
    any_process,
    barrier,
    batch_sharding,
    batch_shards,
    host_allgather,
    initialize,
    is_main_process,
    launched_processes,
    make_global_batch,
    process_batch_slice,
    process_shard,
)
from jrl.sharding.memory import MemoryReport, device_bytes, memory_limit, memory_report
from jrl.sharding.mesh import MESH_AXES, MeshConfig, abstract_mesh, device_grid, learner_mesh, make_mesh
from jrl.sharding.host_pack import HostPack, unpack
from jrl.sharding.placement import (
    check_placement,
    from_host,
    gather_to_host,
    host_copy,
    init_sharded,
    iter_to_host,
    on_host,
    opt_state_shardings,
    reshard,
    shard_model,
    state_shardings,
    state_specs,
    to_host,
    unknown_logical_axes,
    variable_spec,
)
from jrl.sharding.roles import split_devices
from jrl.sharding.rules import (
    DEFAULT_RULES,
    MeshAxes,
    logical_sharding,
    logical_to_spec,
    merge_rules,
    undivided_dims,
    with_logical_constraint,
)

__all__ = [
    "DEFAULT_RULES",
    "HostPack",
    "MESH_AXES",
    "MemoryReport",
    "MeshAxes",
    "MeshConfig",
    "abstract_mesh",
    "any_process",
    "barrier",
    "batch_sharding",
    "batch_shards",
    "check_placement",
    "device_bytes",
    "device_grid",
    "from_host",
    "gather_to_host",
    "host_allgather",
    "host_copy",
    "init_sharded",
    "initialize",
    "is_main_process",
    "launched_processes",
    "iter_to_host",
    "on_host",
    "logical_sharding",
    "logical_to_spec",
    "make_global_batch",
    "learner_mesh",
    "make_mesh",
    "memory_limit",
    "memory_report",
    "merge_rules",
    "opt_state_shardings",
    "process_batch_slice",
    "process_shard",
    "reshard",
    "shard_model",
    "split_devices",
    "state_shardings",
    "state_specs",
    "to_host",
    "unknown_logical_axes",
    "undivided_dims",
    "unpack",
    "variable_spec",
    "with_logical_constraint",
]
