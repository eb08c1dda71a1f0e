"""The per-device FSDP path (jrl.models.fsdp) computes what XLA's partitioning and one device compute: loss, log-probs,
entropies, intermediate layers' outputs (EBFT's features) and every gradient of a 3-layer model through its token
lookup, scanned layers and loss-fused head, full and LoRA, on fsdp and data x fsdp meshes of 8 fake CPU devices; the
head's weight is gathered once and its gradient reduce-scattered once; the token lookup moves rows by all-to-all; a
bfloat16 gradient reduction changes the gradients by bf16 rounding only; under a remat policy the layers' weights are
gathered again in the backward, not kept; in groups (``fsdp_layers_per_gather``) each group's weights are gathered once
(see workers/fsdp_prefetch.py)."""

from __future__ import annotations

import pytest

RTOL = 1e-5  # float32
CASES = [f"{kind}/{mesh}" for kind in ("full", "lora") for mesh in ("fsdp8", "data2_fsdp4", "fsdp4_of_4")]


@pytest.fixture(scope="module")
def result(helpers):
    return helpers.run_worker("fsdp_prefetch.py", num_devices=8)


@pytest.mark.parametrize("case", CASES)
def test_per_device_path_matches_one_device_and_xla(result, case):
    r = result["cases"][case]
    for other in ("vs_single", "vs_xla", "xla_vs_single"):
        errs = r[other]
        assert errs["finite"], (other, errs)
        assert max(errs["loss"], errs["lp"], errs["ent"], errs["layers"], errs["grad"]) <= RTOL, (other, errs)


@pytest.mark.parametrize("case", ["full/fsdp8", "full/data2_fsdp4"])
def test_head_weight_gathered_once_and_its_gradient_reduced_once(result, case):
    explicit = result["collectives"][case]["explicit"]
    assert explicit.get("all-gather") == 1 and explicit.get("reduce-scatter") == 1, explicit


@pytest.mark.parametrize("case", ["full/fsdp8", "full/data2_fsdp4", "lora/fsdp8"])
def test_token_lookup_moves_rows_not_the_table(result, case):
    """Each device looks up its FSDP group's tokens in its own table columns: one all-to-all of the rows' vectors
    forward and, where the table trains, one backward (XLA's partitioning of the lookup gathers the table instead)."""
    c = result["collectives"][case]
    assert c["lookup_all_to_alls"] == (1 if case.startswith("lora") else 2) and c["xla_all_to_alls"] == 0, c


def test_bfloat16_gradient_reduction_rounds_only(result):
    r = result["bf16_reduce"]
    assert r["finite"]
    assert max(r["loss"], r["lp"], r["ent"]) <= RTOL, r  # the forward is unchanged
    assert 1e-5 < r["grad"] <= 1e-2, r  # the reduce-scatter runs in bf16: rounding, nothing worse


def test_layer_weights_gathered_again_in_the_backward_under_a_remat_policy(result):
    r = result["regather"]
    errs = r["vs_single"]
    assert errs["finite"] and max(errs["loss"], errs["lp"], errs["ent"], errs["layers"], errs["grad"]) <= RTOL, errs
    # remat "none" keeps the gathered weights (gathers in the forward's loop only); a policy gathers in the backward's
    # loop too (static counts: the loops hold two layers per iteration and a remainder).
    assert r["gathers_kept"] >= 2 and r["gathers"] > r["gathers_kept"], r


def test_layers_gathered_in_groups_compute_the_same_and_gather_each_group_once(result):
    """``fsdp_layers_per_gather=2`` on 3 layers: a group of 2 layers and the remaining 1, each
    weight gathered once per group (gate and up: one all-gather each per group, none of a single layer's kernel),
    nothing gathered in the backward under the remat policy that makes the per-layer program gather again; loss,
    log-probs, entropies, layer outputs and gradients those of one device and of the per-layer program; and with
    ``fsdp_layers_per_gather=1`` (3 one-layer groups) those of one device."""
    r = result["groups"]
    for other in ("vs_single", "vs_per_layer", "ones_vs_single"):
        errs = r[other]
        assert errs["finite"] and max(errs["loss"], errs["lp"], errs["ent"], errs["layers"], errs["grad"]) <= RTOL, \
            (other, errs)
    assert r["group_gathers"] == {"2": 2, "1": 2}, r
    assert r["layer_gathers"] == 0, r
