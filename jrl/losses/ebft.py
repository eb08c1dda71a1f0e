"""EBFT (energy-based fine-tuning) rewards and losses as pure JAX functions on arrays (docs/algorithms/ebft.md §4–§7).

The pipeline of one step: hidden states of a few layers of the frozen feature network →
:func:`pool_hidden` per layer → :func:`embed_layers` (optionally L2-normalising each pooled layer,
docs/algorithms/ebft.md §14 point 1) → :func:`feature_rewards` (whiten or L2-normalise, alignment, diversity, CFM)
→ :func:`ebft_advantages` → a policy loss (GRPO surrogate in structured mode, :func:`reinforce_loss`
in strided mode, optionally plus :func:`cross_entropy_loss` on ground-truth tokens).

All math is float32 whatever the input dtype. Shapes are static; the group size ``n`` and every
option are Python values, so each function is jit-able with them static.

Padding is never assumed to be on one side: every position is found from the token mask
(``mask[b, s] = 1`` for a real token), by the token's ordinal among the real tokens of its row.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jrl.losses.advantages import compute_advantages

POOL_METHODS = ("last_token", "mean_pooling", "completion_mean", "concat")
WHITENING_SCOPES = ("group", "batch")

COS_EPS = 1e-8
"""Cosine similarity divides by max(‖a‖·‖b‖, COS_EPS) (axolotl's constant)."""
INV_S_EPS = 1e-12
"""Group whitening inverts kept singular values as 1 / (s + INV_S_EPS) (axolotl's constant)."""


def l2_normalize(x: jax.Array, axis: int = -1, eps: float = 1e-8) -> jax.Array:
    """x / max(‖x‖, eps) along ``axis``, in float32."""
    x = jnp.asarray(x, jnp.float32)
    return x / jnp.maximum(jnp.linalg.norm(x, axis=axis, keepdims=True), eps)


def _cosine(a: jax.Array, b: jax.Array) -> jax.Array:
    dot = jnp.sum(a * b, axis=-1)
    return dot / jnp.maximum(jnp.linalg.norm(a, axis=-1) * jnp.linalg.norm(b, axis=-1), COS_EPS)


# ----------------------------------------------------------------------------------------------
# pooling (§4)


def _gather_rows(hidden: jax.Array, index: jax.Array) -> jax.Array:
    """hidden[b, index[b]] for hidden [B, S, D] and index [B] → [B, D]."""
    return jnp.take_along_axis(hidden, index[:, None, None], axis=1)[:, 0]


def _position_of_ordinal(mask: jax.Array, ordinal: jax.Array) -> jax.Array:
    """[B] position of the real token with ordinal ``ordinal[b]`` (0-based, among the real tokens of row
    b); 0 for a row without such a token."""
    rank = jnp.cumsum(mask, axis=1) - 1
    hit = (mask > 0) & (rank == ordinal[:, None])
    return jnp.argmax(hit, axis=1).astype(jnp.int32)


def _masked_mean(hidden: jax.Array, keep: jax.Array) -> jax.Array:
    w = keep.astype(jnp.float32)
    return jnp.einsum("bs,bsd->bd", w, hidden) / jnp.maximum(w.sum(axis=1), 1.0)[:, None]


def _need_prompt_lengths(prompt_lengths, what: str) -> jax.Array:
    if prompt_lengths is None:
        raise ValueError(f"{what} needs prompt_lengths [B] (the number of prompt tokens of each row); pass them, "
                         "or use embed_method='last_token' / 'mean_pooling'")
    return jnp.asarray(prompt_lengths, jnp.int32)


def pool_hidden(hidden: jax.Array, mask: jax.Array, method: str, *, prompt_lengths=None,
                concat_span: str = "sequence") -> jax.Array:
    """Pool hidden states [B, S, D] over the real tokens of each row into [B, D] ([B, 3D] for ``concat``).

    With L_b real tokens in row b (ordinals 0..L_b−1, whatever the padding side):

    - ``last_token``: the real token with ordinal L_b − 1;
    - ``mean_pooling``: the mean over real tokens (0 for an empty row);
    - ``completion_mean``: the mean over real tokens with ordinal ≥ ``prompt_lengths[b]``;
    - ``concat``: the tokens with ordinals ⌊L/4⌋, ⌊L/2⌋, ⌊3L/4⌋ concatenated; with
      ``concat_span="completion"`` the quartiles of the completion span instead, i.e. ordinals
      P + ⌊C/4⌋, P + ⌊C/2⌋, P + ⌊3C/4⌋ with P the prompt length and C = L − P (clamped to L − 1).
    """
    h = jnp.asarray(hidden, jnp.float32)
    m = jnp.asarray(mask).astype(jnp.int32)
    if h.ndim != 3 or m.shape != h.shape[:2]:
        raise ValueError(f"pool_hidden needs hidden [B, S, D] and mask [B, S]; got {h.shape} and {m.shape}")
    length = m.sum(axis=1)
    if method == "last_token":
        return _gather_rows(h, _position_of_ordinal(m, length - 1))
    if method == "mean_pooling":
        return _masked_mean(h, m > 0)
    if method == "completion_mean":
        p = _need_prompt_lengths(prompt_lengths, "embed_method='completion_mean'")
        rank = jnp.cumsum(m, axis=1) - 1
        return _masked_mean(h, (m > 0) & (rank >= p[:, None]))
    if method == "concat":
        if concat_span == "sequence":
            start, span = jnp.zeros_like(length), length
        elif concat_span == "completion":
            start = jnp.minimum(_need_prompt_lengths(prompt_lengths, "concat_span='completion'"), length)
            span = length - start
        else:
            raise ValueError(f"concat_span={concat_span!r} is unknown; use 'sequence' or 'completion'")
        last = jnp.maximum(length - 1, 0)
        parts = [_gather_rows(h, _position_of_ordinal(m, jnp.minimum(start + (q * span) // 4, last)))
                 for q in (1, 2, 3)]
        return jnp.concatenate(parts, axis=-1)
    raise ValueError(f"embed_method={method!r} is unknown; use one of {POOL_METHODS}")


def embed_layers(layers: Sequence[jax.Array], mask: jax.Array, method: str, *, per_layer_norm: bool = True,
                 prompt_lengths=None, concat_span: str = "sequence") -> jax.Array:
    """The feature embedding [B, E] of a sequence from the hidden states of the selected layers.

    Each layer [B, S, D] is pooled (:func:`pool_hidden`); with ``per_layer_norm`` each pooled layer
    vector is L2-normalised (after pooling) so every layer weighs the same and the cosine of two
    embeddings is the mean of the per-layer cosines; the layers are concatenated in order.
    """
    if not layers:
        raise ValueError("embed_layers needs at least one layer of hidden states")
    pooled = [pool_hidden(h, mask, method, prompt_lengths=prompt_lengths, concat_span=concat_span) for h in layers]
    if per_layer_norm:
        pooled = [l2_normalize(p) for p in pooled]
    return jnp.concatenate(pooled, axis=-1)


# ----------------------------------------------------------------------------------------------
# whitening (§5, §14 point 2)


def _whiten_group(gen: jax.Array, gt: jax.Array, tol: float):
    """axolotl's per-group estimator: φ = V S Uᵀ (thin SVD of the n × E generations), W = U diag(inv_s) Uᵀ
    with inv_s = 1 / (s + 1e-12) where s > tol · max s, else 0. A group whose SVD is not finite falls back
    to the L2-normalised inputs (deterministic; replaces axolotl's random-noise retry)."""
    v, s, ut = jnp.linalg.svd(gen, full_matrices=False)  # [G,n,k], [G,k], [G,k,E]
    keep = s > tol * jnp.max(s, axis=-1, keepdims=True)
    inv_s = jnp.where(keep, 1.0 / (s + INV_S_EPS), 0.0)
    gen_w = jnp.einsum("gnk,gk,gke->gne", v, s * inv_s, ut)
    gt_w = jnp.einsum("gk,gk,gke->ge", jnp.einsum("ge,gke->gk", gt, ut), inv_s, ut)
    ok = jnp.all(jnp.isfinite(gen_w), axis=(1, 2)) & jnp.all(jnp.isfinite(gt_w), axis=1)
    gen_w = jnp.where(ok[:, None, None], gen_w, l2_normalize(jnp.nan_to_num(gen)))
    gt_w = jnp.where(ok[:, None], gt_w, l2_normalize(jnp.nan_to_num(gt)))
    return gen_w, gt_w, keep.sum(axis=-1).astype(jnp.int32)


def _whiten_batch(gen: jax.Array, gt: jax.Array, tol: float, ridge: float):
    """ZCA whitening with the ridge-regularised centred covariance of every generation of the step.

    X = gen − μ ([N, E], N = G·n rows, μ their mean); Σ̂ = XᵀX / N; W = (Σ̂ + λI)^(-1/2). Both sides are
    centred by μ before W is applied: an uncentred mean off the span of X would be scaled by λ^(-1/2).
    Computed from the N × N Gram matrix (N ≪ E): with XXᵀ/N = V diag(μ_k) Vᵀ,
    yW = λ^(-1/2) y + (yXᵀ) V diag(c_k) Vᵀ X / N with c_k = ((μ_k+λ)^(-1/2) − λ^(-1/2)) / μ_k in a form
    that stays finite as μ_k → 0. ``rank`` counts the covariance eigenvalues μ_k > tol · max μ."""
    g, n, e = gen.shape
    flat = gen.reshape(g * n, e)
    mu = flat.mean(axis=0)
    x = flat - mu
    count = float(g * n)
    evals, vecs = jnp.linalg.eigh(x @ x.T / count)
    evals = jnp.maximum(evals, 0.0)
    sq_ridge, sq_tot = jnp.sqrt(ridge), jnp.sqrt(evals + ridge)
    coef = -1.0 / ((sq_ridge + sq_tot) * sq_tot * sq_ridge)  # ((μ+λ)^-1/2 − λ^-1/2) / μ

    def apply(y):
        y = y - mu
        return y / sq_ridge + ((y @ x.T) @ vecs * coef) @ vecs.T @ x / count

    rank = (evals > tol * jnp.max(evals)).sum().astype(jnp.int32)
    return apply(flat).reshape(g, n, e), apply(gt), rank


def _groups(gen, gt, caller: str) -> tuple[jax.Array, jax.Array]:
    """``gen`` [G, n, E] and ``gt`` [G, E] as float32, or an error naming ``caller`` and the shapes."""
    gen = jnp.asarray(gen, jnp.float32)
    gt = jnp.asarray(gt, jnp.float32)
    if gen.ndim != 3 or gt.shape != (gen.shape[0], gen.shape[2]):
        raise ValueError(f"{caller} needs gen [G, n, E] and gt [G, E]; got {gen.shape} and {gt.shape}")
    return gen, gt


def whiten(gen: jax.Array, gt: jax.Array, *, scope: str = "group", tol: float = 1e-5, ridge: float = 1e-3):
    """Whitened (generations [G, n, E], ground truths [G, E], rank) in float32.

    ``scope="group"``: axolotl's estimator per group, from that group's n generations only (no centring,
    second moment not divided by n); the ground truth goes through the same W. For n ≤ E and
    independent samples the whitened generations are orthonormal, so diversity ≈ 0 and Σ_j cos_j² = 1
    (docs/algorithms/ebft.md §5.2). ``rank`` [G] is the number of singular values kept.

    ``scope="batch"``: W = (Σ̂ + ridge·I)^(-1/2) from the centred covariance of all G·n generations
    (normalised by count, ground truths excluded), applied to centred embeddings; deterministic
    (``eigh`` of the Gram matrix). ``rank`` is a scalar: the covariance eigenvalues above tol · max.
    """
    gen, gt = _groups(gen, gt, "whiten")
    if scope == "group":
        return _whiten_group(gen, gt, tol)
    if scope == "batch":
        return _whiten_batch(gen, gt, tol, ridge)
    raise ValueError(f"whitening scope={scope!r} is unknown; use one of {WHITENING_SCOPES}")


# ----------------------------------------------------------------------------------------------
# rewards (§6)


def feature_rewards(gen: jax.Array, gt: jax.Array, *, alignment_coef: float = 1.0, diversity_coef: float = 1.0,
                    use_whitening: bool = False, whitening_scope: str = "group", whitening_tol: float = 1e-5,
                    whitening_ridge: float = 1e-3) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Rewards [G, n] of n generations per group against the group's ground truth, and metrics.

    Embeddings are whitened (:func:`whiten`; group scope only when n > 1) or else each L2-normalised.
    Then alignment_j = cos(ĝ_j, g), diversity_j = mean_{j'≠j} ⟨ĝ_j, ĝ_j'⟩ (raw dot product, 0 for n = 1),
    r_j = 2·α·alignment_j − 2·β·diversity_j.

    Metrics (scalars): ``ebft/alignment`` and ``ebft/diversity`` (means, after the ×2),
    ``ebft/reward``, ``ebft/cfm_loss`` = mean_g ‖mean_j ĝ_j − g‖² (no ×2), ``ebft/alignment_sumsq`` =
    mean_g Σ_j cos_j² (1 under group whitening), and ``ebft/whiten_rank`` (mean kept rank) when whitened.
    """
    gen, gt = _groups(gen, gt, "feature_rewards")
    n = gen.shape[1]
    metrics: dict[str, jax.Array] = {}
    whitened = use_whitening and (n > 1 or whitening_scope == "batch")
    if whitened:
        gen, gt, rank = whiten(gen, gt, scope=whitening_scope, tol=whitening_tol, ridge=whitening_ridge)
        metrics["ebft/whiten_rank"] = jnp.mean(rank.astype(jnp.float32))
    else:
        gen, gt = l2_normalize(gen), l2_normalize(gt)
    align = _cosine(gen, gt[:, None, :])
    if n > 1:
        gram = jnp.einsum("gie,gje->gij", gen, gen)
        div = (gram.sum(axis=-1) - jnp.diagonal(gram, axis1=1, axis2=2)) / (n - 1)
    else:
        div = jnp.zeros_like(align)
    rewards = 2.0 * alignment_coef * align - 2.0 * diversity_coef * div
    cfm = jnp.sum((gen.mean(axis=1) - gt) ** 2, axis=-1)
    metrics.update({
        "ebft/alignment": jnp.mean(2.0 * align),
        "ebft/diversity": jnp.mean(2.0 * div),
        "ebft/reward": jnp.mean(rewards),
        "ebft/cfm_loss": jnp.mean(cfm),
        "ebft/alignment_sumsq": jnp.mean(jnp.sum(align ** 2, axis=1)),
    })
    return rewards, metrics


# ----------------------------------------------------------------------------------------------
# advantages (§7) and losses (§9.1)


def ebft_advantages(rewards: jax.Array, estimator: str) -> jax.Array:
    """Advantages [G, n] from rewards [G, n] (the n samples of a group share a baseline), with an
    estimator of the shared registry :data:`jrl.losses.ADVANTAGE_ESTIMATORS`: ``grpo`` (r − mean) /
    (std + 1e-4), ``rloo`` r_j − mean_{j'≠j} r_j', ``reinforce`` r_j."""
    r = jnp.asarray(rewards, jnp.float32)
    if r.ndim != 2:
        raise ValueError(f"ebft_advantages needs rewards [G, n], got shape {r.shape}")
    g, n = r.shape
    if estimator != "reinforce" and n < 2:
        raise ValueError(f"advantage estimator {estimator!r} needs n >= 2 samples per group, got {n}; "
                         "use 'reinforce' for one sample")
    return compute_advantages(r.reshape(-1), group_size=n, estimator=estimator).reshape(g, n)


def _masked_token_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    m = jnp.asarray(mask, jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(1.0, jnp.sum(m))


def reinforce_loss(logprobs: jax.Array, advantages: jax.Array, mask: jax.Array) -> jax.Array:
    """Σ(−logπ · A · m) / max(1, Σ m) over [N, T] tokens (advantages broadcast to the tokens)."""
    lp = jnp.asarray(logprobs, jnp.float32)
    return _masked_token_mean(-lp * jnp.asarray(advantages, jnp.float32), mask)


def cross_entropy_loss(logprobs: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean negative log-likelihood Σ(−logπ · m) / max(1, Σ m) of the masked [N, T] tokens."""
    return _masked_token_mean(-jnp.asarray(logprobs, jnp.float32), mask)
