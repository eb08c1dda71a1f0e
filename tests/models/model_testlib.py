"""Tiny random transformers checkpoints for the model tests (built locally, never from a hub)."""

from __future__ import annotations

import math
import re

import numpy as np

VOCAB = 256

# family name -> (model_type, config kwargs). Shapes are tiny; each family exercises its own features.
FAMILIES: dict[str, tuple[str, dict]] = {
    # Llama 3.1-style rope scaling; original length 32 puts rope frequencies in all three llama3 bands.
    "llama_rope3": ("llama", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=32))),
    # Tied embeddings, plus Llama's attention_bias (q/k/v/o) and mlp_bias.
    "llama_tied": ("llama", dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        tie_word_embeddings=True, attention_bias=True, mlp_bias=True, rope_parameters=dict(rope_type="default",
                                                                                         rope_theta=500000.0))),
    # q/k/v bias, no o bias.
    "qwen2": ("qwen2", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    # q/k RMSNorm, explicit head_dim (32) != hidden/heads (16).
    "qwen3": ("qwen3", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32)),
    # MoE layers 0 and 2, dense layer 1 (mlp_only_layers); no top-k renormalisation.
    "qwen3_moe": ("qwen3_moe", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
        decoder_sparse_step=1, mlp_only_layers=[1])),
    # Always renormalised top-2 of 4; sliding window 8 (< the test length 16).
    "mixtral": ("mixtral", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=8)),
    # Gated shared expert; MoE layers 0 and 2, dense layer 1; q/k/v bias.
    "qwen2_moe": ("qwen2_moe", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=False, mlp_only_layers=[1])),
    # Sigmoid routing with a score-correction bias over 4 groups (top-2 groups), scaled weights; 2 shared experts;
    # dense first layer; half of head_dim rotated; attention bias and q/k norm.
    "glm4_moe": ("glm4_moe", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, first_k_dense_replace=1, n_shared_experts=2, attention_bias=True,
        use_qk_norm=True, partial_rotary_factor=0.5)),
    # q/k RMSNorm over the whole projections (not per head); every layer MoE; intermediate_size is the expert width.
    "olmoe": ("olmoe", dict(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
}


def hf_config(family: str):
    from transformers import AutoConfig

    model_type, kw = FAMILIES[family]
    return AutoConfig.for_model(model_type, vocab_size=VOCAB, **kw)


def randomize_(model, seed: int = 0) -> None:
    """Give every parameter O(1)-scale random values, so parity tests see real signal (norm scales != 1,
    biases != 0, router logits spread out) instead of transformers' near-zero init."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if "norm" in name:
                new = 1.0 + 0.2 * torch.randn(shape, generator=g)
            elif name.endswith("bias"):
                new = 0.2 * torch.randn(shape, generator=g)
            elif "embed_tokens" in name:
                new = torch.randn(shape, generator=g)
            else:  # [out, in] or fused experts [E, out, in]
                new = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
            p.copy_(new)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # the router's choice bias: spread the choices out
                buf.copy_(0.3 * torch.randn(buf.shape, generator=g))


def build_hf(family: str, path, seed: int = 0):
    """A random float32 HF model of ``family`` saved to ``path``; returns the (eval-mode) torch model."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32, attn_implementation="eager")
    randomize_(model, seed)
    model.eval()
    model.save_pretrained(path)
    return model


def hf_logits(model, ids, attention_mask=None, position_ids=None) -> np.ndarray:
    import torch

    kw = {}
    if attention_mask is not None:
        kw["attention_mask"] = torch.tensor(np.asarray(attention_mask))
    if position_ids is not None:
        kw["position_ids"] = torch.tensor(np.asarray(position_ids))
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids)), **kw).logits.float().numpy()


def kl_mean(ref_logits: np.ndarray, logits: np.ndarray) -> float:
    """Mean over tokens of KL(ref || other), in float64."""
    def log_softmax(x):
        x = np.asarray(x, np.float64)
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref_logits), log_softmax(logits)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def _jitted():
    from flax import nnx

    @nnx.jit
    def forward(model, ids, attention_mask=None, segment_ids=None):
        return model(ids, attention_mask=attention_mask, segment_ids=segment_ids)

    @nnx.jit
    def hidden(model, ids):
        return model.hidden_states(ids, return_layers=True)

    return forward, hidden


_FNS = None


def jrl_logits(model, ids, attention_mask=None, segment_ids=None) -> np.ndarray:
    """Jitted jrl forward (one compile per model structure and input signature)."""
    import jax.numpy as jnp

    global _FNS
    _FNS = _FNS or _jitted()
    opt = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    return np.asarray(_FNS[0](model, jnp.asarray(ids), opt(attention_mask), opt(segment_ids)))


def jrl_hidden(model, ids):
    import jax.numpy as jnp

    global _FNS
    _FNS = _FNS or _jitted()
    return _FNS[1](model, jnp.asarray(ids))


def layer_param(model, path: str) -> np.ndarray:
    """A jrl parameter by its per-layer path (``layers.0.attn.q_proj.kernel``) as numpy, whether the model keeps
    its layers unrolled or stacked (then it is layer 0 of ``layers.attn.q_proj.kernel``)."""
    from jrl.models import named_params

    params = named_params(model)
    if path in params:
        return np.asarray(params[path][...])
    layer, rest = re.fullmatch(r"layers\.(\d+)\.(.+)", path).groups()
    return np.asarray(params[f"layers.{rest}"][...][int(layer)])
