"""Pieces several families share: how their ``config.json`` spells attention biases, Qwen-style MoE fields, and
the invariants that follow."""

from __future__ import annotations

from typing import Any

from jrl.models.errors import UnsupportedModelError


def no_sliding_window(name: str, hf) -> None:
    """Refuse a checkpoint that turns on sliding-window attention (jrl implements it for Mixtral only)."""
    if hf.get("use_sliding_window"):
        raise UnsupportedModelError(f"{name} with use_sliding_window=True is not supported (full attention only)")


def attention_bias(hf) -> dict[str, Any]:
    """``attention_bias`` covering q/k/v and o_proj together."""
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias)


def check_one_attention_bias(cfg) -> None:
    if cfg.qkv_bias != cfg.o_bias:
        raise ValueError(f"{cfg.model_type}: attention_bias covers q/k/v and o_proj together; set qkv_bias == o_bias "
                         f"(got qkv_bias={cfg.qkv_bias}, o_bias={cfg.o_bias})")


def check_no_o_bias(cfg) -> None:
    if cfg.o_bias:
        raise ValueError(f"{cfg.model_type} has no o_proj bias: set o_bias=False")


def check_no_shared_expert(cfg) -> None:
    if cfg.shared_expert_intermediate_size is not None or cfg.shared_expert_gate:
        raise ValueError(f"{cfg.model_type} has no shared expert: set shared_expert_intermediate_size=None, "
                         f"shared_expert_gate=False")


def qwen_moe_fields(hf, get) -> dict[str, Any]:
    """The MoE fields of Qwen3-MoE / Qwen2-MoE configs."""
    return dict(num_experts=hf.get("num_experts") or hf.get("num_local_experts"),
                num_experts_per_tok=hf["num_experts_per_tok"], moe_intermediate_size=hf["moe_intermediate_size"],
                norm_topk_prob=bool(get("norm_topk_prob")), decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
                mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()))


def qwen_moe_keys(cfg) -> dict[str, Any]:
    return dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                decoder_sparse_step=cfg.decoder_sparse_step, mlp_only_layers=list(cfg.mlp_only_layers))


def qwen_moe_layer(cfg, layer: int) -> bool:
    """HF's rule for Qwen3-MoE / Qwen2-MoE: every ``decoder_sparse_step``-th layer not in ``mlp_only_layers``."""
    return layer not in cfg.mlp_only_layers and (layer + 1) % cfg.decoder_sparse_step == 0


def check_mlp_only_layers(cfg) -> None:
    if any(not 0 <= i < cfg.num_hidden_layers for i in cfg.mlp_only_layers):
        raise ValueError(f"mlp_only_layers={cfg.mlp_only_layers} has entries outside [0, {cfg.num_hidden_layers})")


def every_layer(cfg, layer: int) -> bool:
    """Every layer is a mixture of experts (Mixtral, OLMoE)."""
    return True
