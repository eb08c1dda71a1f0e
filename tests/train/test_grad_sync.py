"""Gradients accumulated per device over an update (``OptimConfig.grad_sync="update"``): the same updates as one
device's on every data/fsdp layout, padded, packed and LoRA; the updates it cannot take refused by name."""

import pytest
from train_testlib import run_worker


@pytest.fixture(scope="module")
def out():
    return run_worker("grad_sync_worker.py", num_devices=4, timeout=600)


@pytest.mark.parametrize("layout", ["fsdp4", "data2_fsdp2", "data4", "packed", "lora"])
def test_update_equals_one_device(out, layout):
    r = out[layout]
    assert out["devices"] == 4
    # two updates of 2 micro-batches x 8 rows, each device 2 rows of each: the weights after them, each update's
    # loss (the sum of every device's part of every micro-batch) and gradient norm, those of one device
    assert r["param_err"] <= 1e-5, r
    for mesh_side, one_device in zip(r["loss"][0], r["loss"][1]):
        assert sum(mesh_side) == pytest.approx(sum(one_device), rel=1e-5, abs=1e-7)
    assert [g[0] for g in r["grad_norm"][0]] == pytest.approx([g[0] for g in r["grad_norm"][1]], rel=1e-5)
    # one metric value per device and micro-batch; summed metrics add up to one device's
    assert all(len(v) == 2 * 4 for v in r["loss"][0])
    assert [sum(v) for v in r["num_tokens"][0]] == pytest.approx([sum(v) for v in r["num_tokens"][1]])
    # one per-device program for the micro-batch shape, not one per micro-batch or update
    assert r["programs"] == 1
    if layout != "data4":
        assert r["param_devices"] == 4


def test_auto_keeps_the_per_micro_batch_path_on_a_cpu(out):
    assert out["auto_cpu_programs"] == 0


@pytest.mark.parametrize("case,words", [("bnpo", "GRPOLoss is not a sum over rows"),
                                        ("moe", "MoE"), ("rows", "2 rows does not split evenly")])
def test_refused_updates_name_the_reason_and_the_knob(out, case, words):
    message = out["refused"][case]
    assert words in message and "grad_sync" in message, message
