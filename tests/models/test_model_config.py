"""ModelConfig: HF config.json in and out, for every family, and field validation."""

import json

import numpy as np
import pytest
from model_testlib import FAMILIES, hf_config

from jrl.models import ModelConfig, RopeScaling, UnsupportedModelError
from jrl.models.config import rope_inv_freq

# Real checkpoints' config.json (transformers 4.x style: rope_theta + rope_scaling), trimmed to what matters.
LLAMA31 = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 131072, "hidden_act": "silu",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
}
QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0,
    "rope_scaling": None, "rms_norm_eps": 1e-06, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "use_sliding_window": False, "sliding_window": None, "attention_bias": False,
}

GLM45_AIR = {
    "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "vocab_size": 151552, "hidden_size": 4096,
    "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96,
    "num_key_value_heads": 8, "head_dim": 128, "n_routed_experts": 128, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 1.0, "partial_rotary_factor": 0.5, "rope_theta": 1000000, "attention_bias": True,
    "use_qk_norm": False, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
}
QWEN15_MOE = {
    "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
    "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
    "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1, "rope_theta": 1000000.0,
    "max_position_embeddings": 8192, "tie_word_embeddings": False, "use_sliding_window": False,
}

OLMOE = {  # allenai/OLMoE-1B-7B-0924
    "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": 50304, "hidden_size": 2048,
    "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
    "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False, "clip_qkv": None, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-05, "tie_word_embeddings": False, "pad_token_id": 1,
    "eos_token_id": 50279, "bos_token_id": None, "attention_bias": False,
}


def test_real_llama31_config():
    c = ModelConfig.from_hf(LLAMA31)
    assert c.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert (c.head_dim, c.num_key_value_heads, c.rope_theta) == (128, 8, 500000.0)
    assert c.eos_token_id == (128001, 128008, 128009)
    assert 8.0e9 < c.num_params() < 8.1e9  # Llama 3.1 8B
    assert ModelConfig.from_hf(c.to_hf()) == c


def test_real_qwen3_moe_config():
    c = ModelConfig.from_hf(QWEN3_MOE)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob) == (128, 8, 768, True)
    assert all(c.layer_is_moe(i) for i in range(48))
    assert 30.0e9 < c.num_params() < 31.0e9  # Qwen3-30B-A3B
    assert ModelConfig.from_hf(c.to_hf()) == c


def test_real_moe_configs_with_shared_experts():
    glm = ModelConfig.from_hf(GLM45_AIR)
    assert (glm.router, glm.rotary_dim, glm.shared_expert_intermediate_size, glm.qkv_bias, glm.o_bias) == (
        "sigmoid_grouped", 64, 1408, True, False)
    assert [glm.layer_is_moe(i) for i in range(3)] == [False, True, True]
    assert 100e9 < glm.num_params() < 110e9  # GLM-4.5-Air: 106B (this count leaves out the MTP layer)
    assert ModelConfig.from_hf(glm.to_hf()) == glm
    qwen = ModelConfig.from_hf(QWEN15_MOE)
    assert (qwen.router, qwen.shared_expert_intermediate_size, qwen.shared_expert_gate) == ("softmax", 5632, True)
    assert 14.0e9 < qwen.num_params() < 14.6e9  # Qwen1.5-MoE-A2.7B: 14.3B
    assert ModelConfig.from_hf(qwen.to_hf()) == qwen


def test_real_olmoe_config():
    c = ModelConfig.from_hf(OLMOE)
    assert (c.qk_norm, c.qk_norm_projection, c.head_dim, c.moe_intermediate_size) == (True, True, 128, 1024)
    assert all(c.layer_is_moe(i) for i in range(16)) and c.stacked_layers
    assert 6.8e9 < c.num_params() < 7.0e9  # OLMoE-1B-7B: 6.9B
    assert ModelConfig.from_hf(c.to_hf()) == c
    with pytest.raises(UnsupportedModelError, match="clip_qkv=8.0"):
        ModelConfig.from_hf({**OLMOE, "clip_qkv": 8.0})
    with pytest.raises(ValueError, match="qk_norm_projection must be False for qwen3"):
        ModelConfig.from_hf(hf_config("qwen3").to_dict()).replace(qk_norm_projection=True)


def test_every_family_round_trips_through_transformers(family):
    from transformers import AutoConfig

    hf = hf_config(family)
    c = ModelConfig.from_hf(hf.to_dict())
    assert ModelConfig.from_hf(c.to_hf()) == c
    exported = AutoConfig.for_model(**c.to_hf())
    assert type(exported) is type(hf)
    assert exported.architectures == hf.architectures or hf.architectures is None
    for key in ("hidden_size", "num_hidden_layers", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                "rope_parameters", "num_experts", "num_local_experts", "norm_topk_prob", "mlp_only_layers",
                "sliding_window", "attention_bias", "mlp_bias", "moe_intermediate_size", "intermediate_size",
                "shared_expert_intermediate_size", "n_routed_experts", "n_shared_experts", "n_group", "topk_group",
                "routed_scaling_factor", "first_k_dense_replace", "use_qk_norm", "qkv_bias"):
        assert getattr(exported, key, None) == getattr(hf, key, None), key
    json.dumps(c.to_hf())


def test_family_features():
    cs = {f: ModelConfig.from_hf(hf_config(f).to_dict()) for f in FAMILIES}
    assert cs["llama_rope3"].rope_scaling.rope_type == "llama3"
    assert cs["llama_tied"].tie_word_embeddings and cs["llama_tied"].o_bias and cs["llama_tied"].mlp_bias
    assert cs["qwen2"].qkv_bias and not cs["qwen2"].o_bias
    assert cs["qwen3"].qk_norm and cs["qwen3"].head_dim == 32
    assert [cs["qwen3_moe"].layer_is_moe(i) for i in range(3)] == [True, False, True]
    assert cs["mixtral"].norm_topk_prob and cs["mixtral"].sliding_window == 8 and cs["mixtral"].rope_theta == 1e6
    assert cs["qwen2_moe"].shared_expert_gate and cs["qwen2_moe"].shared_expert_intermediate_size == 48
    assert cs["glm4_moe"].n_group == 4 and cs["glm4_moe"].shared_expert_intermediate_size == 64
    assert cs["glm4_moe"].rotary_dim == 8 and [cs["glm4_moe"].layer_is_moe(i) for i in range(3)] == [False, True, True]


def test_llama3_rope_matches_transformers():
    import torch
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = LlamaConfig(**{k: v for k, v in LLAMA31.items() if k not in ("architectures", "model_type", "torch_dtype")})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    np.testing.assert_allclose(rope_inv_freq(ModelConfig.from_hf(LLAMA31)), ref.numpy(), rtol=1e-6, atol=0)


def test_unsupported():
    with pytest.raises(UnsupportedModelError, match="'gpt_oss'.*supported model types: llama, qwen2, qwen3"):
        ModelConfig.from_hf({**LLAMA31, "model_type": "gpt_oss"})
    with pytest.raises(UnsupportedModelError, match="'yarn'.*default, linear, llama3"):
        ModelConfig.from_hf({**LLAMA31, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        ModelConfig.from_hf({**QWEN3_MOE, "use_sliding_window": True})
    # Multi-head latent attention is not implemented: DeepSeek-V3 is refused, naming what is supported.
    with pytest.raises(UnsupportedModelError, match="'deepseek_v3'.*supported model types: .*glm4_moe"):
        ModelConfig.from_hf({**GLM45_AIR, "model_type": "deepseek_v3"})


@pytest.mark.parametrize("change, match", [
    (dict(n_group=3), "num_experts % n_group == 0"),
    (dict(n_group=4, topk_group=5), "topk_group <= n_group"),
    (dict(n_group=128), "fewer than 2"),
    (dict(router="softmax"), "glm4_moe routes with router='sigmoid_grouped'"),
    (dict(router="top1"), "not a router"),
    (dict(shared_expert_gate=True), "shared experts have no gate"),
    (dict(partial_rotary_factor=0.0), "rotary width"),
])
def test_moe_validation_names_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(GLM45_AIR).replace(**change)


@pytest.mark.parametrize("change, match", [
    (dict(num_key_value_heads=5), "not a multiple of num_key_value_heads"),
    (dict(qkv_bias=True), "attention_bias covers"),
    (dict(qk_norm=True), "qk_norm must be False for llama"),
    (dict(dtype="int8"), r"ModelConfig.dtype='int8'"),
    (dict(num_experts=4), "is dense but num_experts=4"),
])
def test_validation_names_the_field(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(LLAMA31).replace(**change)


def test_dtype_knobs():
    import jax.numpy as jnp

    c = ModelConfig.from_hf(LLAMA31, dtype=jnp.bfloat16, param_dtype="float32")
    assert (c.dtype, c.param_dtype) == ("bfloat16", "float32")
    assert c.to_hf()["dtype"] == "float32"
