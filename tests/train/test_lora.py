"""LoRA adapters: identity at init, merge equals the adapted forward, only adapters train, base reference."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from train_testlib import grpo_learner, random_step_batch, tiny_model

from jrl.losses import GRPOConfig
from jrl.models import named_params
from jrl.models.lora import (
    MOE_LORA_TARGETS,
    ExpertsLoRA,
    LoraConfig,
    LoRAParam,
    apply_lora,
    lora_disabled,
    lora_layers,
    merge_lora,
)
from jrl.train.config import OptimConfig


def _ids(seed=0, n=2, s=7):
    return jnp.asarray(np.random.default_rng(seed).integers(0, 262, (n, s)), jnp.int32)


def _randomize_b(model, seed=1, std=0.3):
    for i, layer in enumerate(lora_layers(model).values()):
        layer.lora_b.set_value(jax.random.normal(jax.random.key(seed + i), layer.lora_b[...].shape) * std)


def test_fresh_adapter_is_identity_and_disabled_is_base():
    model = tiny_model(seed=0)
    base = model(_ids())
    apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    assert set(p.rsplit(".", 1)[-1] for p in lora_layers(model)) == set(LoraConfig().target_modules)
    np.testing.assert_array_equal(np.asarray(model(_ids())), np.asarray(base))
    _randomize_b(model)
    adapted = model(_ids())
    assert float(jnp.max(jnp.abs(adapted - base))) > 1e-2
    with lora_disabled(model):
        np.testing.assert_array_equal(np.asarray(model(_ids())), np.asarray(base))
    np.testing.assert_array_equal(np.asarray(model(_ids())), np.asarray(adapted))


@pytest.mark.parametrize("use_rslora", [False, True])
def test_merge_equals_adapted_forward(use_rslora):
    model = tiny_model(seed=2)
    cfg = LoraConfig(rank=4, alpha=8.0, use_rslora=use_rslora, target_modules=("q_proj", "v_proj", "down_proj"))
    apply_lora(model, cfg, seed=3)
    _randomize_b(model)
    layer = next(iter(lora_layers(model).values()))
    assert layer.scale == pytest.approx(8.0 / (2.0 if use_rslora else 4.0))
    merged = merge_lora(model)
    assert not lora_layers(merged) and set(named_params(merged)) == {
        k for k in named_params(model) if not k.endswith(("lora_a", "lora_b"))}
    ref = model(_ids(1))
    np.testing.assert_allclose(np.asarray(merged(_ids(1))), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(ref))))
    # The merged q kernel is W + s * A @ B with PEFT's layout convention.
    q = model.layers.attn.q_proj  # stacked layers: layer 0 of each parameter
    a = np.asarray(q.lora_a[...][0]).reshape(32, 4)
    b = np.asarray(q.lora_b[...][0]).reshape(4, -1)
    want = np.asarray(q.kernel[...][0]).reshape(32, -1) + layer.scale * a @ b
    np.testing.assert_allclose(np.asarray(merged.layers.attn.q_proj.kernel[...][0]).reshape(32, -1), want,
                               rtol=1e-5, atol=1e-6)


def test_only_adapters_train_and_reference_is_base():
    model = tiny_model(seed=4)
    base_lp_model = tiny_model(seed=4)
    apply_lora(model, LoraConfig(rank=2, alpha=4.0), seed=0)
    base_before = {k: np.asarray(v[...]) for k, v in named_params(model).items() if not k.endswith(("lora_a", "lora_b"))}
    algo = GRPOConfig(num_generations=2, beta=0.1, metrics="basic")
    learner, update = grpo_learner(model, algo, OptimConfig(learning_rate=1e-2), total_updates=2)
    leaves = jax.tree_util.tree_leaves(learner.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    assert leaves and all(isinstance(v, LoRAParam) for v in leaves)
    batch = random_step_batch(seed=5)
    ref = learner.evaluate(update.logprobs, batch, disable_lora=True)
    plain, plain_update = grpo_learner(base_lp_model, dataclasses.replace(algo, beta=0.0), total_updates=1)
    np.testing.assert_allclose(ref, plain.evaluate(plain_update.logprobs, batch), rtol=1e-5, atol=1e-5)
    metrics = update(learner, batch)
    assert "kl" in metrics and np.isfinite(metrics["loss"])
    after = learner.model
    for k, v in named_params(after).items():
        if k in base_before:
            np.testing.assert_array_equal(np.asarray(v[...]), base_before[k], err_msg=k)
    b_norm = sum(float(jnp.sum(jnp.abs(layer.lora_b[...]))) for layer in lora_layers(after).values())
    assert b_norm > 0  # B moved off zero: the gradient reached the adapters
    # After the update, the adapters change the policy while the reference (disabled) does not move.
    np.testing.assert_allclose(learner.evaluate(update.logprobs, batch, disable_lora=True), ref, rtol=1e-6, atol=1e-6)
    assert np.max(np.abs(learner.evaluate(update.logprobs, batch) - ref)) > 1e-6


def test_expert_lora_trains_only_adapters_and_merges():
    """LoRA on the experts, router and q_proj of a MoE model: identity when fresh; a GRPO update moves every
    adapter's B off zero and no base weight; the merged model computes the adapted forward."""
    model = tiny_model(seed=6, model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16)
    base = np.asarray(model(_ids()))
    apply_lora(model, LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj",), target_parameters=MOE_LORA_TARGETS))
    # B = 0 adds exact zeros; the grouped matmuls of the LoRA path may round differently (float32 tolerance).
    np.testing.assert_allclose(np.asarray(model(_ids())), base, rtol=1e-5, atol=1e-5 * np.abs(base).max())
    experts = model.layers.mlp.experts
    assert isinstance(experts, ExpertsLoRA) and experts.lora_gate_up_a[...].shape == (1, 4, 32, 2)
    assert experts.lora_gate_b[...].shape == (1, 4, 2, 16) and experts.lora_down_b[...].shape == (1, 4, 2, 32)
    base_before = {k: np.asarray(v[...]) for k, v in named_params(model).items() if "lora_" not in k}
    learner, update = grpo_learner(model, GRPOConfig(num_generations=2, metrics="basic"),
                                   OptimConfig(learning_rate=1e-2), total_updates=1)
    assert np.isfinite(update(learner, random_step_batch(seed=5))["loss"])
    after = learner.model
    params = named_params(after)
    for k, v in base_before.items():
        np.testing.assert_array_equal(np.asarray(params[k][...]), v, err_msg=k)
    for name in ("layers.mlp.experts.lora_gate_b", "layers.mlp.experts.lora_up_b", "layers.mlp.experts.lora_down_b",
                 "layers.mlp.router.lora_b", "layers.attn.q_proj.lora_b"):
        assert float(jnp.max(jnp.abs(params[name][...]))) > 0, name
    ref = np.asarray(after(_ids(1)))
    np.testing.assert_allclose(np.asarray(merge_lora(after)(_ids(1))), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_lora_config_errors():
    with pytest.raises(ValueError, match="LoraConfig.rank=0"):
        LoraConfig(rank=0)
    with pytest.raises(ValueError, match="unknown: \\['qkv'\\]"):
        LoraConfig(target_modules=("qkv",))


def test_decoding_view_keeps_expert_adapters_unmerged():
    """The sampler's view merges Linear adapters but runs the experts' adapters as they are (no merged copy of the
    expert weights): same logits as the adapted model, expert weights and adapters shared with it."""
    from jrl.models.lora import decoding_view

    model = tiny_model(seed=7, model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, num_hidden_layers=2)
    apply_lora(model, LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj",), target_parameters=MOE_LORA_TARGETS))
    for i, (_, var) in enumerate(sorted(nnx.to_flat_state(nnx.state(model, LoRAParam)), key=lambda kv: str(kv[0]))):
        var.set_value(0.3 * jax.random.normal(jax.random.key(20 + i), var.shape, var.dtype))
    view = decoding_view(model)
    assert not lora_layers(view.layers[0].attn)  # the q_proj adapter is merged into its kernel
    experts = view.layers[1].mlp.experts
    assert isinstance(experts, ExpertsLoRA)  # unmerged: layer 1's expert weights and adapters
    np.testing.assert_array_equal(np.asarray(experts.gate_proj[...]),
                                  np.asarray(model.layers.mlp.experts.gate_proj[...][1]))
    np.testing.assert_array_equal(np.asarray(experts.lora_down_b[...]),
                                  np.asarray(model.layers.mlp.experts.lora_down_b[...][1]))
    ref = np.asarray(model(_ids(2)))
    assert np.abs(ref - np.asarray(merge_lora(model)(_ids(2)))).max() <= 1e-5 * np.abs(ref).max()
    np.testing.assert_allclose(np.asarray(view(_ids(2))), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    # The router adapter too is merged: the view's only adapters are the experts'.
    assert set(lora_layers(view)) == {"layers.0.mlp.experts", "layers.1.mlp.experts"}
