"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 attention, softmax-routed experts on every
``decoder_sparse_step``-th layer not in ``mlp_only_layers``."""

from jrl.models.families.common import (attention_bias, check_mlp_only_layers, check_no_shared_expert,
                                        check_one_attention_bias, no_sliding_window, qwen_moe_fields, qwen_moe_keys,
                                        qwen_moe_layer)
from jrl.models.family import FAMILIES, Family
from jrl.models.hf_mapping import QWEN_MOE_RULES, dense_rules


def _read(hf, get):
    no_sliding_window("qwen3_moe", hf)
    return dict(attention_bias(hf), qk_norm=True, **qwen_moe_fields(hf, get))


def _check(cfg):
    check_one_attention_bias(cfg)
    check_no_shared_expert(cfg)
    check_mlp_only_layers(cfg)


QWEN3_MOE = FAMILIES.register("qwen3_moe")(Family(
    name="qwen3_moe", architecture="Qwen3MoeForCausalLM",
    hf_defaults=dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, norm_topk_prob=False),
    table=dense_rules() + QWEN_MOE_RULES, read=_read,
    write=lambda cfg: dict(attention_bias=cfg.qkv_bias, use_sliding_window=False, **qwen_moe_keys(cfg)),
    check=_check, moe_layer=qwen_moe_layer, qk_norm=True,
))
