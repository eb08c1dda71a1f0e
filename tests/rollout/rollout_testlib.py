"""Tiny random float32 models and full-forward references for the rollout tests."""

from __future__ import annotations

import jax
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
    "qwen2_bias": dict(model_type="qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, qkv_bias=True, max_position_embeddings=256,
                       initializer_range=0.3, pad_token_id=PAD),
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


def log_softmax(z) -> np.ndarray:
    """log_softmax over the last axis, in float64."""
    z = np.asarray(z, np.float64)
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def full_forward_logprobs(model, batch, temperature: float) -> np.ndarray:
    """log_softmax(model(...) / T) at each completion token, recomputed by one full forward pass."""
    ids, mask = full_sequences(batch)
    logits = np.asarray(jax.jit(lambda i, m: model(i, attention_mask=m))(ids, mask), np.float64)
    lp_len, t = batch.prompt_ids.shape[1], batch.completion_ids.shape[1]
    logp = log_softmax(logits[:, lp_len - 1: lp_len - 1 + t] / temperature)
    return np.take_along_axis(logp, batch.completion_ids[..., None].astype(np.int64), axis=-1)[..., 0]


def greedy_by_full_forward(model, prompts: list[list[int]], max_new_tokens: int, stop_ids=()) -> list[list[int]]:
    """Greedy completions by re-running the full forward over prompt + tokens so far at every step (no
    cache). Prompts are left-padded into a fixed buffer whose not-yet-generated tail is masked out and,
    being later than every query that is read, invisible under the causal mask; one compile."""
    lp = max(len(p) for p in prompts)
    ids = np.full((len(prompts), lp + max_new_tokens), PAD, np.int32)
    mask = np.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, lp - len(p):lp], mask[r, lp - len(p):lp] = p, 1
    forward = jax.jit(lambda i, m: model(i, attention_mask=m))
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for step in range(max_new_tokens):
        tokens = np.argmax(np.asarray(forward(ids, mask))[:, lp + step - 1], axis=-1)
        ids[:, lp + step], mask[:, lp + step] = tokens, 1
        for r, token in enumerate(tokens.tolist()):
            if not done[r]:
                out[r].append(token)
                done[r] = token in stop_ids
    return out


def continue_from_kept(graphdef, states, prompts, params, kvs, *, g: int, needed: tuple[int, ...], seed: int = 7,
                       homes: bool = False):
    """A paged generation of ``g`` rows per prompt that stops at ``needed[0]`` finished groups, its unfinished rows
    continued by further generations from the keys and values each left (``keep``), the i-th stopping at
    ``needed[i]`` finished groups (0: all) with the cache config ``kvs[i]``, each continued row's group naming the
    device that kept it where ``homes``; returns each row's tokens and log-probs over the chain, and the
    generations' outputs (each with ``groups``, the groups it was given)."""
    from jrl.rollout.jax_engine import row_bucket
    from jrl.rollout.paged import RowGroup, generate_paged, new_groups

    tokens = [[] for _ in range(len(prompts) * g)]
    logprobs = [[] for _ in range(len(prompts) * g)]
    groups, rows, outs = new_groups(prompts, g), list(range(len(prompts) * g)), []
    for n, kv in zip(needed, kvs, strict=True):
        out = generate_paged(graphdef, states, groups, params, seed=seed, kv=kv, pad_id=PAD, prompt_bucket=8,
                             slot_bucket=row_bucket, groups_needed=n or None, keep=True)
        outs.append(out | dict(groups=groups))
        for j, r in enumerate(rows):
            m = int(out["mask"][j].sum())
            tokens[r] += out["tokens"][j, :m].tolist()
            logprobs[r] += out["logprobs"][j, :m].tolist()
        # each unfinished row its own group, with its key and its kept keys and values
        rest = [j for j in range(len(rows)) if not out["finished"][j]]
        groups = [RowGroup(prompts[rows[j] // g], [list(tokens[rows[j]])], [rows[j]], (out["kept"][j],),
                           int(out["home"][j]) if homes and out["home"][j] >= 0 else None) for j in rest]
        rows = [rows[j] for j in rest]
        if not rows:
            break
    return tokens, logprobs, outs
