"""KV-cache decoding equals the full-sequence forward pass: per-step logits (teacher forced, left-padded
prompts of different lengths) and greedy generations of the engine against re-running the full forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rollout_testlib import PAD, greedy_by_full_forward, random_prompts, tiny_model

from jrl.rollout import SamplingParams
from jrl.rollout.jax_engine import JaxRolloutEngine


@pytest.mark.parametrize("kind", ["llama", "moe", "mixtral_sliding", "qwen2_bias"])
def test_decode_logits_match_full_forward(kind):
    model = tiny_model(kind, seed=1)
    rng = np.random.default_rng(0)
    for path, bias in nnx.iter_graph(model):  # q/k/v biases start at zero: make them count
        if path and path[-1] == "bias" and isinstance(bias, nnx.Param):
            bias.set_value(jnp.asarray(rng.standard_normal(bias.shape), bias.dtype))
    lengths, lp, t = [5, 2, 7], 8, 6
    prompts = random_prompts(rng, lengths)
    completion = rng.integers(1, model.config.vocab_size, size=(len(prompts), t)).astype(np.int32)
    ids = np.full((len(prompts), lp), PAD, np.int32)
    mask = np.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, lp - len(p):], mask[r, lp - len(p):] = p, 1
    full_ids = np.concatenate([ids, completion], 1)
    full_mask = np.concatenate([mask, np.ones_like(completion)], 1)
    reference = np.asarray(jax.jit(lambda i, m: model(i, attention_mask=m))(full_ids, full_mask))
    reference = reference[:, lp - 1: lp - 1 + t]

    step = jax.jit(lambda c, tok, pos, km, slot: _last_logits(model, tok, pos, km, c, slot))
    cache = model.init_cache(len(prompts), lp + t)
    key_mask = np.zeros((len(prompts), lp + t), bool)
    key_mask[:, :lp] = mask
    logits, cache = step(cache, ids, np.maximum(np.cumsum(mask, 1) - 1, 0), key_mask, 0)  # prefill
    got = [np.asarray(logits)]
    position = mask.sum(1)
    for i in range(t - 1):
        key_mask[:, lp + i] = True
        logits, cache = step(cache, completion[:, i:i + 1], (position + i)[:, None], key_mask, lp + i)
        got.append(np.asarray(logits))
    got = np.stack(got, 1)
    assert np.isfinite(got).all()
    assert np.abs(got - reference).max() <= 1e-4, np.abs(got - reference).max()


def _last_logits(model, tok, pos, key_mask, cache, slot):
    hidden, cache = model.decode(tok, pos, key_mask, cache, slot)
    return model.logits(hidden[:, -1]), cache


@pytest.mark.parametrize("kind", ["llama", "moe"])
def test_engine_greedy_matches_full_forward_greedy(kind):
    model = tiny_model(kind, seed=2)
    prompts = random_prompts(np.random.default_rng(1), [3, 9, 1, 6])
    max_new = 7
    stop = greedy_by_full_forward(model, prompts[:1], 3)[0][2]  # the first row must stop at its 3rd token
    expected = greedy_by_full_forward(model, prompts, max_new, stop_ids=(stop,))
    engine = JaxRolloutEngine(model, pad_id=PAD, prompt_bucket=16)
    batch = engine.generate(prompts, SamplingParams(max_new_tokens=max_new, temperature=0.5, top_k=1,
                                                    stop_token_ids=(stop,)), num_generations=1, seed=0)
    lengths = batch.completion_mask.sum(1)
    got = [row[:n].tolist() for row, n in zip(batch.completion_ids, lengths)]
    assert got == expected
    assert len(got[0]) <= 3 and got[0][-1] == stop


@pytest.mark.parametrize("kind", ["llama", "mixtral_sliding"])
@pytest.mark.parametrize("spare", [0, 5], ids=["cache=prompt", "cache>prompt"])
def test_prefill_at_slot_0_matches_dense_cache_attention(kind, spare):
    """A prefill at slot 0 runs the forward's attention kernel over the prompt alone (dense scores over the cache
    would take memory quadratic in a long prompt): its hidden states and cache equal the dense cache attention's,
    for left- and right-padded rows, with and without cache slots past the prompt."""
    from jrl.models.layers import cache_attention_mask

    model = tiny_model(kind, seed=2)
    rng = np.random.default_rng()
    b, width = 4, 12
    ids = rng.integers(1, model.config.vocab_size, (b, width)).astype(np.int32)
    key_mask = np.zeros((b, width + spare), bool)
    key_mask[0, 3:width], key_mask[1, :9], key_mask[2, 2:10], key_mask[3, :width] = True, True, True, True
    positions = np.maximum(np.cumsum(key_mask[:, :width], 1) - 1, 0).astype(np.int32)
    dense = cache_attention_mask(jnp.asarray(key_mask), jnp.arange(width, dtype=jnp.int32), jnp.asarray(positions),
                                 sliding_window=model.config.sliding_window)
    fast, fast_cache = model.decode(ids, positions, key_mask, model.init_cache(b, width + spare), 0)
    slow, slow_cache = model.decode(ids, positions, None, model.init_cache(b, width + spare), 0, mask=dense)
    real = key_mask[:, :width, None]
    assert np.isfinite(np.asarray(fast)).all()
    np.testing.assert_allclose(np.asarray(fast) * real, np.asarray(slow) * real, rtol=1e-5, atol=1e-5)
    slots = key_mask[:, :, None, None]
    for f, s in zip(jax.tree.leaves(fast_cache), jax.tree.leaves(slow_cache), strict=True):  # [B, S, K, D]
        # (padding slots hold what the layers computed at padding queries, unspecified there, never attended)
        np.testing.assert_allclose(np.asarray(f) * slots, np.asarray(s) * slots, rtol=1e-5, atol=1e-5)
