"""A model family defined in one file, as a user adds one: a Llama clone whose checkpoints name their tensors
``decoder.*`` and whose HF defaults differ, registered under ``toy_llama`` (tests/models/test_model_family.py)."""

from jrl.models.families.common import attention_bias, check_one_attention_bias
from jrl.models.family import FAMILIES, Family
from jrl.models.hf_mapping import dense_rules


def _check(cfg):
    check_one_attention_bias(cfg)
    if cfg.num_hidden_layers % 2:
        raise ValueError("toy_llama has an even number of layers")


TOY_LLAMA = FAMILIES.register("toy_llama")(Family(
    name="toy_llama", architecture="ToyLlamaForCausalLM",
    hf_defaults=dict(rms_norm_eps=1e-5, rope_theta=5000.0, max_position_embeddings=512),
    table=dense_rules(prefix="decoder."),
    read=lambda hf, get: attention_bias(hf),
    write=lambda cfg: dict(attention_bias=cfg.qkv_bias),
    check=_check,
))
