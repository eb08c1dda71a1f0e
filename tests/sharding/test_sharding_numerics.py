"""Sharded == unsharded: logits and gradients of tiny dense and MoE models on 8 fake CPU devices
(meshes (1), (fsdp=8), (data=2, fsdp=2, tensor=2), and (expert=4, fsdp=2), (expert=2, fsdp=2, tensor=2)
for MoE: expert-parallel, tokens gathered over the expert axis; the MoE model with LoRA on its experts too) match the
single-device result, parameters are placed as the rules say, and per-device memory is what the
shape-based report predicts. All of it runs in one child process (see workers/mesh_equivalence.py)."""

from __future__ import annotations

import math

import pytest

RTOL = 1e-5  # float32
CASES = ["dense/single", "dense/fsdp8", "dense/data2_fsdp2_tensor2",
         "moe/single", "moe/fsdp8", "moe/data2_fsdp2_tensor2", "moe/expert4_fsdp2",
         "moe/expert2_fsdp2_tensor2", "moe_lora/single", "moe_lora/expert4_fsdp2", "moe_lora/expert2_fsdp2_tensor2"]


@pytest.fixture(scope="module")
def result(helpers):
    return helpers.run_worker("mesh_equivalence.py", num_devices=8)


@pytest.mark.parametrize("case", CASES)
def test_logits_and_grads_match_single_device(result, case):
    r = result["cases"][case]
    assert r["loss_rel_err"] <= RTOL, r
    assert r["logits_rel_err"] <= RTOL, r
    assert r["grad_max_rel_err"] <= RTOL, (r["grad_worst"], r["grad_max_rel_err"])
    # init_sharded builds the same weights as an eager, unsharded init (jit vs eager: last-bit noise).
    assert r["init_max_abs_diff"] <= 1e-7


@pytest.mark.parametrize("case", CASES)
def test_parameters_placed_as_the_rules_say(result, case):
    r = result["cases"][case]
    assert r["spec_mismatch"] == {}
    specs, shapes = r["specs"], r["shard_shapes"]
    model, mesh_name = case.split("/")
    if mesh_name == "single":
        assert all(all(a is None for a in s) for s in specs.values())
        return
    # Spot checks against DEFAULT_RULES: embed -> fsdp, heads/mlp/vocab -> tensor, expert -> expert.
    # Layers are stacked (one layer here): a leading replicated "layers" axis of size 1.
    q = "layers.attn.q_proj.kernel"  # [1, H=32, N=4, D=8] ("layers", "embed", "heads", "head_dim")
    emb = "embed.embedding"  # [V=64, H=32] ("vocab", "embed")
    assert specs["final_norm.scale"] == [None]
    if mesh_name == "fsdp8":
        assert specs[q] == [None, "fsdp", None, None] and shapes[q] == [[1, 4, 4, 8]]
        assert specs[emb] == [None, "fsdp"] and shapes[emb] == [[64, 4]]
    if mesh_name == "data2_fsdp2_tensor2":
        assert specs[q] == [None, "fsdp", "tensor", None] and shapes[q] == [[1, 16, 2, 8]]
        assert specs[emb] == ["tensor", "fsdp"] and shapes[emb] == [[32, 16]]
        assert specs["lm_head.kernel"] == ["fsdp", "tensor"]
    if model.startswith("moe"):
        gate = "layers.mlp.experts.gate_proj"  # [1, E=4, H=32, I=16] ("layers", "expert", "embed", "expert_mlp")
        down = "layers.mlp.experts.down_proj"  # [1, E, I, H]
        want = {"fsdp8": ([None, None, "fsdp", None], [1, 4, 4, 16]),
                "data2_fsdp2_tensor2": ([None, None, "fsdp", "tensor"], [1, 4, 16, 8]),
                "expert4_fsdp2": ([None, "expert", "fsdp", None], [1, 1, 16, 16]),
                "expert2_fsdp2_tensor2": ([None, "expert", "fsdp", "tensor"], [1, 2, 16, 8])}[mesh_name]
        assert specs[gate] == want[0] and shapes[gate] == [want[1]]
        if mesh_name == "expert4_fsdp2":
            assert specs[down] == [None, "expert", None, "fsdp"]
        if model == "moe_lora":  # adapters split like their expert weight, the rank dim whole
            a, b = "layers.mlp.experts.lora_gate_up_a", "layers.mlp.experts.lora_gate_b"  # [1, E, H, r], [1, E, r, I]
            assert specs[a] == want[0][:3] + [None] and specs[b] == want[0][:2] + [None, want[0][3]]
    else:
        up = "layers.mlp.up_proj.kernel"  # [1, H, I] ("layers", "embed", "mlp")
        assert specs[up] == {"fsdp8": [None, "fsdp", None], "data2_fsdp2_tensor2": [None, "fsdp", "tensor"]}[mesh_name]


@pytest.mark.parametrize("case", CASES)
def test_measured_memory_per_device(result, case):
    """Sum of the addressable shard bytes on each device == the report's prediction ~= total / shards."""
    r = result["cases"][case]
    assert r["measured_devices"] == math.prod(r["mesh"].values())
    assert len(r["measured_bytes_per_device"]) == 1  # every device holds the same amount
    measured = r["measured_bytes_per_device"][0]
    assert measured == r["report_param_bytes_per_device"]
    assert r["abstract_report_equal"]  # the report of an nnx.eval_shape model is the same
    total, replicated = r["report_param_bytes"], r["report_replicated_param_bytes"]
    mesh_name = case.split("/")[1]
    if mesh_name == "single":
        assert measured == total
    elif mesh_name == "fsdp8":  # every weight split 8 ways but the norm scales
        assert total / 8 <= measured <= total / 8 + replicated
    elif mesh_name == "data2_fsdp2_tensor2":  # split over fsdp x tensor = 4, replicated over data
        assert total / 4 <= measured <= 1.05 * total / 4 + replicated
    else:  # expert4_fsdp2 / expert2_fsdp2_tensor2: expert weights split 8 ways, the rest over fsdp (x tensor)
        assert total / 8 < measured < total / 2


def test_expert_parallel_block_gathers_tokens_over_the_expert_axis_only(result):
    """The MoE block with experts split (expert=4, fsdp=2): a device gathers the tokens of the 4 devices that share
    its fsdp index (tokens / fsdp elements), never the whole batch's, and hands their summed outputs back by
    reduce-scatter; no all-to-all and no collective of tokens x top-k rows (the padded exchange it replaces sent
    expert x tokens x top-k row slots)."""
    r = result["moe_collectives"]
    found, tokens = r["collectives"], r["token_elements"]
    assert not found.get("all-to-all"), found
    assert tokens // 2 in found.get("all-gather", []) and tokens // 8 in found.get("reduce-scatter", []), found
    assert all(n <= tokens // 2 for op in ("all-gather", "all-reduce", "reduce-scatter") for n in found.get(op, [])), \
        (found, tokens)


def test_expert_parallel_block_moves_bf16_tokens_and_float32_partial_sums(result):
    """In bfloat16 (expert=4, fsdp=2): the forward gathers the tokens in bf16 and reduce-scatters the float32
    partial sums; the backward gathers the output's cotangent in bf16 (widening it first would double its bytes)
    and reduce-scatters the tokens' gradient in bf16. Nothing token-sized moves in float32 but the partial sums."""
    r = result["moe_collectives_bf16"]
    gathered, owned = r["token_elements"] // 2, r["token_elements"] // 8
    typed = {op: [t for n, t in pairs if n in (gathered, owned)] for op, pairs in r["typed"].items()}
    assert sorted(typed["all-gather"]) == ["bf16", "bf16"], r["typed"]
    assert sorted(typed["reduce-scatter"]) == ["bf16", "f32"], r["typed"]


def test_gathered_experts_block_keeps_each_devices_tokens(result):
    """Without an expert axis (fsdp=8) each device routes and computes its own tokens against the gathered experts:
    the collectives are the weights' gathers and their gradients' reduce-scatters, none larger than the block's
    parameters (left to XLA's partitioner, the block sorted the batch's tokens globally: all-reduces of
    tokens x top-k elements)."""
    r = result["moe_collectives_fsdp8"]
    found, params = r["collectives"], r["param_elements"]
    assert not found.get("all-to-all") and found.get("reduce-scatter"), found  # the experts' gradients scattered
    assert all(n <= params for op in ("all-gather", "all-reduce") for n in found.get(op, [])), (found, params)


@pytest.mark.parametrize("mesh_name, shards", [("fsdp8", 8), ("data2_fsdp2_tensor2", 4)])
def test_measured_memory_of_a_larger_model(result, mesh_name, shards):
    """~4.1M parameters (16 MB float32): each device holds total / shards (+ the replicated norm scales)."""
    r = result["memory"][mesh_name]
    assert r["measured_bytes_per_device"] == [r["report_param_bytes_per_device"]]
    per_device, ideal = r["measured_bytes_per_device"][0], r["total_bytes"] / shards
    assert ideal <= per_device <= ideal + r["replicated_param_bytes"]
    assert per_device / ideal < 1.005


def test_shard_model_equals_init_sharded(result):
    e = result["extra"]
    assert e["shard_model_same_placement"]
    assert e["shard_model_max_abs_diff"] <= 1e-7


def test_optimizer_state_follows_parameters(result):
    e = result["extra"]
    assert e["mu_specs"] == e["param_specs"]
    assert e["nu_specs"] == e["param_specs"]
    assert e["pure_mu_specs"] == e["param_specs"]  # plain dict params: matched by path suffix
    assert e["nnx_mu_specs"] == e["param_specs"]  # nnx.Optimizer placed by shard_model
    assert e["count_replicated"]


def test_models_use_only_known_logical_names(result):
    assert result["extra"]["unknown_logical_axes"] == {}
