"""EBFT pooling, whitening, rewards, advantages and losses against float64 NumPy references written
here from docs/algorithms/ebft.md §4–§7 (explicit loops; nothing from jrl.losses.ebft), plus the algebraic properties
of §5.2."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jrl.losses import (
    cross_entropy_loss,
    ebft_advantages,
    embed_layers,
    feature_rewards,
    l2_normalize,
    pool_hidden,
    reinforce_loss,
    whiten,
)

RTOL = 1e-5


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "NaN/inf in the result"
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


# ---------------------------------------------------------------------------------------------
# references


def ref_norm(v):
    v = np.asarray(v, np.float64)
    return v / max(math.sqrt(float(v @ v)), 1e-8)


def ref_pool(h, tokens, method, prompt_len=None, span="sequence"):
    """Pool one row from its real-token hidden states ``tokens`` [L, D] (already unpadded)."""
    L = len(tokens)
    if method == "last_token":
        return tokens[L - 1]
    if method == "mean_pooling":
        return sum(tokens) / max(1, L) if L else np.zeros(h.shape[-1])
    if method == "completion_mean":
        comp = tokens[prompt_len:]
        return sum(comp) / len(comp) if len(comp) else np.zeros(h.shape[-1])
    assert method == "concat"
    start, n = (0, L) if span == "sequence" else (min(prompt_len, L), L - min(prompt_len, L))
    idx = [min(start + (q * n) // 4, L - 1) for q in (1, 2, 3)]
    return np.concatenate([tokens[i] for i in idx])


def ref_whiten_group(phi, gt, tol=1e-5):
    """axolotl's code in float64: SVD of φᵀ (D × n), W = U diag(inv_s) Uᵀ (D × D)."""
    u, s, _ = np.linalg.svd(phi.T, full_matrices=False)
    inv = np.array([1.0 / (x + 1e-12) if x > tol * s.max() else 0.0 for x in s])
    w = u @ np.diag(inv) @ u.T
    return phi @ w, gt @ w, int(sum(x > tol * s.max() for x in s))


def ref_whiten_batch(gen, gt, ridge):
    """W = (Σ̂ + λI)^(-1/2) (E × E, float64), Σ̂ the centred covariance of all generations."""
    g, n, e = gen.shape
    flat = gen.reshape(g * n, e)
    mu = flat.mean(0)
    cov = (flat - mu).T @ (flat - mu) / (g * n)
    ev, q = np.linalg.eigh(cov + ridge * np.eye(e))
    w = q @ np.diag(ev ** -0.5) @ q.T
    return ((flat - mu) @ w).reshape(g, n, e), (gt - mu) @ w


def ref_rewards(gen_e, gt_e, alpha, beta):
    """Rewards [G, n], alignment, diversity, CFM from post-whitening / post-normalisation embeddings."""
    g, n, _ = gen_e.shape
    r, al, dv = np.zeros((g, n)), np.zeros((g, n)), np.zeros((g, n))
    for i in range(g):
        for j in range(n):
            a, b = gen_e[i, j], gt_e[i]
            al[i, j] = a @ b / max(math.sqrt(a @ a) * math.sqrt(b @ b), 1e-8)
            dv[i, j] = sum(gen_e[i, j] @ gen_e[i, k] for k in range(n) if k != j) / (n - 1) if n > 1 else 0.0
            r[i, j] = 2 * alpha * al[i, j] - 2 * beta * dv[i, j]
    cfm = np.mean([np.sum((gen_e[i].mean(0) - gt_e[i]) ** 2) for i in range(g)])
    return r, al, dv, cfm


def ref_advantages(r, estimator, eps=1e-4):
    g, n = r.shape
    out = np.zeros_like(r)
    for i in range(g):
        for j in range(n):
            others = [r[i, k] for k in range(n) if k != j]
            mean = r[i].mean()
            std = math.sqrt(sum((x - mean) ** 2 for x in r[i]) / (n - 1)) if n > 1 else 0.0
            out[i, j] = {"rloo": lambda: r[i, j] - sum(others) / len(others),
                         "grpo": lambda: (r[i, j] - mean) / (std + eps),
                         "reinforce": lambda: r[i, j]}[estimator]()
    return out


# ---------------------------------------------------------------------------------------------
# pooling


def padded_batch(seed, b=5, s=9, d=6, side="right"):
    """Random hidden states with random lengths (one row full, one with a single token), padded on
    ``side`` with garbage in the padding; returns (hidden, mask, per-row real tokens, prompt lengths)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, s + 1, b)
    lengths[0], lengths[1] = s, 1
    rows = [rng.standard_normal((int(L), d)) for L in lengths]
    h = rng.standard_normal((b, s, d)) * 100.0  # padding garbage must never leak in
    mask = np.zeros((b, s), np.int32)
    for i, t in enumerate(rows):
        sl = slice(0, len(t)) if side == "right" else slice(s - len(t), s)
        h[i, sl], mask[i, sl] = t, 1
    prompts = np.array([rng.integers(0, len(t) + 1) for t in rows])
    return h, mask, rows, prompts


@pytest.mark.parametrize("method,span", [("last_token", "sequence"), ("mean_pooling", "sequence"),
                                         ("completion_mean", "sequence"), ("concat", "sequence"),
                                         ("concat", "completion")])
def test_pooling_matches_reference_with_left_and_right_padding(method, span):
    outs = {}
    for side in ("right", "left"):
        h, mask, rows, prompts = padded_batch(3, side=side)
        got = np.asarray(pool_hidden(jnp.asarray(h, jnp.float32), jnp.asarray(mask), method,
                                     prompt_lengths=jnp.asarray(prompts), concat_span=span))
        want = np.stack([ref_pool(h, t, method, p, span) for t, p in zip(rows, prompts)])
        assert got.shape == want.shape
        assert rel_err(got, want) <= RTOL, (side, rel_err(got, want))
        outs[side] = got
    np.testing.assert_allclose(outs["left"], outs["right"], rtol=1e-6, atol=1e-6)


def test_completion_pooling_needs_prompt_lengths():
    h, mask, _, _ = padded_batch(0)
    with pytest.raises(ValueError, match="prompt_lengths"):
        pool_hidden(jnp.asarray(h), jnp.asarray(mask), "completion_mean")
    with pytest.raises(ValueError, match="prompt_lengths"):
        pool_hidden(jnp.asarray(h), jnp.asarray(mask), "concat", concat_span="completion")
    with pytest.raises(ValueError, match="embed_method"):
        pool_hidden(jnp.asarray(h), jnp.asarray(mask), "max_pooling")


@pytest.mark.parametrize("per_layer_norm", [True, False])
def test_embed_layers_matches_reference(per_layer_norm):
    rng = np.random.default_rng(7)
    h0, mask, _, _ = padded_batch(7, side="left")
    layers = [h0 * rng.uniform(0.1, 50.0)] + [rng.standard_normal(h0.shape) * rng.uniform(0.1, 50.0) for _ in range(2)]
    got = np.asarray(embed_layers([jnp.asarray(x, jnp.float32) for x in layers], jnp.asarray(mask), "last_token",
                                  per_layer_norm=per_layer_norm))
    want = []
    for b in range(mask.shape[0]):
        last = max(np.nonzero(mask[b])[0])
        parts = [x[b, last] for x in layers]
        want.append(np.concatenate([ref_norm(p) for p in parts] if per_layer_norm else parts))
    assert rel_err(got, np.stack(want)) <= RTOL


def test_per_layer_norm_makes_the_cosine_the_mean_of_layer_cosines():
    rng = np.random.default_rng(11)
    mask = np.ones((2, 4), np.int32)
    layers = [rng.standard_normal((2, 4, 5)) * scale for scale in (0.01, 1.0, 100.0)]
    e = np.asarray(embed_layers([jnp.asarray(x, jnp.float32) for x in layers], jnp.asarray(mask), "mean_pooling"),
                   np.float64)
    cos = e[0] @ e[1] / np.linalg.norm(e[0]) / np.linalg.norm(e[1])
    per_layer = [ref_norm(x[0].mean(0)) @ ref_norm(x[1].mean(0)) for x in layers]
    assert abs(cos - np.mean(per_layer)) <= 1e-5
    assert abs(np.sum(e[0] ** 2) - len(layers)) <= 1e-4  # each layer contributes unit norm


# ---------------------------------------------------------------------------------------------
# whitening


def test_group_whitening_matches_axolotl_reference():
    rng = np.random.default_rng(0)
    gen, gt = rng.standard_normal((3, 4, 16)), rng.standard_normal((3, 16))
    gen_w, gt_w, rank = whiten(jnp.asarray(gen, jnp.float32), jnp.asarray(gt, jnp.float32), scope="group")
    for g in range(3):
        want_gen, want_gt, want_rank = ref_whiten_group(gen[g], gt[g])
        assert rel_err(gen_w[g], want_gen) <= RTOL
        assert rel_err(gt_w[g], want_gt) <= RTOL
        assert int(rank[g]) == want_rank == 4


def test_group_whitening_properties_orthonormal_and_sumsq_one():
    """§5.2: independent samples (n ≤ E) whiten to orthonormal vectors; Σ_j cos_j² = 1; diversity ≈ 0."""
    rng = np.random.default_rng(1)
    gen, gt = rng.standard_normal((5, 4, 32)) * rng.uniform(0.1, 10.0), rng.standard_normal((5, 32))
    gen_w, gt_w, _ = whiten(jnp.asarray(gen, jnp.float32), jnp.asarray(gt, jnp.float32), scope="group")
    gram = np.einsum("gie,gje->gij", np.asarray(gen_w, np.float64), np.asarray(gen_w, np.float64))
    np.testing.assert_allclose(gram, np.broadcast_to(np.eye(4), gram.shape), atol=1e-5)
    rewards, m = feature_rewards(jnp.asarray(gen, jnp.float32), jnp.asarray(gt, jnp.float32), use_whitening=True,
                                 diversity_coef=1.0)
    assert abs(float(m["ebft/alignment_sumsq"]) - 1.0) <= 1e-5
    assert abs(float(m["ebft/diversity"])) <= 1e-5
    assert float(m["ebft/whiten_rank"]) == 4.0
    # mean alignment (x2) of a group is at most 2/sqrt(n) = 1 for n = 4
    align = np.asarray(rewards)  # diversity ≈ 0, alpha = 1: rewards = 2 cos
    assert np.all(align.mean(1) <= 1.0 + 1e-5)


def test_group_whitening_with_duplicate_samples():
    """§5.2: two identical samples among four → whitened norms² 0.5 and mutual dot 0.5; rank 3."""
    rng = np.random.default_rng(2)
    gen = rng.standard_normal((1, 4, 12))
    gen[0, 3] = gen[0, 1]
    gt = rng.standard_normal((1, 12))
    gen_w, gt_w, rank = whiten(jnp.asarray(gen, jnp.float32), jnp.asarray(gt, jnp.float32), scope="group")
    gw = np.asarray(gen_w[0], np.float64)
    assert int(rank[0]) == 3
    np.testing.assert_allclose([gw[1] @ gw[1], gw[3] @ gw[3], gw[1] @ gw[3]], [0.5, 0.5, 0.5], atol=1e-5)
    np.testing.assert_allclose([gw[0] @ gw[0], gw[2] @ gw[2], gw[0] @ gw[1]], [1.0, 1.0, 0.0], atol=1e-5)
    want_gen, want_gt, want_rank = ref_whiten_group(gen[0], gt[0])
    assert want_rank == 3
    assert rel_err(gw, want_gen) <= 1e-4  # rank-deficient: float32 SVD of a singular matrix
    assert rel_err(gt_w[0], want_gt) <= 1e-4
    _, m = feature_rewards(jnp.asarray(gen, jnp.float32), jnp.asarray(gt, jnp.float32), use_whitening=True)
    assert float(m["ebft/diversity"]) > 0.1  # only duplicates give non-zero diversity under group whitening


@pytest.mark.parametrize("ratio,kept", [(1e-7, 2), (1e-3, 3)])
def test_group_whitening_svd_tolerance(ratio, kept):
    """A singular value below 1e-5 · max is dropped (inv_s = 0); one above it is kept."""
    rng = np.random.default_rng(3)
    q_left, _ = np.linalg.qr(rng.standard_normal((3, 3)))
    q_right, _ = np.linalg.qr(rng.standard_normal((8, 3)))
    gen = (q_left @ np.diag([2.0, 1.0, 2.0 * ratio]) @ q_right.T)[None]
    gt = rng.standard_normal((1, 8))
    gen_w, gt_w, rank = whiten(jnp.asarray(gen, jnp.float32), jnp.asarray(gt, jnp.float32), scope="group")
    assert int(rank[0]) == kept
    _, want_gt, want_rank = ref_whiten_group(gen[0], gt[0])
    assert want_rank == kept
    assert rel_err(gt_w[0], want_gt) <= (RTOL if kept == 2 else 1e-3)  # kept tiny s amplifies float32 error


def test_batch_whitening_matches_reference():
    rng = np.random.default_rng(4)
    gen = rng.standard_normal((3, 4, 10)) + 3.0  # non-zero mean: must be centred
    gt = rng.standard_normal((3, 10)) + 3.0
    for ridge in (1e-3, 0.5):
        gen_w, gt_w, rank = whiten(jnp.asarray(gen, jnp.float32), jnp.asarray(gt, jnp.float32), scope="batch",
                                   ridge=ridge)
        want_gen, want_gt = ref_whiten_batch(gen, gt, ridge)
        assert rel_err(gen_w, want_gen) <= 1e-4, ridge  # float32 eigh of a ridge-conditioned matrix
        assert rel_err(gt_w, want_gt) <= 1e-4, ridge
        assert int(rank) == 10  # 12 centred samples span all 10 dims


def test_batch_whitening_keeps_diversity_informative():
    """Unlike group whitening, batch whitening does not make each group orthonormal: diversity varies."""
    rng = np.random.default_rng(5)
    gen = rng.standard_normal((4, 4, 64))
    gen[0, 1] = gen[0, 0] + 0.05 * rng.standard_normal(64)  # a near-duplicate pair in group 0
    gt = rng.standard_normal((4, 64))
    r, m = feature_rewards(jnp.asarray(gen, jnp.float32), jnp.asarray(gt, jnp.float32), use_whitening=True,
                           whitening_scope="batch", whitening_ridge=1e-2)
    gen_w, gt_w = ref_whiten_batch(gen, gt, 1e-2)
    want_r, _, want_div, want_cfm = ref_rewards(gen_w, gt_w, 1.0, 1.0)
    assert rel_err(r, want_r) <= 1e-4
    assert abs(float(m["ebft/cfm_loss"]) - want_cfm) <= 1e-4 * want_cfm
    assert want_div[0, 0] > want_div[1:].max() + 1.0  # the near-duplicates are penalised most
    assert np.asarray(m["ebft/diversity"]) == pytest.approx(2 * want_div.mean(), abs=1e-4)


# ---------------------------------------------------------------------------------------------
# rewards


@pytest.mark.parametrize("use_whitening", [False, True])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_feature_rewards_match_reference(use_whitening, n):
    rng = np.random.default_rng(10 + n)
    gen, gt = rng.standard_normal((3, n, 24)) * 3.0, rng.standard_normal((3, 24))
    alpha, beta = 0.7, 0.3
    r, m = feature_rewards(jnp.asarray(gen, jnp.float32), jnp.asarray(gt, jnp.float32), alignment_coef=alpha,
                           diversity_coef=beta, use_whitening=use_whitening)
    if use_whitening and n > 1:
        pairs = [ref_whiten_group(gen[g], gt[g]) for g in range(3)]
        gen_e, gt_e = np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])
    else:  # whitening off, or group whitening of a single sample (skipped): L2-normalised
        gen_e = np.stack([[ref_norm(x) for x in grp] for grp in gen])
        gt_e = np.stack([ref_norm(x) for x in gt])
    want_r, al, dv, cfm = ref_rewards(gen_e, gt_e, alpha, beta)
    assert r.shape == (3, n)
    assert rel_err(r, want_r) <= RTOL
    assert abs(float(m["ebft/alignment"]) - 2 * al.mean()) <= 1e-5
    assert abs(float(m["ebft/diversity"]) - 2 * dv.mean()) <= 1e-5
    assert abs(float(m["ebft/reward"]) - want_r.mean()) <= 1e-5
    assert abs(float(m["ebft/cfm_loss"]) - cfm) <= RTOL * max(cfm, 1.0)
    assert abs(float(m["ebft/alignment_sumsq"]) - np.mean(np.sum(al ** 2, 1))) <= 1e-5
    assert ("ebft/whiten_rank" in m) == (use_whitening and n > 1)


def test_rewards_prefer_the_sample_nearest_the_ground_truth():
    rng = np.random.default_rng(12)
    gt = rng.standard_normal((1, 16))
    gen = rng.standard_normal((1, 4, 16))
    gen[0, 2] = gt[0] + 0.01 * rng.standard_normal(16)
    r, m = feature_rewards(jnp.asarray(gen, jnp.float32), jnp.asarray(gt, jnp.float32), diversity_coef=0.0)
    assert int(np.argmax(np.asarray(r[0]))) == 2
    assert float(r[0, 2]) > 1.99


def test_l2_normalize():
    x = np.random.default_rng(13).standard_normal((3, 7))
    got = np.asarray(l2_normalize(jnp.asarray(x, jnp.float32)))
    assert rel_err(got, np.stack([ref_norm(v) for v in x])) <= RTOL
    assert np.all(np.asarray(l2_normalize(jnp.zeros((2, 3)))) == 0)


# ---------------------------------------------------------------------------------------------
# advantages and losses


@pytest.mark.parametrize("estimator", ["rloo", "grpo", "reinforce"])
def test_advantages_match_reference(estimator):
    r = np.random.default_rng(20).standard_normal((5, 4)) * 2.0
    r[1] = 0.5  # a constant group: zero advantage (no NaN) for the baselined estimators
    got = np.asarray(ebft_advantages(jnp.asarray(r, jnp.float32), estimator))
    want = ref_advantages(r, estimator)
    assert rel_err(got, want) <= RTOL
    if estimator != "reinforce":
        assert np.all(got[1] == 0.0)


def test_advantage_estimators_reject_bad_inputs():
    with pytest.raises(ValueError, match="n >= 2"):
        ebft_advantages(jnp.ones((3, 1)), "rloo")
    with pytest.raises(KeyError, match="unknown advantage estimator 'group_norm'"):
        ebft_advantages(jnp.ones((3, 2)), "group_norm")
    np.testing.assert_array_equal(ebft_advantages(jnp.ones((3, 1)) * 2.0, "reinforce"), 2.0)


def test_reinforce_and_cross_entropy_losses_and_gradients():
    rng = np.random.default_rng(21)
    lp = -rng.gamma(1.0, 1.0, (4, 6))
    adv = np.repeat(rng.standard_normal((4, 1)), 6, axis=1)
    mask = (rng.random((4, 6)) > 0.3).astype(np.float64)
    total = max(1.0, mask.sum())
    want_rl = sum(-lp[i, t] * adv[i, t] * mask[i, t] for i in range(4) for t in range(6)) / total
    want_ce = sum(-lp[i, t] * mask[i, t] for i in range(4) for t in range(6)) / total
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    assert rel_err(reinforce_loss(f32(lp), f32(adv), f32(mask)), want_rl) <= RTOL
    assert rel_err(cross_entropy_loss(f32(lp), f32(mask)), want_ce) <= RTOL
    g_rl = jax.grad(lambda x: reinforce_loss(x, f32(adv), f32(mask)))(f32(lp))
    g_ce = jax.grad(lambda x: cross_entropy_loss(x, f32(mask)))(f32(lp))
    assert rel_err(g_rl, -adv * mask / total) <= RTOL
    assert rel_err(g_ce, -mask / total) <= RTOL
    # an all-masked batch is 0, not NaN
    assert float(reinforce_loss(f32(lp), f32(adv), jnp.zeros((4, 6)))) == 0.0
    assert float(cross_entropy_loss(f32(lp), jnp.zeros((4, 6)))) == 0.0
