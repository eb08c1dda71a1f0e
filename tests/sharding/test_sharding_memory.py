"""memory_report on an abstract (never allocated) model and a device-free pod mesh."""

from __future__ import annotations

import jax
import optax
import pytest
from flax import nnx

from jrl import sharding as S
from jrl.models import ModelConfig, Transformer

# Qwen3-30B-A3B's shapes with 4 of its 48 layers (bfloat16 parameters).
CFG = ModelConfig(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                  num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128, qk_norm=True,
                  num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, dtype="bfloat16",
                  param_dtype="bfloat16")


@pytest.fixture(scope="module")
def abstract_model():
    return nnx.eval_shape(lambda: Transformer(CFG, rngs=nnx.Rngs(0)))


def test_abstract_model_on_a_pod_mesh(abstract_model):
    assert isinstance(nnx.state(abstract_model, nnx.Param)["embed"]["embedding"].get_value(), jax.ShapeDtypeStruct)
    mesh = S.abstract_mesh(S.MeshConfig(fsdp=-1), 64)
    r = S.memory_report(abstract_model, mesh, optimizer="adamw")
    n = CFG.num_params()
    assert r.param_count == r.trainable_count == n
    assert r.param_bytes == 2 * n
    # Pure FSDP over 64: everything but the norm scales is split 64 ways.
    assert r.param_bytes / 64 <= r.param_bytes_per_device <= r.param_bytes / 64 + r.replicated_param_bytes
    assert r.replicated_param_bytes < 1e-3 * r.param_bytes
    assert r.grad_bytes_per_device == r.param_bytes_per_device
    # AdamW: mu and nu like the parameters (bfloat16 here), plus replicated step counts.
    assert 2 * r.param_bytes_per_device <= r.opt_state_bytes_per_device <= 2 * r.param_bytes_per_device + 64
    assert r.total_bytes_per_device == r.param_bytes_per_device + r.grad_bytes_per_device + r.opt_state_bytes_per_device
    text = str(r)
    assert "64 devices" in text and "per device" in text


def test_expert_and_tensor_axes_and_optimizer_choice(abstract_model):
    fsdp = S.memory_report(abstract_model, S.abstract_mesh(S.MeshConfig(fsdp=8), 8), optimizer=None)
    ep = S.memory_report(abstract_model, S.abstract_mesh(S.MeshConfig(fsdp=8, expert=8), 64), optimizer=None)
    tp = S.memory_report(abstract_model, S.abstract_mesh(S.MeshConfig(fsdp=8, tensor=8), 64), optimizer=None)
    assert fsdp.opt_state_bytes == 0
    # Expert weights split over expert x fsdp = 64, the norm scales whole, everything else over fsdp = 8.
    expert_bytes = 2 * CFG.num_hidden_layers * 3 * CFG.num_experts * CFG.hidden_size * CFG.moe_intermediate_size
    whole = ep.replicated_param_bytes
    rest = ep.param_bytes - expert_bytes - whole
    assert ep.param_bytes_per_device == expert_bytes // 64 + rest // 8 + whole
    assert tp.param_bytes_per_device < fsdp.param_bytes_per_device / 3
    mesh8 = S.abstract_mesh(S.MeshConfig(fsdp=8), 8)
    sgd = S.memory_report(abstract_model, mesh8, optimizer=optax.sgd(0.1, momentum=0.9))
    assert sgd.opt_state_bytes == sgd.param_bytes  # one momentum buffer
    with pytest.raises(ValueError, match="not an optax function"):
        S.memory_report(abstract_model, S.abstract_mesh(S.MeshConfig(fsdp=8), 8), optimizer="adamz")


def test_lora_style_trainable_subset(abstract_model):
    """wrt= restricts gradients and optimizer state to a subset (here: only the norm scales)."""
    mesh = S.abstract_mesh(S.MeshConfig(fsdp=4), 4)
    full = S.memory_report(abstract_model, mesh)
    norms = S.memory_report(abstract_model, mesh, wrt=nnx.All(nnx.Param, nnx.PathContains("final_norm")))
    assert norms.param_bytes == full.param_bytes
    assert norms.trainable_count == CFG.hidden_size
    assert norms.opt_state_bytes_per_device < 1e-4 * full.opt_state_bytes_per_device
