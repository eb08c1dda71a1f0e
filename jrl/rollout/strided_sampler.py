"""Block-parallel sampling for strided EBFT (docs/algorithms/ebft.md §9.2): every block of a document generated at once.

One jitted program per call: a causal pass over the documents [B, S] fills a KV cache, the first token of
every block ``j`` is sampled from the document's output at ``a_j - 1``, then ``g - 1`` decode steps feed
the last token of all ``J`` blocks of all ``n`` sample rows in one ``[B·n, J]`` call. Block tokens sit in
the cache after the document in step-major order (slot ``S + u·J + j`` holds ``ŷ^j_u``), so each step
writes ``J`` contiguous slots; the attention of a block token is :func:`jrl.models.strided.allowed` on the
slots' roles (its window ``[a_j - c, a_j)`` of the document and its own earlier tokens), the rule of the
packed training row. Sampling and the reported log-probabilities are those of
:func:`jrl.rollout.sampling.sample_tokens` (temperature, top-k, top-p), so the trainer's strided
log-probs of the same tokens under the same weights equal the sampler's (up to float rounding).

Blocks always get exactly ``g`` tokens (no stop tokens); which blocks count is the caller's business
(:func:`jrl.models.strided.block_valid`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.models.lora import decoding_view
from jrl.models.strided import DOC, allowed
from jrl.rollout.base import SamplingParams
from jrl.rollout.sampling import Draw
from jrl.sharding import to_host


@dataclasses.dataclass(frozen=True)
class StridedSamples:
    """``n`` samples of every block of ``B`` documents (host arrays)."""

    tokens: np.ndarray
    """[B, n, J, g] int32 generated tokens; row ``(b, i)`` is sample ``i`` of document ``b``."""
    logprobs: np.ndarray
    """[B, n, J, g] float32 log-probability of each token under the sampling distribution."""


@dataclasses.dataclass(frozen=True)
class _Program:
    """The static part of one compiled sampling program (temperature and top-p mass are runtime inputs)."""

    context_length: int
    generate_len: int
    num_samples: int
    draw: Draw


def cache_roles(seq_len: int, num: int, generate_len: int, anchor: jax.Array):
    """(block, index, position) [B, S + g·J] of the sampler's cache slots (document, then step-major)."""
    b = anchor.shape[0]
    steps = jnp.arange(num * generate_len, dtype=jnp.int32)
    block = jnp.concatenate([jnp.full((seq_len,), DOC, jnp.int32), steps % num])
    index = jnp.concatenate([jnp.arange(seq_len, dtype=jnp.int32), steps // num])
    block, index = jnp.broadcast_to(block, (b, block.size)), jnp.broadcast_to(index, (b, index.size))
    position = jnp.where(block == DOC, index, jnp.take_along_axis(anchor, jnp.maximum(block, 0), axis=1) + index)
    return block, index, position


def _window(mask, q_position, k_position, sliding_window):
    if sliding_window is None:
        return mask
    return mask & (q_position[:, :, None] - k_position[:, None, :] < sliding_window)


@functools.partial(jax.jit, static_argnames=("graphdef", "program"))
def _sample(graphdef, state, doc_ids, anchor, key, temperature, top_p, *, program):
    p = program
    model = decoding_view(nnx.merge(graphdef, state))  # layers sliced (adapters merged) once per call
    window = model.config.sliding_window
    b, s = doc_ids.shape
    num, g, n = anchor.shape[1], p.generate_len, p.num_samples
    k_block, k_index, k_position = cache_roles(s, num, g, anchor)

    # Document pass: causal over the document slots of the cache.
    doc_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    doc_mask = allowed(DOC, doc_pos[:, :, None], 0, k_block[:, None, :], k_index[:, None, :], p.context_length)
    doc_mask = _window(doc_mask, doc_pos, k_position, window)
    cache = model.init_cache(b, s + num * g)
    hidden, cache = model.decode(doc_ids, doc_pos, None, cache, 0, mask=doc_mask)
    first = jnp.take_along_axis(hidden, jnp.clip(anchor - 1, 0, s - 1)[:, :, None], axis=1)  # [B, J, H]

    def per_sample(x):
        return jnp.repeat(x, n, axis=0)

    cache = jax.tree.map(per_sample, cache)
    anchor_n = per_sample(anchor)
    k_block, k_index, k_position = (per_sample(x) for x in (k_block, k_index, k_position))
    q_block = jnp.broadcast_to(jnp.arange(num, dtype=jnp.int32), (b * n, num))

    def step(carry, u):
        cache, hidden = carry
        logits = model.logits(hidden).reshape(b * n * num, -1)
        token, logprob = p.draw(jax.random.fold_in(key, u), logits, temperature=temperature, top_p=top_p)
        token = token.reshape(b * n, num)
        q_pos = anchor_n + u
        mask = allowed(q_block[:, :, None], u, anchor_n[:, :, None], k_block[:, None, :], k_index[:, None, :],
                       p.context_length)
        mask = _window(mask, q_pos, k_position, window)
        hidden, cache = model.decode(token, q_pos, None, cache, s + u * num, mask=mask)
        return (cache, hidden), (token, logprob.reshape(b * n, num))

    _, (tokens, logprobs) = jax.lax.scan(step, (cache, per_sample(first)), jnp.arange(g, dtype=jnp.int32))
    # [g, B·n, J] -> [B, n, J, g]
    return (jnp.transpose(tokens, (1, 2, 0)).reshape(b, n, num, g),
            jnp.transpose(logprobs, (1, 2, 0)).reshape(b, n, num, g))


def generate_blocks(model, doc_ids, anchor, *, context_length: int, generate_len: int, num_samples: int,
                    params: SamplingParams, seed: int) -> StridedSamples:
    """``num_samples`` block-parallel samples of every block of the right-padded documents ``doc_ids``
    [B, S] with anchors ``anchor`` [B, J] (:func:`jrl.models.strided.anchors`, every ``a_j >= c >= 1``).
    ``params``: temperature, top-k and top-p (``max_new_tokens`` and stop ids do not apply: each block has
    ``generate_len`` tokens). Reproducible for a ``seed`` on a given device setup."""
    doc_ids = np.asarray(doc_ids, np.int32)
    anchor = np.asarray(anchor, np.int32)
    if doc_ids.ndim != 2 or anchor.ndim != 2 or anchor.shape[0] != doc_ids.shape[0]:
        raise ValueError(f"generate_blocks: doc_ids {doc_ids.shape} must be [B, S] and anchors {anchor.shape} [B, J]")
    if anchor.shape[1] == 0:
        raise ValueError("generate_blocks: anchors has no blocks (J = 0); the documents are too short for "
                         "context_length + generate_len")
    if context_length < 1 or generate_len < 1 or num_samples < 1:
        raise ValueError(f"generate_blocks: context_length={context_length}, generate_len={generate_len} and "
                         f"num_samples={num_samples} must all be >= 1")
    if anchor.min() < context_length:
        raise ValueError(f"generate_blocks: anchor {int(anchor.min())} < context_length={context_length}; "
                         "the first anchor must leave a full context window")
    program = _Program(context_length=int(context_length), generate_len=int(generate_len),
                       num_samples=int(num_samples), draw=Draw.of(params))
    graphdef, state = nnx.split(model)
    tokens, logprobs = _sample(graphdef, state, jnp.asarray(doc_ids), jnp.asarray(anchor), jax.random.key(int(seed)),
                               np.float32(params.temperature), np.float32(params.top_p), program=program)
    return StridedSamples(tokens=to_host(tokens).astype(np.int32), logprobs=to_host(logprobs).astype(np.float32))
