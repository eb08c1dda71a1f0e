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

A row longer than ``max_row_tokens`` (a long completion, or a packed row of many) would make one chunk of
``T x V`` float32 logits (16 GiB at 32k tokens and a 128k vocabulary). Such rows are split along their tokens,
and since the loss's gradient w.r.t. a token's log-prob may depend on its whole row (a sequence-level ratio),
they take two passes: the log-probs of every chunk of tokens, ``g`` of the whole rows, then per chunk the logits
again and ``dh``, ``dW``: four matmuls (as ``token_logprobs``), memory bounded by ``chunk_tokens``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

DEFAULT_CHUNK_TOKENS = 2048
"""Tokens per chunk: the float32 logits of a chunk are ``tokens x V x 4`` bytes (1 GiB at V = 128k)."""

DEFAULT_MAX_ROW_TOKENS = 8192
"""Rows up to this long are chunked whole (one pass, three matmuls; a chunk's float32 logits at most 4 GiB at
V = 128k); longer ones by ``chunk_tokens`` tokens in two passes (four matmuls)."""


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


def _logits(hf, w, inv_temp):
    """float32 logits [N, V] of hidden states ``hf`` [N, H] (products in their dtype, float32 sums)."""
    return jnp.dot(hf, w.astype(hf.dtype), preferred_element_type=jnp.float32) * inv_temp


def _head_logprobs(hf, yf, *, lm_head, inv_temp, with_entropy):
    """(float32 logits [N, V], log-sum-exp [N], entropy [N] or None, log-prob [N]) of hidden states ``hf`` [N, H]
    predicting ``yf`` [N]."""
    logits = _logits(hf, lm_head, inv_temp)
    lse, ent = _logsumexp_entropy(logits, with_entropy)
    lp = jnp.take_along_axis(logits, yf[:, None], axis=-1)[:, 0] - lse
    return logits, lse, ent, lp


def _head_grads(hf, w, yf, logits, lse, ent, g_lp, g_ent, inv_temp):
    """(dh [N, H] float32, dW [H, V] float32) of a loss whose gradients w.r.t. the tokens' log-probs and entropies
    are ``g_lp`` and ``g_ent`` [N] (None: no entropy term), from the tokens' :func:`_head_logprobs`.

    Written so XLA reads the float32 logits few times: one elementwise pass forms ``dlogits`` (softmax, one-hot by
    iota comparison, scale, cast) for both matmuls."""
    g_lp = g_lp[:, None]
    p = jnp.exp(logits - lse[:, None])
    onehot = jax.lax.broadcasted_iota(jnp.int32, logits.shape, 1) == yf[:, None]
    dlogits = jnp.where(onehot, g_lp, 0.0) - g_lp * p
    if g_ent is not None:
        # dH/dz = -p (log p + H)
        dlogits = dlogits - g_ent[:, None] * p * (logits - lse[:, None] + ent[:, None])
    dl = (dlogits * inv_temp).astype(hf.dtype)
    dh = jnp.dot(dl, w.astype(hf.dtype).T, preferred_element_type=jnp.float32)
    dw = jnp.dot(hf.T, dl, preferred_element_type=jnp.float32)
    return dh, dw


def _loss_grads(row_loss, lp, ent, rows, aux):
    """(loss, dloss/dlp, dloss/dent or None) of ``row_loss`` over the rows' log-probs and entropies [c, T]."""

    def f(lp, ent):
        return row_loss(lp, ent, rows, aux)

    if ent is None:
        loss, g_lp = jax.value_and_grad(f)(lp, None)
        return loss, g_lp, None
    loss, (g_lp, g_ent) = jax.value_and_grad(f, argnums=(0, 1))(lp, ent)
    return loss, g_lp, g_ent


def _summed_scan(fn, xs):
    """(Σ of ``fn``'s first output, its other outputs stacked) over the leading axis of ``xs``. The first item's sum
    starts the scan's carry (no zero-filled accumulator, e.g. a float32 [H, V] head gradient, to add it to)."""
    total, *first = fn(jax.tree.map(lambda x: x[0], xs))
    if jax.tree.leaves(xs)[0].shape[0] == 1:
        return total, jax.tree.map(lambda a: a[None], first)

    def step(carry, x):
        part, *out = fn(x)
        return carry + part, out

    total, rest = jax.lax.scan(step, total, jax.tree.map(lambda x: x[1:], xs))
    return total, jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)


def _forward_rows(hidden, lm_head, targets, rows, aux, row_loss, inv_temp, with_entropy, chunk):
    """One pass over chunks of ``chunk`` whole rows: the logits, the chunk's loss and its gradients at once."""
    r, t, hdim = hidden.shape
    n = r // chunk

    def split(x):
        return x.reshape((n, chunk) + x.shape[1:])

    def chunk_grads(xs):
        h, y, rows_c = xs
        hf, yf = h.reshape(chunk * t, hdim), y.reshape(chunk * t)
        logits, lse, ent, lp = _head_logprobs(hf, yf, lm_head=lm_head, inv_temp=inv_temp, with_entropy=with_entropy)
        loss, g_lp, g_ent = _loss_grads(row_loss, lp.reshape(chunk, t), None if ent is None else ent.reshape(chunk, t),
                                        rows_c, aux)
        dh, dw = _head_grads(hf, lm_head, yf, logits, lse, ent, g_lp.reshape(-1),
                             None if g_ent is None else g_ent.reshape(-1), inv_temp)
        return dw, loss, lp, ent, dh

    dw, (losses, lp, ent, dh) = _summed_scan(chunk_grads, (split(hidden), split(targets), jax.tree.map(split, rows)))
    return jnp.sum(losses), lp.reshape(r, t), None if ent is None else ent.reshape(r, t), dh.reshape(r, t, hdim), dw


def _forward_tokens(hidden, lm_head, targets, rows, aux, row_loss, inv_temp, with_entropy, tokens):
    """Two passes over chunks of at most ``tokens`` tokens, as many as the fewest such chunks need (rows split
    anywhere, the last chunk padded): every token's log-prob, the loss and its gradients over the whole rows, then per
    chunk the logits again and the head gradients."""
    r, t, hdim = hidden.shape
    n = -(-r * t // tokens)
    tokens = -(-r * t // n)
    pad = n * tokens - r * t

    def split(x):
        x = x.reshape((r * t,) + x.shape[2:])
        return jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)).reshape((n, tokens) + x.shape[1:])

    def whole(x):
        return x.reshape(n * tokens)[:r * t].reshape(r, t)

    hs, ys = split(hidden), split(targets)

    def logprobs(xs):
        return _head_logprobs(*xs, lm_head=lm_head, inv_temp=inv_temp, with_entropy=with_entropy)[1:]

    lse, ent, lp = jax.lax.map(logprobs, (hs, ys))
    lp_rows, ent_rows = whole(lp), None if ent is None else whole(ent)
    loss, g_lp, g_ent = _loss_grads(row_loss, lp_rows, ent_rows, rows, aux)

    def head_grads(xs):
        h, y, lse_c, ent_c, g_lp_c, g_ent_c = xs
        dh, dw = _head_grads(h, lm_head, y, _logits(h, lm_head, inv_temp), lse_c, ent_c, g_lp_c, g_ent_c, inv_temp)
        return dw, dh

    dw, (dh,) = _summed_scan(head_grads, (hs, ys, lse, ent, split(g_lp), None if g_ent is None else split(g_ent)))
    dh = dh.reshape(n * tokens, hdim)[:r * t].reshape(r, t, hdim)
    return loss, lp_rows, ent_rows, dh, dw


def _forward(hidden, lm_head, targets, rows, aux, row_loss, temperature, with_entropy, plan):
    """(loss, logp, entropy, dh, dW) under ``plan``: ("rows", rows per chunk) or ("tokens", tokens per chunk)."""
    kind, size = plan
    fn = _forward_rows if kind == "rows" else _forward_tokens
    loss, lp, ent, dh, dw = fn(hidden, lm_head, targets, rows, aux, row_loss, 1.0 / temperature, with_entropy, size)
    return loss, lp, ent, dh.astype(hidden.dtype), dw.astype(lm_head.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _fused(hidden, lm_head, targets, rows, aux, row_loss, temperature, with_entropy, plan):
    loss, lp, ent, _, _ = _forward(hidden, lm_head, targets, rows, aux, row_loss, temperature, with_entropy, plan)
    return loss, lp, ent


def _fused_fwd(hidden, lm_head, targets, rows, aux, row_loss, temperature, with_entropy, plan):
    loss, lp, ent, dh, dw = _forward(hidden, lm_head, targets, rows, aux, row_loss, temperature, with_entropy, plan)
    return (loss, lp, ent), (dh, dw, targets, rows, aux)


def _fused_bwd(row_loss, temperature, with_entropy, plan, res, cts):
    dh, dw, targets, rows, aux = res
    g = cts[0]
    none = functools.partial(jax.tree.map, lambda _: None)
    return ((g * dh.astype(jnp.float32)).astype(dh.dtype), (g * dw.astype(jnp.float32)).astype(dw.dtype), None,
            none(rows), none(aux))


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_head_loss(hidden: jax.Array, lm_head: jax.Array, targets: jax.Array, row_loss: Callable, rows, aux=None, *,
                    temperature: float = 1.0, with_entropy: bool = False, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                    max_row_tokens: int = DEFAULT_MAX_ROW_TOKENS) -> tuple[jax.Array, jax.Array, jax.Array | None]:
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
      chunk_tokens: about this many tokens per chunk (whole rows; at least one row unless rows are split).
      max_row_tokens: rows longer than this are split into chunks of ``chunk_tokens`` tokens (two passes: module
        docstring).

    Returns:
      (loss, logp [R, T] float32, entropy [R, T] float32 or None). ``loss`` is differentiable w.r.t.
      ``hidden`` and ``lm_head``; ``logp`` and ``entropy`` are values only (for metrics).
    """
    if hidden.ndim != 3 or lm_head.ndim != 2 or hidden.shape[2] != lm_head.shape[0]:
        raise ValueError(f"fused_head_loss needs hidden [R, T, H] and lm_head [H, V]; got {hidden.shape}, "
                         f"{lm_head.shape}")
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets must be [R, T] = {hidden.shape[:2]}, got {targets.shape}")
    r, t = targets.shape
    plan = ("tokens", int(chunk_tokens)) if t > max_row_tokens else ("rows", rows_per_chunk(r, t, chunk_tokens))
    loss, lp, ent = _fused(hidden, lm_head, targets, rows, aux, row_loss, float(temperature), bool(with_entropy),
                           plan)
    return loss, jax.lax.stop_gradient(lp), None if ent is None else jax.lax.stop_gradient(ent)
