"""Gradients accumulated per device over an update (``OptimConfig.grad_sync="update"``): the same updates as one
device's on every data/fsdp layout, padded, packed and LoRA; the updates it cannot take refused by name."""

import pytest
from train_testlib import run_worker


@pytest.fixture(scope="module")
def out():
    return run_worker("grad_sync_worker.py", num_devices=4, timeout=600)


@pytest.mark.parametrize("layout", ["fsdp4", "data2_fsdp2", "data4", "packed", "lora", "one_micro_batch"])
def test_update_equals_one_device(out, layout):
    r = out[layout]
    assert out["devices"] == 4
    # two updates of 2 micro-batches x 8 rows (one of 16 rows: one program per update), each device 2 rows of each:
    # the weights after them, each update's loss (the sum of every device's part of every micro-batch) and gradient
    # norm, those of one device
    assert r["param_err"] <= 1e-5, r
    for mesh_side, one_device in zip(r["loss"][0], r["loss"][1]):
        assert sum(mesh_side) == pytest.approx(sum(one_device), rel=1e-5, abs=1e-7)
    assert [g[0] for g in r["grad_norm"][0]] == pytest.approx([g[0] for g in r["grad_norm"][1]], rel=1e-5)
    # one metric value per device and micro-batch; summed metrics add up to one device's
    assert all(len(v) == r["micro_batches"] * 4 for v in r["loss"][0])
    assert [sum(v) for v in r["num_tokens"][0]] == pytest.approx([sum(v) for v in r["num_tokens"][1]])
    # one per-device program for the micro-batch shape, not one per micro-batch or update
    assert r["programs"] == 1
    if layout != "data4":
        assert r["param_devices"] == 4


def test_auto_keeps_the_per_micro_batch_path_on_a_cpu(out):
    assert out["auto_programs"]["local_micro_step"] == 0
    assert out["auto_programs"]["micro_step"] == 1


def test_a_second_update_compiles_nothing(out):
    """Two updates on a mesh compile each program once: the optimizer state enters the first update spelled as it
    comes out of it (a spec without trailing Nones), or the second compiles every program taking it again."""
    assert out["auto_programs"]["apply_update"] == 1
    assert out["one_micro_batch_programs"]["micro_step_and_apply"] == 1
    assert out["update_programs"]["reduce_and_apply"] == 1


def test_gradients_are_summed_in_their_own_dtype_unless_told(out):
    """The per-device gradients are added up in the gradient's dtype (bfloat16: half the bytes of the float32 that
    ``sum`` adds bfloat16 in), or in ``ModelConfig.grad_reduce_dtype``; the result keeps the gradient's dtype."""
    own, f32 = out["reduce"]["None"], out["reduce"]["float32"]
    assert own["types"] == ["bf16"] and f32["types"] == ["f32"]
    assert own["dtype"] == f32["dtype"] == "bfloat16"
    assert own["rel_err"] <= 1e-2 and f32["rel_err"] <= 1e-2


@pytest.mark.parametrize("case,words", [("bnpo", "GRPOLoss is not a sum over rows"),
                                        ("moe", "MoE"), ("rows", "2 rows does not split evenly")])
def test_refused_updates_name_the_reason_and_the_knob(out, case, words):
    message = out["refused"][case]
    assert words in message and "grad_sync" in message, message


@pytest.mark.parametrize("fsdp,micro_batches,takes", [(2, 1, False), (4, 1, False), (4, 2, True), (2, 2, True)])
def test_auto_accumulates_per_device_for_several_micro_batches_only(fsdp, micro_batches, takes):
    """Where the weights fit (``auto_local``), ``auto`` accumulates per device for every update of several
    micro-batches; an update of one micro-batch it leaves to the FSDP layers' own gathers (measured faster than
    gathering the whole weights once for it); ``update`` takes one micro-batch when told."""
    import types

    from jrl.sharding import DEFAULT_RULES, MeshConfig, abstract_mesh
    from jrl.train.grad_sync import local_axes

    mesh = abstract_mesh(MeshConfig(fsdp=fsdp), fsdp)
    loss = types.SimpleNamespace(rows_separable=True)  # a loss that sums over rows
    kwargs = dict(is_moe=False, losses=[loss] * micro_batches, row_counts=[8] * micro_batches)
    got = local_axes("auto", mesh, DEFAULT_RULES, auto_local=True, **kwargs)
    assert (got == ("fsdp",)) if takes else got is None
    assert local_axes("auto", mesh, DEFAULT_RULES, auto_local=False, **kwargs) is None
    assert local_axes("update", mesh, DEFAULT_RULES, auto_local=False, **kwargs) == ("fsdp",)
