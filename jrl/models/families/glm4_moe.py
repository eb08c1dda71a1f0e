"""GLM-4-MoE (``Glm4MoeForCausalLM``): sigmoid group-limited routing with a score-correction bias, ungated shared
experts, the first ``first_k_dense_replace`` layers dense, optional per-head q/k norm, partial rotary."""

from jrl.models.families.common import check_no_o_bias
from jrl.models.family import FAMILIES, Family
from jrl.models.hf_mapping import GLM4_MOE_RULES, dense_rules


def _read(hf, get):
    shared = int(hf.get("n_shared_experts", 1) or 0) * hf["moe_intermediate_size"]
    return dict(qkv_bias=bool(hf.get("attention_bias", False)), o_bias=False,
                qk_norm=bool(hf.get("use_qk_norm", False)),
                num_experts=hf.get("n_routed_experts") or hf.get("num_local_experts"),
                num_experts_per_tok=hf["num_experts_per_tok"], moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(get("norm_topk_prob")), router="sigmoid_grouped",
                n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1),
                routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                first_k_dense_replace=int(hf.get("first_k_dense_replace", 1)),
                shared_expert_intermediate_size=shared or None)


def _write(cfg):
    n_shared = (cfg.shared_expert_intermediate_size or 0) // cfg.moe_intermediate_size
    if n_shared * cfg.moe_intermediate_size != (cfg.shared_expert_intermediate_size or 0):
        raise ValueError(f"glm4_moe's shared expert width is n_shared_experts * moe_intermediate_size; "
                         f"{cfg.shared_expert_intermediate_size} is not a multiple of {cfg.moe_intermediate_size}")
    return dict(attention_bias=cfg.qkv_bias, use_qk_norm=cfg.qk_norm, partial_rotary_factor=cfg.partial_rotary_factor,
                n_routed_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                n_shared_experts=n_shared, n_group=cfg.n_group, topk_group=cfg.topk_group,
                routed_scaling_factor=cfg.routed_scaling_factor, first_k_dense_replace=cfg.first_k_dense_replace)


def _check(cfg):
    check_no_o_bias(cfg)
    if cfg.shared_expert_gate:
        raise ValueError("glm4_moe's shared experts have no gate: set shared_expert_gate=False")


GLM4_MOE = FAMILIES.register("glm4_moe")(Family(
    name="glm4_moe", architecture="Glm4MoeForCausalLM",
    hf_defaults=dict(rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=131072, norm_topk_prob=True,
                     partial_rotary_factor=0.5),
    table=dense_rules() + GLM4_MOE_RULES, read=_read, write=_write, check=_check,
    moe_layer=lambda cfg, layer: layer >= cfg.first_k_dense_replace, router="sigmoid_grouped", qk_norm=None,
))
