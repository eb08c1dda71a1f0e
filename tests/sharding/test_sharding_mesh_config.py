"""MeshConfig validation, mesh layout, rules (single device; no child processes)."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jrl import sharding as S


def test_default_is_all_fsdp():
    assert S.MeshConfig().axis_sizes(8) == {"data": 1, "fsdp": 8, "expert": 1, "tensor": 1}
    assert S.MeshConfig(data=2, tensor=2).axis_sizes(16) == {"data": 2, "fsdp": 4, "expert": 1, "tensor": 2}
    assert S.MeshConfig(data=-1, fsdp=1).axis_sizes(4)["data"] == 4
    assert S.MeshConfig(fsdp=2, tensor=4).axis_sizes(8)["fsdp"] == 2


def test_product_mismatch_names_product_and_device_count():
    with pytest.raises(ValueError, match=r"multiply to 6 but there are 8 devices"):
        S.MeshConfig(data=2, fsdp=3).axis_sizes(8)
    with pytest.raises(ValueError, match=r"multiply to 3, which does not divide the 8 available devices"):
        S.MeshConfig(tensor=3).axis_sizes(8)


@pytest.mark.parametrize("kwargs, match", [
    (dict(data=-1, fsdp=-1), r"at most one axis may be -1.*data=-1, fsdp=-1"),
    (dict(tensor=0), r"MeshConfig.tensor=0"),
    (dict(expert=-2), r"MeshConfig.expert=-2"),
    (dict(data=1.5), r"MeshConfig.data=1.5"),
    (dict(rules=(("vocab", "tp"),)), r"unknown: \['tp'\]"),
    (dict(rules=(("vocab",),)), r"\(logical_name, mesh_axes\) pair"),
])
def test_invalid_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        S.MeshConfig(**kwargs)


def test_make_mesh_single_device_and_error():
    mesh = S.make_mesh()
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert dict(mesh.shape) == {"data": 1, "fsdp": jax.device_count(), "expert": 1, "tensor": 1}
    with pytest.raises(ValueError, match=f"multiply to 2 but there are {jax.device_count()} devices"):
        S.make_mesh(S.MeshConfig(fsdp=1, tensor=2))


def test_rules_override_from_config():
    cfg = S.MeshConfig(rules=(("vocab", None), ("batch", ["data"])))
    rules = cfg.logical_rules()
    assert rules["vocab"] is None and rules["batch"] == ("data",)
    assert rules["embed"] == S.DEFAULT_RULES["embed"]
    assert S.DEFAULT_RULES["vocab"] == "tensor"  # the defaults are untouched
    cfg2 = S.MeshConfig(rules=[["mlp", "fsdp"]])  # lists (e.g. from a CLI) are normalised
    assert cfg2.rules == (("mlp", "fsdp"),) and hash(cfg2)


def test_logical_to_spec_on_an_abstract_pod_mesh():
    mesh = S.abstract_mesh(S.MeshConfig(data=2, fsdp=-1, tensor=4), 64)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 8, "expert": 1, "tensor": 4}
    assert S.logical_to_spec(("embed", "mlp"), mesh) == P("fsdp", "tensor")
    # batch takes data and fsdp (expert has size 1 and is dropped); embed finds fsdp already used.
    assert S.logical_to_spec(("batch", "activation_length", "embed"), mesh) == P(("data", "fsdp"), None, None)
    # Indivisible dimension stays replicated instead of failing at placement.
    assert S.logical_to_spec(("embed", "heads"), mesh, shape=(64, 6)) == P("fsdp", None)
    # A mesh axis is used once per tensor.
    assert S.logical_to_spec(("embed", "embed"), mesh) == P("fsdp", None)


def test_multi_slice_devices_go_on_the_data_axis():
    # Fake TPU devices of 2 slices x 4 chips: slices must land on the outermost (data) axis.
    devs = [types.SimpleNamespace(id=i, slice_index=i // 4, process_index=i // 4, platform="tpu",
                                  device_kind="fake", coords=(i % 2, (i % 4) // 2, 0), core_on_chip=0)
            for i in range(8)]
    try:
        grid = S.device_grid(S.MeshConfig(data=2, fsdp=4), devs)
    except Exception as e:  # mesh_utils may insist on real TPU topology info
        pytest.skip(f"mesh_utils cannot lay out fake TPU devices here: {e}")
    assert grid.shape == (2, 4, 1, 1)
    assert {d.slice_index for d in grid[0].flat} == {0} and {d.slice_index for d in grid[1].flat} == {1}
    with pytest.raises(ValueError, match=r"span 2 slices.*data=1 is not a multiple of 2"):
        S.device_grid(S.MeshConfig(data=1, fsdp=8), devs)


def test_device_order_is_process_major_on_cpu():
    devs = [types.SimpleNamespace(id=i, process_index=i // 4, platform="cpu") for i in range(8)]
    grid = S.device_grid(S.MeshConfig(data=2, fsdp=2, tensor=2), devs)
    assert [d.id for d in grid.flat] == list(range(8))
    assert {d.process_index for d in grid[0].flat} == {0}  # the data axis splits processes first
    assert np.asarray(grid).shape == (2, 2, 1, 2)


def test_rollout_devices_come_from_every_process_alike():
    devs = [types.SimpleNamespace(id=i, process_index=i // 4, platform="cpu") for i in range(8)]
    learner, rollout = S.split_devices(4, devs)
    assert [d.id for d in learner] == [0, 1, 4, 5] and [d.id for d in rollout] == [2, 3, 6, 7]
    assert [d.id for d in S.split_devices(2, devs)[1]] == [3, 7]
    assert S.split_devices(0, devs) == (devs, [])
    for bad in (3, 8, 10):  # not a multiple of the 2 processes, or nothing left for the learner
        with pytest.raises(ValueError, match=rf"RolloutConfig.devices={bad}: .* multiple of 2 .* below 8"):
            S.split_devices(bad, devs)


def test_fsdp_takes_the_leading_dimension_of_the_layer_weights():
    """FSDP splits each layer weight on its first dimension that takes it (contiguous blocks for the collectives):
    q/gate kernels on embed, the o/down projections on heads/mlp; a dimension that does not divide falls back."""
    mesh = S.abstract_mesh(S.MeshConfig(fsdp=-1), 8)
    assert S.logical_to_spec(("embed", "heads", "head_dim"), mesh, shape=(2048, 32, 64)) == P("fsdp", None, None)
    assert S.logical_to_spec(("heads", "head_dim", "embed"), mesh, shape=(32, 64, 2048)) == P("fsdp", None, None)
    assert S.logical_to_spec(("mlp", "embed"), mesh, shape=(8192, 2048)) == P("fsdp", None)
    assert S.logical_to_spec(("embed", "mlp"), mesh, shape=(2048, 8192)) == P("fsdp", None)
    assert S.logical_to_spec(("vocab", "embed"), mesh, shape=(1024, 2048)) == P(None, "fsdp")  # the lookup's table
    # 12 heads do not split 8 ways: embed takes fsdp, and nothing is reported as left replicated.
    shape = (12, 64, 2048)
    assert S.logical_to_spec(("heads", "head_dim", "embed"), mesh, shape=shape) == P(None, None, "fsdp")
    assert S.undivided_dims(("heads", "head_dim", "embed"), mesh, None, shape) == []
    # With tensor: the longest leading run of (tensor, fsdp) that divides, fsdp then found by embed.
    mesh = S.abstract_mesh(S.MeshConfig(fsdp=2, tensor=4), 8)
    assert S.logical_to_spec(("heads", "head_dim", "embed"), mesh, shape=shape) == P("tensor", None, "fsdp")
    assert S.logical_to_spec(("heads", "head_dim", "embed"), mesh, shape=(32, 64, 2048)) == P(
        ("tensor", "fsdp"), None, None)
    assert S.undivided_dims(("heads", "head_dim", "embed"), mesh, None, shape) == []
    # A split lost for good is still reported: 6 heads over tensor=4.
    assert S.undivided_dims(("embed", "heads"), mesh, None, (64, 6)) == [(1, "heads", ("tensor",), 4)]


def _learner(mesh=None, *, experts=128, devices=4, local=None, dense=0, expert_bytes=0, memory=None):
    return S.learner_mesh(S.MeshConfig() if mesh is None else mesh, num_experts=experts, devices=devices,
                          local_devices=devices if local is None else local, dense_state_bytes=dense,
                          expert_state_bytes=expert_bytes, device_bytes=memory)


def test_a_moe_model_on_the_default_mesh_of_one_process_trains_expert_parallel():
    assert _learner().axis_sizes(4) == {"data": 1, "fsdp": 1, "expert": 4, "tensor": 1}
    assert _learner(experts=60, devices=2).axis_sizes(2) == {"data": 1, "fsdp": 1, "expert": 2, "tensor": 1}
    rules = (("vocab", None),)
    assert _learner(S.MeshConfig(rules=rules)).rules == rules  # rule overrides alone leave the sizes default
    # (30 + 40 / 4) = 40 bytes per device: past half of 79, within half of 80
    assert _learner(dense=30, expert_bytes=40, memory=79).expert == 1
    assert _learner(dense=30, expert_bytes=40, memory=80).expert == 4


@pytest.mark.parametrize("case, kwargs", [
    ("dense", dict(experts=0)),
    ("sizes_given", dict(mesh=S.MeshConfig(fsdp=4))),
    ("experts_not_divided_by_the_devices", dict(experts=60, devices=8)),
    ("one_device", dict(devices=1)),
    ("several_processes", dict(devices=8, local=4)),
    ("one_device_per_process", dict(devices=8, local=1)),
    ("state_does_not_fit", dict(dense=30, expert_bytes=40, memory=79)),
])
def test_the_learner_keeps_its_mesh_where_expert_parallelism_is_not_the_default(case, kwargs):
    mesh = kwargs.pop("mesh", S.MeshConfig())
    assert _learner(mesh, **kwargs) == mesh
