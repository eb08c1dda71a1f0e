"""Tiny random float32 models and full-forward references for the rollout tests."""

from __future__ import annotations

import numpy as np

from jrl.models import ModelConfig, create_model

VOCAB = 48
PAD = 0

CONFIGS = {
    "llama": dict(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3,
                  pad_token_id=PAD),
    "moe": dict(model_type="qwen3_moe", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True, num_experts=4,
                num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, max_position_embeddings=256,
                initializer_range=0.3, pad_token_id=PAD),
    "mixtral_sliding": dict(model_type="mixtral", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=16, sliding_window=3,
                            max_position_embeddings=256, initializer_range=0.3, pad_token_id=PAD),
}


def tiny_model(kind: str = "llama", seed: int = 0, mesh=None, **overrides):
    return create_model(ModelConfig(**{**CONFIGS[kind], **overrides}), seed=seed, mesh=mesh)


def random_prompts(rng: np.random.Generator, lengths) -> list[list[int]]:
    """Prompts of the given lengths with ids in [1, VOCAB) (never the pad id)."""
    return [rng.integers(1, VOCAB, size=int(n)).tolist() for n in lengths]


def full_sequences(batch):
    """(input_ids, attention_mask) of left-padded prompt + completion, as the trainer scores them."""
    ids = np.concatenate([batch.prompt_ids, batch.completion_ids], axis=1)
    mask = np.concatenate([batch.prompt_mask, batch.completion_mask], axis=1)
    return ids, mask


def full_forward_logprobs(model, batch, temperature: float) -> np.ndarray:
    """log_softmax(model(...) / T) at each completion token, recomputed by one full forward pass."""
    ids, mask = full_sequences(batch)
    logits = np.asarray(model(ids, attention_mask=mask), np.float64)
    lp_len, t = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    z = logits[:, lp_len - 1: lp_len - 1 + t] / temperature
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return np.take_along_axis(logp, batch.completion_ids[..., None].astype(np.int64), axis=-1)[..., 0]


def greedy_by_full_forward(model, prompts: list[list[int]], max_new_tokens: int, stop_ids=()) -> list[list[int]]:
    """Greedy completions by re-running the whole (left-padded) sequence through the model each step."""
    out = []
    for prompt in prompts:
        seq = list(prompt)
        completion = []
        for _ in range(max_new_tokens):
            logits = np.asarray(model(np.asarray([seq], np.int32)))[0, -1]
            token = int(np.argmax(logits))
            completion.append(token)
            seq.append(token)
            if token in stop_ids:
                break
        out.append(completion)
    return out
