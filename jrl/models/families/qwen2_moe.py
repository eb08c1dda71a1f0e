"""Qwen2-MoE (``Qwen2MoeForCausalLM``): Qwen2 attention, softmax-routed experts plus a gated shared expert."""

from jrl.models.families.common import (check_mlp_only_layers, check_no_o_bias, no_sliding_window, qwen_moe_fields,
                                        qwen_moe_keys, qwen_moe_layer)
from jrl.models.family import FAMILIES, Family
from jrl.models.hf_mapping import QWEN2_MOE_RULES, dense_rules


def _read(hf, get):
    no_sliding_window("qwen2_moe", hf)
    return dict(qkv_bias=bool(hf.get("qkv_bias", True)), o_bias=False, **qwen_moe_fields(hf, get),
                shared_expert_intermediate_size=hf["shared_expert_intermediate_size"], shared_expert_gate=True)


def _check(cfg):
    check_no_o_bias(cfg)
    if cfg.shared_expert_intermediate_size is None or not cfg.shared_expert_gate:
        raise ValueError("qwen2_moe has a gated shared expert: set shared_expert_intermediate_size and "
                         "shared_expert_gate=True")
    check_mlp_only_layers(cfg)


QWEN2_MOE = FAMILIES.register("qwen2_moe")(Family(
    name="qwen2_moe", architecture="Qwen2MoeForCausalLM",
    hf_defaults=dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, norm_topk_prob=False),
    table=dense_rules() + QWEN2_MOE_RULES, read=_read,
    write=lambda cfg: dict(qkv_bias=cfg.qkv_bias, use_sliding_window=False, **qwen_moe_keys(cfg),
                           shared_expert_intermediate_size=cfg.shared_expert_intermediate_size),
    check=_check, moe_layer=qwen_moe_layer, derives_head_dim=True,
))
