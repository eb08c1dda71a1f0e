"""Sampling semantics of the embedded engine: top-k / top-p filtering against a NumPy reference, the
sampled frequencies against the reported distribution, stop tokens / masks / truncation, greedy limits,
seeds, the ``num_generations`` row layout, weight sync, and input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from rollout_testlib import PAD, VOCAB, greedy_by_full_forward, random_prompts, tiny_model

from jrl.rollout import RolloutEngine, SamplingParams
from jrl.rollout.jax_engine import JaxRolloutEngine
from jrl.rollout.sampling import filter_logits, sample_tokens


def np_filter(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Reference filter, one row at a time in float64: top-k, then the nucleus of the renormalised rest."""
    out = np.full(scaled.shape, -np.inf)
    for r, row in enumerate(scaled.astype(np.float64)):
        order = np.argsort(-row, kind="stable")
        kept = order[:top_k] if top_k > 0 else order
        probs = np.exp(row[kept] - row[kept].max())
        probs /= probs.sum()
        kept = kept[(np.cumsum(probs) - probs) < top_p]
        out[r, kept] = row[kept]
    return out


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (5, 1.0), (0, 0.6), (7, 0.8), (1, 1.0), (0, 1e-6)])
def test_filter_logits_matches_numpy(top_k, top_p):
    scaled = np.random.default_rng(top_k).normal(size=(16, 40)).astype(np.float32) * 2
    got = np.asarray(filter_logits(jnp.asarray(scaled), top_k=top_k, top_p=None if top_p == 1.0 else top_p))
    expected = np_filter(scaled, top_k, top_p)
    assert (np.isinf(got) == np.isinf(expected)).all()
    finite = np.isfinite(expected)
    assert np.array_equal(got[finite], scaled[finite])


def test_sample_frequencies_and_logprobs_follow_the_filtered_distribution():
    logits = np.random.default_rng(3).normal(size=(1, 10)).astype(np.float32) * 1.5
    temperature, top_k, top_p, n = 0.8, 6, 0.85, 40000
    tokens, logprobs = sample_tokens(jax.random.key(0), jnp.asarray(np.repeat(logits, n, 0)),
                                     temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, logprobs = np.asarray(tokens), np.asarray(logprobs)
    z = np_filter(logits / temperature, top_k, top_p)[0]
    probs = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
    freq = np.bincount(tokens, minlength=10) / n
    assert (freq[probs == 0] == 0).all() and (probs == 0).sum() >= 4  # filtering removed tokens
    assert np.abs(freq - probs).max() < 0.015  # > 5 standard errors at n = 40000
    np.testing.assert_allclose(logprobs, np.log(probs[tokens]), atol=1e-5)


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=4)


@pytest.fixture(scope="module")
def engine(llama):
    return JaxRolloutEngine(llama, pad_id=PAD, prompt_bucket=16)


PROMPTS = random_prompts(np.random.default_rng(5), [3, 8, 5])
MAX_NEW, G = 6, 2  # one shape for the engine tests below: the programs differ only in sampling parameters


@pytest.fixture(scope="module")
def greedy_expected(llama):
    return greedy_by_full_forward(llama, PROMPTS, MAX_NEW)


def test_engine_is_a_rollout_engine(engine):
    assert isinstance(engine, RolloutEngine)


def test_stop_tokens_masks_and_truncation(engine):
    stops = tuple(range(1, VOCAB, 6))  # 8 of 48 ids stop: some rows stop early, some run to the end
    max_new = MAX_NEW
    batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=max_new, temperature=1.0, stop_token_ids=stops),
                            num_generations=G, seed=3)
    lengths = batch.completion_mask.sum(1)
    assert batch.completion_ids.shape == (3 * G, max_new) and batch.truncated.shape == (3 * G,)
    assert (lengths < max_new).any() and batch.truncated.any()
    for ids, mask, logp, n, truncated in zip(batch.completion_ids, batch.completion_mask, batch.sampling_logprobs,
                                             lengths, batch.truncated):
        assert (mask[:n] == 1).all() and (mask[n:] == 0).all()
        assert not any(t in stops for t in ids[:n - 1])
        assert truncated == (ids[n - 1] not in stops)
        assert not truncated or n == max_new
        assert (ids[n:] == PAD).all() and (logp[n:] == 0).all() and (logp[:n] < 0).all()


def test_greedy_limits_agree_with_full_forward(engine, greedy_expected):
    for params in (SamplingParams(max_new_tokens=MAX_NEW, temperature=1.3, top_k=1),
                   SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, top_p=1e-6)):
        batch = engine.generate(PROMPTS, params, num_generations=G, seed=11)
        assert batch.completion_ids.tolist() == [row for row in greedy_expected for _ in range(G)]
        assert np.abs(batch.sampling_logprobs).max() == 0  # the filtered distribution is a point mass


def test_seeds_reproducible_and_distinct(engine):
    params = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0)
    a = engine.generate(PROMPTS, params, num_generations=G, seed=123)
    b = engine.generate(PROMPTS, params, num_generations=G, seed=123)
    c = engine.generate(PROMPTS, params, num_generations=G, seed=124)
    assert np.array_equal(a.completion_ids, b.completion_ids)
    assert np.array_equal(a.sampling_logprobs, b.sampling_logprobs)
    assert not np.array_equal(a.completion_ids, c.completion_ids)


def test_num_generations_layout(engine):
    batch = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, temperature=0.9), num_generations=G,
                            seed=0)
    assert batch.prompt_ids.shape[0] == len(PROMPTS) * G
    for p, prompt in enumerate(PROMPTS):
        for r in range(p * G, p * G + G):
            assert batch.prompt_ids[r][batch.prompt_mask[r] == 1].tolist() == prompt
        group = batch.completion_ids[p * G:p * G + G]
        assert len({tuple(row) for row in group}) > 1  # each generation is its own sample
    # (greedy rows p*G .. p*G+G-1 equal prompt p's own greedy completion: test_greedy_limits_agree_...)


def test_sync_weights_points_at_the_model_without_copying(llama):
    engine = JaxRolloutEngine(llama, pad_id=PAD, prompt_bucket=16)
    leaves = jax.tree.leaves(nnx.state(llama))
    assert all(a is b for a, b in zip(jax.tree.leaves(engine._state), leaves, strict=True))
    other = tiny_model("llama", seed=5)
    greedy = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.3, top_k=1)
    before = engine.generate(PROMPTS, greedy, num_generations=G, seed=0)
    engine.sync_weights(other, 7)
    after = engine.generate(PROMPTS, greedy, num_generations=G, seed=0)
    assert before.policy_version == 0 and after.policy_version == 7
    assert after.completion_ids.tolist() == [row for row in greedy_by_full_forward(other, PROMPTS, MAX_NEW)
                                             for _ in range(G)]
    assert not np.array_equal(before.completion_ids, after.completion_ids)


def test_bad_inputs_give_clear_errors(engine, llama):
    params = SamplingParams(max_new_tokens=2)
    with pytest.raises(ValueError, match="num_generations=0"):
        engine.generate(PROMPTS, params, num_generations=0, seed=0)
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty"):
        engine.generate([[3], []], params, num_generations=1, seed=0)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.generate([], params, num_generations=1, seed=0)
    with pytest.raises(ValueError, match="prompt_bucket=0"):
        JaxRolloutEngine(llama, pad_id=PAD, prompt_bucket=0)


@pytest.mark.parametrize("block", [64, 1024])
def test_inverse_cdf_draw_across_blocks_follows_the_distribution(block):
    """The two-level draw (block sums, then one block) on a vocabulary of several blocks with a ragged last block
    and masked tokens: frequencies match the probabilities, a masked token is never drawn."""
    from jrl.rollout.sampling import inverse_cdf_draw

    rng = np.random.default_rng(7)
    v, n = 300, 60000
    scaled = np.full(v, -np.inf, np.float32)
    live = rng.choice(v, size=12, replace=False)
    scaled[live] = rng.normal(size=12).astype(np.float32)
    probs = np.exp(scaled - scaled[live].max())
    probs /= probs.sum()
    rows = jnp.asarray(np.repeat(scaled[None], n, 0))
    tokens, log_z = inverse_cdf_draw(jax.random.key(1), rows, block=block)
    np.testing.assert_allclose(np.asarray(log_z), np.asarray(jax.nn.logsumexp(rows, axis=-1)), rtol=1e-6)
    tokens = np.asarray(tokens)
    freq = np.bincount(tokens, minlength=v) / n
    assert (freq[probs == 0] == 0).all()
    assert np.abs(freq - probs).max() < 0.012  # > 5 standard errors at n = 60000
