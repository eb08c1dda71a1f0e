"""Llama 3.x (``LlamaForCausalLM``)."""

from jrl.models.families.common import attention_bias, check_one_attention_bias
from jrl.models.family import FAMILIES, Family
from jrl.models.hf_mapping import dense_rules

LLAMA = FAMILIES.register("llama")(Family(
    name="llama", architecture="LlamaForCausalLM",
    hf_defaults=dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=2048, bos_token_id=1,
                     eos_token_id=2),
    table=dense_rules(),
    read=lambda hf, get: dict(attention_bias(hf), mlp_bias=bool(hf.get("mlp_bias", False))),
    write=lambda cfg: dict(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias),
    check=check_one_attention_bias, mlp_bias=True,
))
