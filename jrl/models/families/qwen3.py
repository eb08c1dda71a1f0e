"""Qwen3 (``Qwen3ForCausalLM``): per-head q/k RMSNorm."""

from jrl.models.families.common import attention_bias, check_one_attention_bias, no_sliding_window
from jrl.models.family import FAMILIES, Family
from jrl.models.hf_mapping import dense_rules


def _read(hf, get):
    no_sliding_window("qwen3", hf)
    return dict(attention_bias(hf), qk_norm=True)


QWEN3 = FAMILIES.register("qwen3")(Family(
    name="qwen3", architecture="Qwen3ForCausalLM",
    hf_defaults=dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768, head_dim=128),
    table=dense_rules(), read=_read,
    write=lambda cfg: dict(attention_bias=cfg.qkv_bias, use_sliding_window=False),
    check=check_one_attention_bias, qk_norm=True,
))
