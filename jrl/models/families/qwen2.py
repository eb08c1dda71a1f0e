"""Qwen2 / Qwen2.5 (``Qwen2ForCausalLM``): q/k/v biases, no o_proj bias."""

from jrl.models.families.common import no_sliding_window
from jrl.models.family import FAMILIES, Family
from jrl.models.hf_mapping import dense_rules


def _read(hf, get):
    no_sliding_window("qwen2", hf)
    return dict(qkv_bias=True, o_bias=False)


def _check(cfg):
    if not (cfg.qkv_bias and not cfg.o_bias):
        raise ValueError("qwen2 always has q/k/v bias and no o_proj bias: set qkv_bias=True, o_bias=False")


QWEN2 = FAMILIES.register("qwen2")(Family(
    name="qwen2", architecture="Qwen2ForCausalLM",
    hf_defaults=dict(rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=32768),
    table=dense_rules(), read=_read, write=lambda cfg: dict(use_sliding_window=False), check=_check,
    derives_head_dim=True,
))
