"""A model family registered from one file (tests/models/toy_family.py) is a family like the built-in ones: its
configs validate by its rules, read and write its config.json, and its checkpoints convert both ways with its
weight mapping."""

import json

import jax.numpy as jnp
import numpy as np
import pytest
import toy_family  # noqa: F401  (registers toy_llama)
from safetensors.numpy import load_file

from jrl.models import ModelConfig, UnsupportedModelError, create_model, from_pretrained, save_pretrained

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, dtype="float32", param_dtype="float32")


def test_its_invariants_and_its_config_json():
    with pytest.raises(ValueError, match="even number of layers"):
        ModelConfig(model_type="toy_llama", **{**SHAPE, "num_hidden_layers": 3})
    cfg = ModelConfig(model_type="toy_llama", **SHAPE)
    hf = cfg.to_hf()
    assert hf["architectures"] == ["ToyLlamaForCausalLM"] and hf["attention_bias"] is False
    assert ModelConfig.from_hf(hf, dtype="float32", param_dtype="float32") == cfg
    omitted = {k: v for k, v in hf.items() if k not in ("rope_theta", "rope_parameters", "rope_scaling")}
    assert ModelConfig.from_hf(omitted).rope_theta == 5000.0  # the family's default
    with pytest.raises(UnsupportedModelError, match="toy_llama"):
        ModelConfig.from_hf({**hf, "model_type": "toy_mistral"})


def test_a_checkpoint_converts_both_ways_with_its_mapping(tmp_path):
    model = create_model(ModelConfig(model_type="toy_llama", **SHAPE), seed=3)
    save_pretrained(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "toy_llama"
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert "decoder.embed_tokens.weight" in keys and "decoder.layers.1.mlp.down_proj.weight" in keys
    assert not any(k.startswith("model.") for k in keys)
    loaded = from_pretrained(tmp_path, dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 7)))
    np.testing.assert_array_equal(np.asarray(loaded(ids)), np.asarray(model(ids)))
