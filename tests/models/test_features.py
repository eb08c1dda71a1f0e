"""EBFT's frozen feature network: layer indices, parity with transformers' ``output_hidden_states`` on a
tiny random Llama, adapters switched off, and no gradient through the feature forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jrl.models import LoraConfig, apply_lora, from_pretrained, lora_layers
from jrl.models.features import feature_layer_indices, feature_layers


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def test_feature_layer_indices():
    assert feature_layer_indices((0.25, 0.5, 0.75), 32) == (8, 16, 24)
    assert feature_layer_indices((0.25, 0.5, 0.75), 2) == (0, 1, 1)
    assert feature_layer_indices((0.0, 1.0, 0.3), 10) == (0, 10, 3)
    assert feature_layer_indices([0.99], 36) == (35,)
    with pytest.raises(ValueError, match="1.5"):
        feature_layer_indices((0.5, 1.5), 4)
    with pytest.raises(ValueError, match="num_layers"):
        feature_layer_indices((0.5,), 0)
    with pytest.raises(ValueError, match="empty"):
        feature_layer_indices((), 4)


@pytest.mark.parametrize("fractions", [(0.0, 0.5, 1.0), (0.5,), (0.25, 0.75)])
def test_features_match_transformers_hidden_states(fractions, hf_checkpoints, jrl_models):
    """The selected entries equal transformers' ``hidden_states`` tuple (entry L after the final norm),
    with left padding given by the attention mask."""
    import torch

    hf, path = hf_checkpoints("llama_rope3")
    model = jrl_models("llama_rope3", path)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 256, (3, 12)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :4] = 0  # left-padded row
    layers = feature_layer_indices(fractions, model.config.num_hidden_layers)
    got = feature_layers(model, jnp.asarray(ids), layers=layers, attention_mask=jnp.asarray(mask))
    with torch.no_grad():
        ref = hf(torch.tensor(ids, dtype=torch.long), attention_mask=torch.tensor(mask, dtype=torch.long),
                 output_hidden_states=True).hidden_states
    assert len(got) == len(layers)
    for idx, h in zip(layers, got, strict=True):
        real = mask > 0  # padded positions are not defined the same way in both implementations
        assert rel_err(np.asarray(h)[real], ref[idx].numpy()[real]) <= 1e-5, idx


def test_lora_disabled_features_equal_the_base_model(hf_checkpoints):
    _, path = hf_checkpoints("llama_rope3")
    model = from_pretrained(path, dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 10)), jnp.int32)
    layers = (1, 2)
    base = [np.asarray(h) for h in feature_layers(model, ids, layers=layers)]
    apply_lora(model, LoraConfig(rank=4, alpha=8.0), seed=0)
    rng = np.random.default_rng(3)
    for layer in lora_layers(model).values():  # non-zero B, so the adapters change the forward
        layer.lora_b.set_value(jnp.asarray(rng.standard_normal(layer.lora_b.shape) * 0.5, jnp.float32))
    off = feature_layers(model, ids, layers=layers)
    on = feature_layers(model, ids, layers=layers, disable_lora=False)
    for b, o, a in zip(base, off, on, strict=True):
        np.testing.assert_array_equal(np.asarray(o), b)
        assert rel_err(a, b) > 1e-2  # the adapters really are active outside the feature forward
    assert all(layer.lora_enabled for layer in lora_layers(model).values())  # switched back on


def test_no_gradient_flows_through_features(hf_checkpoints):
    _, path = hf_checkpoints("llama_rope3")
    model = from_pretrained(path, dtype=jnp.float32)
    graphdef, params = nnx.split(model, nnx.Param)
    ids = jnp.asarray(np.random.default_rng(4).integers(0, 256, (2, 8)), jnp.int32)

    def total(p, stop):
        m = nnx.merge(graphdef, p)
        if stop:
            return sum(jnp.sum(h ** 2) for h in feature_layers(m, ids, layers=(1, 2)))
        return sum(jnp.sum(h ** 2) for h in m.hidden_states(ids, return_layers=(1, 2))[1])

    grads = jax.grad(total)(params, True)
    assert all(float(jnp.max(jnp.abs(g))) == 0.0 for g in jax.tree.leaves(grads))
    live = jax.grad(total)(params, False)  # the same function without stop_gradient does have gradients
    assert any(float(jnp.max(jnp.abs(g))) > 0.0 for g in jax.tree.leaves(live))
