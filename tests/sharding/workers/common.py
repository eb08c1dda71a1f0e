"""Tiny dense and MoE models, a batch and a loss shared by the sharding workers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.models import ModelConfig, Transformer
from jrl.models.lora import MOE_LORA_TARGETS, LoraConfig, LoRAParam, apply_lora

BATCH, SEQ = 8, 16

CONFIGS = {
    # vocab, heads, kv heads, MLP and expert dims all divide the mesh axes used (tensor=2, expert=4).
    "dense": ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    "moe": ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
}


def tokens(seed: int = 1) -> np.ndarray:
    return np.asarray(jax.random.randint(jax.random.key(seed), (BATCH, SEQ), 0, 64, dtype=jnp.int32))


#: ``moe_lora``: the MoE model with LoRA on its experts, router and q_proj.
LORA = LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj",), target_parameters=MOE_LORA_TARGETS)


def make_model(kind: str, mesh=None, rules=None) -> Transformer:
    """``dense``, ``moe`` or ``moe_lora`` (its adapters random, B included, so they change the forward)."""
    model = Transformer(CONFIGS[kind.removesuffix("_lora")], rngs=nnx.Rngs(0), mesh=mesh, rules=rules)
    if kind.endswith("_lora"):
        apply_lora(model, LORA, seed=0)
        key = jax.random.key(5)
        for i, (_, var) in enumerate(sorted(nnx.to_flat_state(nnx.state(model, LoRAParam)), key=lambda kv: str(kv[0]))):
            var.set_value(0.3 * jax.random.normal(jax.random.fold_in(key, i), var.shape, var.dtype))
    return model


def loss_fn(model: Transformer, ids: jax.Array):
    """Mean next-token cross-entropy; also returns the logits."""
    logits = model(ids)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
    return jnp.mean(nll), logits


@nnx.jit
def loss_and_grads(model: Transformer, ids: jax.Array):
    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model, ids)
    return loss, logits, grads


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
