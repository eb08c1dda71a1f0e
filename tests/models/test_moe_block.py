"""MoE block pieces the parity tests do not isolate: the router's correction bias stays out of training."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.models import ModelConfig, create_model
from jrl.models.lora import trainable_params
from jrl.train.config import OptimConfig
from jrl.train.learner import Learner, LossTerm

GLM_TINY = ModelConfig(model_type="glm4_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, router="sigmoid_grouped",
                       n_group=4, topk_group=2, routed_scaling_factor=2.0, shared_expert_intermediate_size=16,
                       first_k_dense_replace=0, partial_rotary_factor=0.5)


@dataclasses.dataclass(frozen=True)
class MeanSquaredLogits:
    """A loss whose gradient reaches every weight the logits depend on."""

    def __call__(self, model, rows, aux):
        return jnp.mean(model(rows["ids"]) ** 2), {}


def test_correction_bias_is_loaded_but_never_trained():
    model = create_model(GLM_TINY, seed=0)
    bias = np.random.default_rng(0).normal(size=(2, 8)).astype(np.float32)  # stacked layers: [L, E]
    model.layers.mlp.router_bias.set_value(jnp.asarray(bias))
    trained = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(
        nnx.state(model, trainable_params(model)))}
    assert any("router" in p and "kernel" in p for p in trained)
    assert not any("router_bias" in p for p in trained), sorted(trained)

    router_before = np.asarray(model.layers.mlp.router.kernel[...])
    learner = Learner(model, OptimConfig(learning_rate=1e-2, weight_decay=0.5), total_updates=1)
    ids = np.random.default_rng(1).integers(0, 64, (4, 8)).astype(np.int32)
    learner.step([LossTerm(MeanSquaredLogits(), {"ids": ids})])
    after = learner.model.layers.mlp
    np.testing.assert_array_equal(np.asarray(after.router_bias[...]), bias)  # weight decay did not touch it
    assert np.abs(np.asarray(after.router.kernel[...]) - router_before).max() > 1e-4
