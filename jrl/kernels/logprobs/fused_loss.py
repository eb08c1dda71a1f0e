"""A loss-fused LM head: a row-separable token loss of the completions, with its gradients w.r.t. the
hidden states and the head computed in the same pass as the logits.

``token_logprobs`` must recompute the logits in its backward (it does not know the loss), so a training
step costs four ``[N, H] x [H, V]`` matmuls. A GRPO-family loss is a sum of per-row terms once the step's
normalisers are fixed, so its gradient w.r.t. a row's log-probs (and entropies) is known as soon as that
row's logits are: per chunk of rows this computes the logits once, the log-probs and entropies, the
chunk's loss and ``g = dloss/dlogp`` (autodiff of the small per-row function), then ``dlogits = g ·
(onehot - p)`` (plus the entropy term), ``dh = dlogits · Wᵀ`` and ``dW += hᵀ · dlogits``: three matmuls,
memory bounded by one chunk's ``[rows · T, V]`` float32 logits. The backward only scales the saved
gradients by the loss cotangent. (The design of Liger's fused linear losses.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_TOKENS = 2048
"""Tokens per chunk: the float32 logits of a chunk are ``tokens x V x 4`` bytes (1 GiB at V = 128k)."""


def rows_per_chunk(num_rows: int, row_len: int, chunk_tokens: int) -> int:
    """The largest divisor of ``num_rows`` whose rows hold at most ``max(row_len, chunk_tokens)`` tokens."""
    best = 1
    for c in range(1, num_rows + 1):
        if num_rows % c == 0 and c * row_len <= max(row_len, chunk_tokens):
            best = c
    return best


def _logsumexp_entropy(logits: jax.Array, with_entropy: bool) -> tuple[jax.Array, jax.Array | None]:
    """(log-sum-exp, entropy or None) of each row of float32 ``logits`` [N, V] in one pass over them.

    One variadic reduction carries (running max m, Σ exp(x - m), Σ exp(x - m)·x) and rescales when the max
    grows (an online softmax), instead of three passes (max, sum of exponentials, entropy): the logits of a
    chunk are ``N x V`` float32, read from memory by each pass. Entropy = lse - Σ p·x."""

    def combine(a, b):
        (m1, s1, *t1), (m2, s2, *t2) = a, b
        m = jnp.maximum(m1, m2)
        # Where both are the identity (m = -inf), m1 - m is nan: weight 1 (their sums are 0).
        w1 = jnp.where(m1 == m, 1.0, jnp.exp(m1 - m))
        w2 = jnp.where(m2 == m, 1.0, jnp.exp(m2 - m))
        return (m, s1 * w1 + s2 * w2, *(x1 * w1 + x2 * w2 for x1, x2 in zip(t1, t2)))

    ones = jnp.ones_like(logits)
    operands = (logits, ones, logits) if with_entropy else (logits, ones)
    inits = (-jnp.inf, 0.0, 0.0)[:len(operands)]
    m, s, *t = jax.lax.reduce(operands, tuple(jnp.float32(v) for v in inits), combine, (1,))
    lse = m + jnp.log(s)
    return lse, (lse - t[0] / s if with_entropy else None)


def _chunk_grads(h, w, y, rows, aux, row_loss, inv_temp, with_entropy):
    """(loss, logp [c, T], entropy [c, T], dh [c, T, H], dW [H, V] float32) of one chunk of rows.

    Written so XLA reads the float32 logits few times: the log-sum-exp, then one elementwise pass that
    forms ``dlogits`` (softmax, one-hot by iota comparison, scale, cast) for both matmuls."""
    c, t, hdim = h.shape
    hf = h.reshape(c * t, hdim)
    yf = y.reshape(c * t)
    logits = jnp.dot(hf, w.astype(hf.dtype), preferred_element_type=jnp.float32) * inv_temp
    lse, ent = _logsumexp_entropy(logits, with_entropy)
    lp = jnp.take_along_axis(logits, yf[:, None], axis=-1)[:, 0] - lse
    ent_rows = None if ent is None else ent.reshape(c, t)

    def f(lp_rows, ent_rows):
        return row_loss(lp_rows, ent_rows, rows, aux)

    if with_entropy:
        loss, (g_lp, g_ent) = jax.value_and_grad(f, argnums=(0, 1))(lp.reshape(c, t), ent_rows)
    else:
        loss, g_lp = jax.value_and_grad(f)(lp.reshape(c, t), None)
    g_lp = g_lp.reshape(c * t, 1)
    p = jnp.exp(logits - lse[:, None])
    onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == yf[:, None]
    dlogits = jnp.where(onehot, g_lp, 0.0) - g_lp * p
    if with_entropy:
        # dH/dz = -p (log p + H)
        dlogits = dlogits - g_ent.reshape(c * t, 1) * p * (logits - lse[:, None] + ent[:, None])
    dl = (dlogits * inv_temp).astype(hf.dtype)
    dh = jnp.dot(dl, w.astype(hf.dtype).T, preferred_element_type=jnp.float32).reshape(c, t, hdim)
    dw = jnp.dot(hf.T, dl, preferred_element_type=jnp.float32)
    return loss, lp.reshape(c, t), ent_rows, dh, dw


def _forward(hidden, lm_head, targets, rows, aux, row_loss, temperature, with_entropy, chunk):
    r, t, hdim = hidden.shape
    n = r // chunk
    inv_temp = 1.0 / temperature

    def split(x):
        return x.reshape((n, chunk) + x.shape[1:])

    def chunk_grads(xs):
        h, y, rows_c = xs
        return _chunk_grads(h, lm_head, y, rows_c, aux, row_loss, inv_temp, with_entropy)

    def step(dw, xs):
        loss, lp, ent, dh, dw_c = chunk_grads(xs)
        return dw + dw_c, (loss, lp, ent, dh)

    # The first chunk's head gradient starts the sum (no zero-filled float32 [H, V] accumulator to add it to).
    chunks = (split(hidden), split(targets), jax.tree.map(split, rows))
    loss0, lp0, ent0, dh0, dw = chunk_grads(jax.tree.map(lambda x: x[0], chunks))
    firsts = (loss0, lp0, ent0, dh0)
    if n > 1:
        dw, rest = jax.lax.scan(step, dw, jax.tree.map(lambda x: x[1:], chunks))
        losses, lp, ent, dh = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), firsts, rest)
    else:
        losses, lp, ent, dh = jax.tree.map(lambda a: a[None], firsts)
    lp = lp.reshape(r, t)
    ent = None if ent is None else ent.reshape(r, t)
    return jnp.sum(losses), lp, ent, dh.reshape(r, t, hdim).astype(hidden.dtype), dw.astype(lm_head.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fused(hidden, lm_head, targets, rows, aux, row_loss, temperature, with_entropy, chunk):
    loss, lp, ent, _, _ = _forward(hidden, lm_head, targets, rows, aux, row_loss, temperature, with_entropy, chunk)
    return loss, lp, ent


def _fused_fwd(hidden, lm_head, targets, rows, aux, row_loss, temperature, with_entropy, chunk):
    loss, lp, ent, dh, dw = _forward(hidden, lm_head, targets, rows, aux, row_loss, temperature, with_entropy, chunk)
    return (loss, lp, ent), (dh, dw, targets, rows, aux)


def _fused_bwd(row_loss, temperature, with_entropy, chunk, res, cts):
    dh, dw, targets, rows, aux = res
    g = cts[0]
    none = functools.partial(jax.tree.map, lambda _: None)
    return ((g * dh.astype(jnp.float32)).astype(dh.dtype), (g * dw.astype(jnp.float32)).astype(dw.dtype), None,
            none(rows), none(aux))


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_head_loss(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, row_loss: Callable, rows, aux=None, *,
                    temperature: float = 1.0, with_entropy: bool = False,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """A row-separable loss of the tokens ``targets`` under the head, and its log-probs.

    Args:
      hidden: [R, T, H] hidden states predicting ``targets`` [R, T].
      lm_head: [H, V] output projection; logits are ``hidden · lm_head / temperature`` (float32).
      row_loss: ``row_loss(logp [c, T], entropy [c, T] or None, rows_chunk, aux) -> scalar`` (hashable, e.g.
        a frozen dataclass). The loss of the whole batch must be the sum of ``row_loss`` over any split of
        the rows into chunks (per-row terms under step-global normalisers passed in ``aux``).
      rows: pytree of per-row arrays (leading axis R) given chunk by chunk to ``row_loss``.
      aux: pytree given whole to every chunk (e.g. normalisers). Neither ``rows`` nor ``aux`` gets gradients.
      with_entropy: compute the entropy of each token's distribution (and differentiate ``row_loss``
        through it).
      chunk_tokens: about this many tokens per chunk (whole rows; at least one row).

    Returns:
      (loss, logp [R, T] float32, entropy [R, T] float32 or None). ``loss`` is differentiable w.r.t.
      ``hidden`` and ``lm_head``; ``logp`` and ``entropy`` are values only (for metrics).
    """
    if hidden.ndim != 3 or lm_head.ndim != 2 or hidden.shape[2] != lm_head.shape[0]:
        raise ValueError(f"fused_head_loss needs hidden [R, T, H] and lm_head [H, V]; got {hidden.shape}, "
                         f"{lm_head.shape}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets must be [R, T] = {hidden.shape[:2]}, got {targets.shape}")
    chunk = rows_per_chunk(hidden.shape[0], hidden.shape[1], chunk_tokens)
    loss, lp, ent = _fused(hidden, lm_head, targets, rows, aux, row_loss, float(temperature), bool(with_entropy),
                           chunk)
    return loss, jax.lax.stop_gradient(lp), None if ent is None else jax.lax.stop_gradient(ent)
