"""OLMoE (``OlmoeForCausalLM``): every layer a softmax-routed MoE, q/k RMSNorm over whole projections,
``head_dim`` derived from the hidden size."""

from jrl.models.errors import UnsupportedModelError
from jrl.models.families.common import attention_bias, check_no_shared_expert, check_one_attention_bias, every_layer
from jrl.models.family import FAMILIES, Family
from jrl.models.hf_mapping import QWEN_MOE_RULES, dense_rules


def _read(hf, get):
    if hf.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"olmoe with clip_qkv={hf['clip_qkv']} is not supported (clip_qkv=None only)")
    return dict(attention_bias(hf), qk_norm=True, qk_norm_projection=True, num_experts=hf["num_experts"],
                num_experts_per_tok=hf["num_experts_per_tok"], moe_intermediate_size=hf["intermediate_size"],
                norm_topk_prob=bool(get("norm_topk_prob")))


def _check(cfg):
    check_one_attention_bias(cfg)
    check_no_shared_expert(cfg)
    if cfg.head_dim * cfg.num_attention_heads != cfg.hidden_size:
        raise ValueError(f"olmoe derives head_dim from hidden_size / num_attention_heads = "
                         f"{cfg.hidden_size // cfg.num_attention_heads}; got head_dim={cfg.head_dim}")


OLMOE = FAMILIES.register("olmoe")(Family(
    name="olmoe", architecture="OlmoeForCausalLM",
    hf_defaults=dict(rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096, norm_topk_prob=False),
    table=dense_rules() + QWEN_MOE_RULES, read=_read,
    write=lambda cfg: dict(intermediate_size=cfg.moe_intermediate_size, attention_bias=cfg.qkv_bias, clip_qkv=None,
                           num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                           norm_topk_prob=cfg.norm_topk_prob),
    check=_check, moe_layer=every_layer, qk_norm=True, qk_norm_projection=True, derives_head_dim=True,
))
