"""Stacked, scanned layers (``ModelConfig.scan_layers``) against the unrolled loop over separate layers, both
loaded from one checkpoint (float32): logits, every parameter's gradient, selected hidden states, KV-cache
decoding, LoRA merge and PEFT export, and the exported checkpoint."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_testlib import VOCAB

from jrl.models import from_pretrained, merge_lora, named_params, save_peft_adapter, save_pretrained
from jrl.models.lora import LoraConfig, apply_lora, lora_layers
from jrl.models.transformer import unit_name

RTOL = 1e-5


def _rel(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "NaN or inf"
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _per_layer(tree: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Stacked ``layers.X`` entries split into ``layers.{i}.X`` (other entries unchanged)."""
    out = {}
    for path, value in tree.items():
        if path.startswith("layers.") and not re.match(r"layers\.\d+\.", path):
            out.update({unit_name(path, i): v for i, v in enumerate(value)})
        else:
            out[path] = value
    return out


@pytest.fixture(scope="module")
def pair(hf_checkpoints):
    """(stacked model, unrolled model, checkpoint dir) of a 2-layer Llama checkpoint."""
    _, path = hf_checkpoints("llama_rope3")
    stacked = from_pretrained(path, dtype=jnp.float32)
    unrolled = from_pretrained(path, dtype=jnp.float32, scan_layers=False)
    assert stacked.config.stacked_layers and not unrolled.config.stacked_layers
    assert "layers.attn.q_proj.kernel" in named_params(stacked)
    assert "layers.1.attn.q_proj.kernel" in named_params(unrolled)
    return stacked, unrolled, path


def _inputs():
    rng = np.random.default_rng(1)
    ids = jnp.asarray(rng.integers(0, VOCAB, (2, 16)), jnp.int32)
    mask = jnp.asarray(np.arange(16)[None] >= np.array([[0], [6]]), jnp.int32)
    return ids, mask


def test_logits_and_gradients_match_the_unrolled_layers(pair):
    stacked, unrolled, _ = pair
    ids, mask = _inputs()

    def loss(model):
        logits = model(ids, attention_mask=mask)
        return jnp.mean(jax.nn.log_softmax(logits)[..., 7] * mask)

    assert _rel(stacked(ids, attention_mask=mask), unrolled(ids, attention_mask=mask)) <= RTOL
    grads = {}
    for name, model in (("stacked", stacked), ("unrolled", unrolled)):
        g = nnx.grad(loss)(model)
        grads[name] = _per_layer({k: np.asarray(v[...]) for k, v in named_params(g).items()})
    assert sorted(grads["stacked"]) == sorted(grads["unrolled"])
    for k, want in grads["unrolled"].items():
        assert _rel(grads["stacked"][k], want) <= RTOL, k


def test_selected_hidden_states_match(pair):
    stacked, unrolled, _ = pair
    ids, mask = _inputs()
    for wanted in ((0,), (1,), (0, 2), (-1, 1), (2, 0), True):
        got = stacked.hidden_states(ids, attention_mask=mask, return_layers=wanted)
        want = unrolled.hidden_states(ids, attention_mask=mask, return_layers=wanted)
        assert _rel(got[0], want[0]) <= RTOL, wanted
        assert len(got[1]) == len(want[1])
        for g, w in zip(got[1], want[1], strict=True):
            assert _rel(g, w) <= RTOL, wanted


def test_kv_cache_decoding_matches(pair):
    stacked, unrolled, _ = pair
    ids, mask = _inputs()
    prompt, prompt_mask = ids[:, :10], mask[:, :10]
    outs = {}
    for name, model in (("stacked", stacked), ("unrolled", unrolled)):
        cache = model.init_cache(2, 12)
        key_mask = jnp.concatenate([prompt_mask, jnp.ones((2, 2), jnp.int32)], axis=1)
        positions = jnp.maximum(jnp.cumsum(prompt_mask, axis=1) - 1, 0)
        hidden, cache = model.decode(prompt, positions, key_mask, cache, 0)
        steps = [hidden[:, -1]]
        for t in range(2):
            pos = positions[:, -1:] + 1 + t
            h, cache = model.decode(ids[:, 10 + t:11 + t], pos, key_mask, cache, 10 + t)
            steps.append(h[:, 0])
        outs[name] = (steps, cache)
    for g, w in zip(outs["stacked"][0], outs["unrolled"][0], strict=True):
        assert _rel(g, w) <= RTOL
    for got, want in zip(outs["stacked"][1], outs["unrolled"][1], strict=True):
        assert _rel(got.k, want.k) <= RTOL and _rel(got.v, want.v) <= RTOL


def test_unstacked_view_shares_weights_and_matches(pair):
    stacked, unrolled, _ = pair
    ids, mask = _inputs()
    view = stacked.unstacked()
    assert unrolled.unstacked() is unrolled and not view.config.stacked_layers and stacked.config.stacked_layers
    assert view.embed.embedding is stacked.embed.embedding
    assert view.layers[1].attn.q_proj.kernel.logical_axes == ("embed", "heads", "head_dim")
    np.testing.assert_array_equal(np.asarray(view.layers[1].mlp.up_proj.kernel[...]),
                                  np.asarray(stacked.layers.mlp.up_proj.kernel[...][1]))
    assert _rel(view(ids, attention_mask=mask), unrolled(ids, attention_mask=mask)) <= RTOL


def test_exported_checkpoints_are_equal(pair, tmp_path):
    from safetensors.numpy import load_file

    stacked, unrolled, _ = pair
    a = load_file(str(save_pretrained(stacked, tmp_path / "stacked") / "model.safetensors"))
    b = load_file(str(save_pretrained(unrolled, tmp_path / "unrolled") / "model.safetensors"))
    assert sorted(a) == sorted(b) and "model.layers.1.mlp.down_proj.weight" in a
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_lora_on_stacked_layers_merges_and_exports_per_layer(hf_checkpoints, tmp_path):
    from safetensors.numpy import load_file

    _, path = hf_checkpoints("llama_rope3")
    cfg = LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj", "o_proj", "down_proj"))
    models = {}
    for name, scan in (("stacked", True), ("unrolled", False)):
        models[name] = apply_lora(from_pretrained(path, dtype=jnp.float32, scan_layers=scan), cfg, seed=3)
    stacked, unrolled = models["stacked"], models["unrolled"]
    q = lora_layers(stacked)["layers.attn.q_proj"]
    assert q.stack == (2,) and q.lora_a[...].shape == (2, 64, 2) and q.lora_b[...].shape == (2, 2, 4, 16)
    # Non-zero adapters on the stacked model, copied layer by layer into the unrolled one.
    rng = np.random.default_rng(4)
    for path_, layer in lora_layers(stacked).items():
        for var in (layer.lora_a, layer.lora_b):
            var.set_value(jnp.asarray(rng.normal(0, 0.1, var[...].shape), jnp.float32))
        for i in range(2):
            target = lora_layers(unrolled)[path_.replace("layers.", f"layers.{i}.", 1)]
            target.lora_a.set_value(layer.lora_a[...][i])
            target.lora_b.set_value(layer.lora_b[...][i])
    ids, mask = _inputs()
    want = unrolled(ids, attention_mask=mask)
    assert _rel(stacked(ids, attention_mask=mask), want) <= RTOL
    assert _rel(merge_lora(stacked)(ids, attention_mask=mask), want) <= RTOL
    a = load_file(str(save_peft_adapter(stacked, tmp_path / "stacked", dtype="float32") / "adapter_model.safetensors"))
    b = load_file(str(save_peft_adapter(unrolled, tmp_path / "unrolled", dtype="float32")
                      / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and len(a) == 2 * 3 * 2
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_mixed_layers_run_unrolled(hf_checkpoints):
    """Qwen3-MoE with a dense layer among MoE layers cannot be stacked: it runs the Python loop."""
    _, path = hf_checkpoints("qwen3_moe")
    model = from_pretrained(path, dtype=jnp.float32)
    assert model.config.scan_layers and not model.config.stacked_layers
    assert "layers.1.mlp.up_proj.kernel" in named_params(model)


def test_random_init_is_the_same_stacked_or_not():
    from jrl.models import ModelConfig, create_model

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    stacked = named_params(create_model(cfg, seed=5))
    unrolled = named_params(create_model(dataclasses.replace(cfg, scan_layers=False), seed=5))
    got = _per_layer({k: np.asarray(v[...]) for k, v in stacked.items()})
    assert sorted(got) == sorted(unrolled)
    for k, v in unrolled.items():
        np.testing.assert_array_equal(got[k], np.asarray(v[...]), err_msg=k)


def test_unit_layer_reads_back_what_unit_name_writes():
    from jrl.models.transformer import unit_layer

    for layer in (0, 7, 31):
        assert unit_layer(unit_name("layers.attn.q_proj.kernel", layer)) == layer
    for bad in ("layers.attn.q_proj.kernel", "embed.embedding", "final_norm"):
        with pytest.raises(ValueError, match="not a parameter path of one layer"):
            unit_layer(bad)
