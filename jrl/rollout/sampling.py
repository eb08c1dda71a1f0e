"""Token sampling from float32 logits: temperature, top-k, top-p (nucleus), and the reported logprob.

The distribution sampled from is ``softmax(filter(logits / temperature))`` where ``filter`` keeps the
``top_k`` largest scaled logits (0 = all), then the smallest set of the remaining tokens, most likely first,
whose renormalised probability mass reaches ``top_p``, and sets the rest to ``-inf`` (the order of
transformers' and vLLM's samplers). The reported logprob of a sampled token is its log-probability under
that *same* distribution, i.e. the log-probability of the behaviour policy that actually produced it.

With ``top_k=0`` and ``top_p=1`` nothing is filtered and the reported logprob is exactly the trainer's
``log_softmax(logits / temperature)[token]``. With filtering it is larger by ``-log(kept mass)`` (the
renormalisation), so an importance ratio trainer/sampler measures the truncation as a policy difference.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

_NEG_INF = -jnp.inf


def filter_logits(scaled: jax.Array, *, top_k: int = 0, top_p: float | jax.Array | None = None) -> jax.Array:
    """``scaled`` [..., V] (float32 logits already divided by the temperature) with the tokens outside the
    top-k / top-p set at ``-inf``. ``top_k`` is static (0 = off); ``top_p`` may be traced (``None`` = off,
    which skips the vocabulary sort). Ties at a threshold are kept."""
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        scaled = jnp.where(scaled < kth, _NEG_INF, scaled)
    if top_p is not None:
        ordered = jnp.sort(scaled, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly more likely tokens
        kept = mass_before < top_p  # always keeps the most likely token
        threshold = jnp.min(jnp.where(kept, ordered, jnp.inf), axis=-1, keepdims=True)
        scaled = jnp.where(scaled < threshold, _NEG_INF, scaled)
    return scaled


def sample_tokens(key: jax.Array, logits: jax.Array, *, temperature: float | jax.Array, top_k: int = 0,
                  top_p: float | jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Sample one token per row of ``logits`` [B, V]; returns (tokens [B] int32, logprobs [B] float32 of
    those tokens under the filtered distribution at ``temperature``, see the module docstring)."""
    scaled = filter_logits(logits.astype(jnp.float32) / temperature, top_k=top_k, top_p=top_p)
    tokens, log_z = inverse_cdf_draw(key, scaled)
    return tokens, jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - log_z


def inverse_cdf_draw(key: jax.Array, scaled: jax.Array, *, block: int = 1024) -> tuple[jax.Array, jax.Array]:
    """One token per row of ``softmax(scaled)`` [B, V] and the rows' log normalisers [B], by inverse CDF: one
    uniform per row, located in the cumulative mass first among sums of ``block`` tokens (the same pass gives
    the normaliser), then inside the one block it falls in. Only B random numbers are drawn, where
    ``jax.random.categorical``'s Gumbel-max draw makes one per token (8M per decode step at a 128K vocabulary and
    64 rows: the largest kernel of the sampling step on an H100). A token of probability 0 (filtered, -inf) is
    never drawn, also where rounding would put the uniform on it."""
    b, v = scaled.shape
    block = min(block, v)
    top = jnp.max(scaled, axis=-1, keepdims=True)
    weights = jnp.exp(scaled - top)
    whole = v // block * block
    sums = weights[:, :whole].reshape(b, -1, block).sum(axis=-1)
    if whole < v:
        sums = jnp.concatenate([sums, weights[:, whole:].sum(axis=-1, keepdims=True)], axis=-1)
    ends = jnp.cumsum(sums, axis=-1)
    target = jax.random.uniform(key, (b,), jnp.float32) * ends[:, -1]
    chosen = _first_reaching(ends, sums, target)
    slots = chosen[:, None] * block + jnp.arange(block)
    inside = jnp.where(slots < v, jnp.exp(jnp.take_along_axis(scaled, jnp.minimum(slots, v - 1), axis=-1) - top), 0.0)
    before = jnp.take_along_axis(ends - sums, chosen[:, None], axis=-1)[:, 0]
    offset = _first_reaching(jnp.cumsum(inside, axis=-1), inside, target - before)
    return (chosen * block + offset).astype(jnp.int32), top[:, 0] + jnp.log(ends[:, -1])


def _first_reaching(cumulative: jax.Array, mass: jax.Array, target: jax.Array) -> jax.Array:
    """Per row the first index with positive ``mass`` whose ``cumulative`` mass exceeds ``target``; the last index
    with positive mass where rounding puts the target past every one."""
    hit = (cumulative > target[:, None]) & (mass > 0)
    width = mass.shape[-1]
    last = width - 1 - jnp.argmax(mass[:, ::-1] > 0, axis=-1)
    return jnp.where(jnp.any(hit, axis=-1), jnp.argmax(hit, axis=-1), last)


@dataclasses.dataclass(frozen=True)
class Draw:
    """What a compiled sampler fixes of its sampling parameters (part of its jit cache key): ``top_k`` and whether
    top-p is on. The temperature and the top-p mass are runtime inputs, so changing them does not recompile."""

    top_k: int
    use_top_p: bool

    @classmethod
    def of(cls, params) -> Draw:
        """The draw of :class:`~jrl.rollout.base.SamplingParams` ``params``."""
        return cls(top_k=int(params.top_k), use_top_p=params.top_p < 1.0)

    def __call__(self, key: jax.Array, logits: jax.Array, *, temperature, top_p) -> tuple[jax.Array, jax.Array]:
        """:func:`sample_tokens` of ``logits`` [B, V] with this draw's filters."""
        return sample_tokens(key, logits, temperature=temperature, top_k=self.top_k,
                             top_p=top_p if self.use_top_p else None)


@dataclasses.dataclass(frozen=True)
class Decoding:
    """The static part of a completion sampler's program: how a token is drawn, where a row ends (a stop id, or
    ``max_new_tokens``) and the id filling a row after it ended."""

    draw: Draw
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    pad_id: int

    @classmethod
    def of(cls, params, pad_id: int) -> Decoding:
        """The decoding of :class:`~jrl.rollout.base.SamplingParams` ``params``."""
        return cls(draw=Draw.of(params), max_new_tokens=params.max_new_tokens,
                   stop_token_ids=tuple(int(t) for t in params.stop_token_ids), pad_id=int(pad_id))

    def is_stop(self, token: jax.Array) -> jax.Array:
        """Whether each of ``token`` [B] is a stop id."""
        stops = jnp.asarray(self.stop_token_ids, jnp.int32).reshape(-1)
        return jnp.any(token[:, None] == stops[None, :], axis=-1)
