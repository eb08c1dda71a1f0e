"""Policy losses: every loss type and ratio level against the float64 NumPy reference, gradients
against central finite differences, GSPO's shared ratio factor, plain policy gradient at ρ = 1,
normalisers (§5, §12.3, open point 11) and micro-batch invariance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses_reference_np as ref
from jrl.losses import (
    GRPOConfig,
    LossInputs,
    aggregation_weights,
    clipped_surrogate,
    entropy_threshold,
    grpo_loss,
    k3_kl,
    loss_mask,
    policy_ratio,
    step_normalizers,
)
from losses_testutil import random_batch, ref_kwargs, to_inputs

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def _cfg(**kw):
    base = dict(num_generations=2, metrics="basic")
    base.update(kw)
    return GRPOConfig(**base)


def _loss64(cfg, batch, **overrides):
    with jax.enable_x64(True):
        loss, _ = grpo_loss(to_inputs(batch, **overrides), cfg)
        return float(loss)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_types_match_reference(loss_type, level):
    batch = random_batch(seed=1)
    cfg = _cfg(loss_type=loss_type, importance_sampling_level=level, beta=0.05, max_completion_length=9)
    want, _, _ = ref.loss_ref(cfg, **ref_kwargs(batch))
    np.testing.assert_allclose(_loss64(cfg, batch), want, rtol=1e-10, atol=1e-12)


def test_gspo_token_value_equals_gspo():
    batch = random_batch(seed=2)
    seq = _loss64(_cfg(importance_sampling_level="sequence"), batch)
    tok = _loss64(_cfg(importance_sampling_level="sequence_token"), batch)
    np.testing.assert_allclose(tok, seq, rtol=1e-12)


@pytest.mark.parametrize(
    "kw",
    [
        dict(epsilon=0.1, epsilon_high=0.28),
        dict(delta=1.5, epsilon=0.1),
        dict(beta=0.2, use_bias_correction_kl=True),
        dict(beta=0.2, use_bias_correction_kl=True, importance_sampling_level="sequence"),
        dict(mask_truncated_completions=True, loss_type="grpo"),
        dict(mask_truncated_completions=True, loss_type="dr_grpo"),
        dict(importance_sampling_correction=False),
    ],
)
def test_knobs_match_reference(kw):
    batch = random_batch(seed=3)
    batch["old"] = batch["lp"] + np.random.default_rng(0).normal(0, 0.6, batch["lp"].shape)  # reach the clip bounds
    cfg = _cfg(**kw)
    want, _, _ = ref.loss_ref(cfg, **ref_kwargs(batch))
    np.testing.assert_allclose(_loss64(cfg, batch), want, rtol=1e-10, atol=1e-12)


def test_surrogate_and_kl_pieces_by_hand():
    rho = jnp.array([[0.5, 1.0, 1.5, 3.0]])
    for a in (2.0, -2.0):
        got = clipped_surrogate(rho, jnp.array([a]), 0.2, 0.28, delta=2.0)
        want = [-min(min(r, 2.0) * a, min(max(r, 0.8), 1.28) * a) for r in (0.5, 1.0, 1.5, 3.0)]
        np.testing.assert_allclose(np.asarray(got)[0], want, rtol=1e-6)
    lp, rf = jnp.array([[-1.0, -2.0, -0.5]]), jnp.array([[-1.5, -1.0, -7.0]])
    kl = k3_kl(lp, rf, jnp.array([[1.0, 1.0, 0.0]]))
    d = np.array([-0.5, 1.0])
    np.testing.assert_allclose(np.asarray(kl)[0], list(np.exp(d) - d - 1) + [0.0], rtol=1e-6)
    assert np.all(np.asarray(k3_kl(lp, rf, jnp.ones((1, 3)))) >= 0)


def test_loss_mask_combines_completion_tool_and_truncation():
    cm = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1]])
    tool = jnp.array([[1, 0, 1, 1], [1, 1, 0, 1]])
    trunc = jnp.array([False, True])
    np.testing.assert_array_equal(np.asarray(loss_mask(cm, tool, trunc)), [[1, 0, 1, 0], [1, 1, 0, 1]])
    np.testing.assert_array_equal(
        np.asarray(loss_mask(cm, tool, trunc, mask_truncated_completions=True)), [[1, 0, 1, 0], [0, 0, 0, 0]]
    )
    with pytest.raises(ValueError, match="needs `truncated`"):
        loss_mask(cm, tool, None, mask_truncated_completions=True)


def test_normalisers_are_counted_after_all_masks():
    """Open point 11: N_tok and N_seq count tokens and sequences left after every data mask."""
    cm = jnp.array([[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], jnp.float32)
    tool = jnp.array([[1, 0, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]], jnp.float32)
    m = loss_mask(cm, tool, jnp.array([False, True, False]), mask_truncated_completions=True)
    norm = step_normalizers(m)
    assert float(norm.num_tokens) == 2.0 and float(norm.num_sequences) == 1.0
    _, z = aggregation_weights("dapo", m, norm)
    assert float(z) == 2.0
    _, z = aggregation_weights("dr_grpo", m, norm, max_completion_length=10)
    assert float(z) == 10.0
    c, z = aggregation_weights("grpo", m, norm)
    np.testing.assert_allclose(np.asarray(c), [0.5, 1.0, 1.0])
    assert float(z) == 1.0
    # The loss agrees: a truncated sequence adds nothing to the dapo denominator.
    batch = random_batch(seed=4, b=3, t=4)
    batch.update(cm=np.asarray(cm), tool=np.asarray(tool), trunc=np.array([False, True, False]))
    cfg = _cfg(loss_type="dapo", mask_truncated_completions=True)
    want, ell, _ = ref.loss_ref(cfg, **ref_kwargs(batch))
    np.testing.assert_allclose(_loss64(cfg, batch), (ell[0, 0] + ell[0, 2]) / 2.0, rtol=1e-10)
    np.testing.assert_allclose(want, (ell[0, 0] + ell[0, 2]) / 2.0, rtol=1e-12)


def test_dr_grpo_normaliser_independent_of_lengths():
    m1 = jnp.array([[1, 1, 1, 1, 1, 1], [1, 0, 0, 0, 0, 0]], jnp.float32)
    m2 = jnp.array([[1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0]], jnp.float32)
    (c1, z1), (c2, z2) = (aggregation_weights("dr_grpo", m, max_completion_length=8) for m in (m1, m2))
    assert float(z1) == float(z2) == 16.0
    np.testing.assert_array_equal(c1, c2)
    # ρ = 1: every token's gradient is −A / (N_seq · L_max), whatever its sequence's length.
    cfg = _cfg(loss_type="dr_grpo", max_completion_length=8)
    adv = jnp.array([1.0, 1.0])
    for m in (m1, m2):
        inp = LossInputs(advantages=adv, completion_mask=m, logprobs=jnp.zeros((2, 6)))
        g = jax.grad(lambda lp, inp=inp: grpo_loss(inp._replace(logprobs=lp), cfg)[0])(inp.logprobs)
        np.testing.assert_allclose(np.asarray(g), -np.asarray(m) / 16.0, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# gradients


def _cz(loss_type, m, lmax):
    """(c_i, Z) of §5's jrl rule for a single micro-batch, in NumPy."""
    n = m.sum(1)
    n_seq = max(1, (n > 0).sum())
    c = 1 / np.maximum(1, n) if loss_type == "grpo" else np.ones(len(n))
    z = {"grpo": n_seq, "bnpo": max(1, m.sum()), "dr_grpo": n_seq * lmax, "dapo": max(1, m.sum())}[loss_type]
    return c, z


def _fd_grad(f, x, h=1e-6):
    g = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        xp, xm = x.copy(), x.copy()
        xp[idx] += h
        xm[idx] -= h
        g[idx] = (f(xp) - f(xm)) / (2 * h)
    return g


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grad_matches_finite_differences(loss_type, level):
    """jax.grad of the implementation vs central differences of the independent float64 reference."""
    batch = random_batch(seed=5, b=3, t=4)
    cfg = _cfg(
        loss_type=loss_type,
        importance_sampling_level=level,
        beta=0.1,
        use_bias_correction_kl=True,
        delta=1.8,
        off_policy_mask_threshold=0.3,
    )
    with jax.enable_x64(True):
        inp = to_inputs(batch)
        g = jax.grad(lambda lp: grpo_loss(inp._replace(logprobs=lp), cfg)[0])(inp.logprobs)
    fd = _fd_grad(lambda lp: ref.loss_ref(cfg, **ref_kwargs(batch, lp=lp))[0], batch["lp"])
    np.testing.assert_allclose(np.asarray(g), fd, rtol=1e-5, atol=1e-8)
    m = ref.loss_mask_ref(batch["cm"], batch["tool"])
    assert np.all(np.asarray(g)[m == 0] == 0.0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gspo_gives_every_token_the_same_ratio_factor(loss_type):
    batch = random_batch(seed=6, b=4, t=6, empty_row=False)
    cfg = _cfg(loss_type=loss_type, importance_sampling_level="sequence", epsilon=0.05)
    with jax.enable_x64(True):
        inp = to_inputs(batch, sampler_logprobs=None)
        g = np.asarray(jax.grad(lambda lp: grpo_loss(inp._replace(logprobs=lp), cfg)[0])(inp.logprobs))
    m = ref.loss_mask_ref(batch["cm"], batch["tool"])
    n = m.sum(1)
    _, _, ex = ref.loss_ref(cfg, **ref_kwargs(batch, samp=None))
    c, z = _cz(loss_type, m, m.shape[1])
    for i in range(m.shape[0]):
        gi = g[i][m[i] > 0]
        # ∂L/∂lp_t = (Σ_t' m c_i / Z) · ∂ℓ_i/∂ρ_i · ρ_i / n_i: one value for every token of the sequence
        np.testing.assert_allclose(gi, gi[0], rtol=1e-12, atol=1e-15)
        rho = ex["rho"][i, 0]
        a = batch["adv"][i]
        active = (a > 0 and rho <= 1 + 0.05) or (a < 0 and rho >= 1 - 0.05)
        want = -a * rho * active * n[i] * c[i] / z / n[i]
        np.testing.assert_allclose(gi[0], want, rtol=1e-10, atol=1e-15)


def test_gspo_token_gradient_flows_per_token():
    """§3.3: value = sequence ratio, gradient of token t is ∂ℓ/∂s · s_t (own token only)."""
    batch = random_batch(seed=7, b=3, t=5, empty_row=False)
    cfg = _cfg(loss_type="dapo", importance_sampling_level="sequence_token", epsilon=0.05)
    with jax.enable_x64(True):
        inp = to_inputs(batch, sampler_logprobs=None)
        g = np.asarray(jax.grad(lambda lp: grpo_loss(inp._replace(logprobs=lp), cfg)[0])(inp.logprobs))
    m = ref.loss_mask_ref(batch["cm"], batch["tool"])
    _, _, ex = ref.loss_ref(cfg, **ref_kwargs(batch, samp=None))
    for i in range(3):
        rho, a = ex["rho"][i, 0], batch["adv"][i]
        active = (a > 0 and rho <= 1.05) or (a < 0 and rho >= 0.95)
        want = np.where(m[i] > 0, -a * rho * active / m.sum(), 0.0)
        np.testing.assert_allclose(g[i], want, rtol=1e-10, atol=1e-15)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_ratio_one_without_kl_is_plain_policy_gradient(loss_type):
    """old = sg(new), β = 0: ∂L/∂lp_t = −A_i · m_t · c_i / Z (REINFORCE with the aggregation weights)."""
    batch = random_batch(seed=8)
    cfg = _cfg(loss_type=loss_type, max_completion_length=7)
    with jax.enable_x64(True):
        inp = to_inputs(batch, old_logprobs=None, sampler_logprobs=None)
        g = np.asarray(jax.grad(lambda lp: grpo_loss(inp._replace(logprobs=lp), cfg)[0])(inp.logprobs))
    m = ref.loss_mask_ref(batch["cm"], batch["tool"])
    c, z = _cz(loss_type, m, 7)
    np.testing.assert_allclose(g, -batch["adv"][:, None] * m * c[:, None] / z, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_microbatch_split_does_not_change_gradient(loss_type):
    """§12.3: global normalisers → the sum over 4 micro-batches equals the single-batch loss and gradient."""
    batch = random_batch(seed=9, b=8, t=5)
    cfg = _cfg(loss_type=loss_type, beta=0.1, off_policy_mask_threshold=0.2, top_entropy_quantile=0.6)
    with jax.enable_x64(True):
        full = to_inputs(batch)
        m = loss_mask(full.completion_mask, full.tool_mask)
        thr = entropy_threshold(full.entropy, m, cfg.top_entropy_quantile)

        def one(lp):
            return grpo_loss(full._replace(logprobs=lp), cfg, entropy_threshold=thr)[0]

        def split(lp):
            norm = step_normalizers(m, num_micro_batches=4)
            parts = jax.tree_util.tree_map(lambda x: x.reshape(4, 2, *x.shape[1:]), full._replace(logprobs=lp))
            losses = jax.vmap(lambda p: grpo_loss(p, cfg, norm, thr)[0])(parts)
            return losses.sum()

        l1, g1 = jax.jit(jax.value_and_grad(one))(full.logprobs)
        l4, g4 = jax.jit(jax.value_and_grad(split))(full.logprobs)
    np.testing.assert_allclose(float(l4), float(l1), rtol=1e-12)
    np.testing.assert_allclose(np.asarray(g4), np.asarray(g1), rtol=1e-12, atol=1e-15)


def test_bnpo_is_a_micro_batch_token_mean():
    """bnpo depends on the split (§5), equals dapo with one micro-batch, and follows Σ/(n_mb · GA)."""
    batch = random_batch(seed=10, b=4, t=5)
    assert np.isclose(_loss64(_cfg(loss_type="bnpo"), batch), _loss64(_cfg(loss_type="dapo"), batch), rtol=1e-12)
    cfg = _cfg(loss_type="bnpo")
    with jax.enable_x64(True):
        full = to_inputs(batch)
        m = loss_mask(full.completion_mask, full.tool_mask)
        norm = step_normalizers(m, num_micro_batches=2)
        parts = [jax.tree_util.tree_map(lambda x, s=s: x[s], full) for s in (slice(0, 2), slice(2, 4))]
        got = [float(grpo_loss(p, cfg, norm)[0]) for p in parts]
    for k, s in enumerate((slice(0, 2), slice(2, 4))):
        sub = {key: (v[s] if np.ndim(v) else v) for key, v in batch.items()}
        want, _, _ = ref.loss_ref(cfg, **ref_kwargs(sub), num_micro_batches=2)
        np.testing.assert_allclose(got[k], want, rtol=1e-10)


def test_policy_ratio_levels():
    lp = jnp.array([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    old = jnp.array([[-1.5, -1.0, -3.0], [-1.0, -9.0, -1.0]])
    m = jnp.array([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    rho, log_rho = policy_ratio(lp, old, m, "token")
    np.testing.assert_allclose(np.asarray(rho), [[np.exp(0.5), np.exp(-1.0), 1.0], [1.0, 1.0, 1.0]], rtol=1e-6)
    rho, _ = policy_ratio(lp, old, m, "sequence")
    np.testing.assert_allclose(np.asarray(rho), [[np.exp(-0.25)] * 3, [1.0] * 3], rtol=1e-6)
    big, _ = policy_ratio(jnp.array([[0.0]]), jnp.array([[-1e4]]), jnp.ones((1, 1)))
    assert np.isfinite(float(big[0, 0])) and np.isclose(float(big[0, 0]), np.exp(20.0), rtol=1e-6)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        policy_ratio(lp, old, m, "segment")
