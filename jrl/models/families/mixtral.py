"""Mixtral (``MixtralForCausalLM``): every layer a softmax-routed MoE (top-k renormalised), optional sliding
window on all layers, no attention biases."""

from jrl.models.families.common import check_no_shared_expert, every_layer
from jrl.models.family import FAMILIES, Family
from jrl.models.hf_mapping import MIXTRAL_MOE_RULES, dense_rules


def _read(hf, get):
    return dict(num_experts=hf["num_local_experts"], num_experts_per_tok=hf["num_experts_per_tok"],
                moe_intermediate_size=hf["intermediate_size"], norm_topk_prob=True,
                sliding_window=hf.get("sliding_window"))


def _check(cfg):
    if cfg.qkv_bias or cfg.o_bias:
        raise ValueError("mixtral has no attention bias: set qkv_bias=False, o_bias=False")
    if not cfg.norm_topk_prob:
        raise ValueError("mixtral always renormalises the top-k probabilities: set norm_topk_prob=True")
    check_no_shared_expert(cfg)


MIXTRAL = FAMILIES.register("mixtral")(Family(
    name="mixtral", architecture="MixtralForCausalLM",
    hf_defaults=dict(rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=131072, bos_token_id=1,
                     eos_token_id=2),
    table=dense_rules() + MIXTRAL_MOE_RULES, read=_read,
    write=lambda cfg: dict(intermediate_size=cfg.moe_intermediate_size, num_local_experts=cfg.num_experts,
                           num_experts_per_tok=cfg.num_experts_per_tok, sliding_window=cfg.sliding_window),
    check=_check, moe_layer=every_layer, derives_head_dim=True, sliding_window=True,
))
