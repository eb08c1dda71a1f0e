"""The top-level loss: §10 order of operations end to end, jit, vmap over micro-batches, the
hidden-state path (fused logprob kernel) against the logprobs path, and input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import losses_reference_np as ref
from jrl.losses import GRPOConfig, LossInputs, grpo_loss, has_learning_signal
from losses_testutil import random_batch, ref_kwargs, to_inputs

EVERYTHING = dict(
    num_generations=2,
    beta=0.07,
    use_bias_correction_kl=True,
    delta=1.6,
    epsilon_high=0.28,
    off_policy_mask_threshold=0.1,
    top_entropy_quantile=0.7,
    mask_truncated_completions=True,
    importance_sampling_cap=1.4,
)


@pytest.mark.parametrize(
    "kw",
    [
        dict(loss_type="grpo", importance_sampling_mode="token_mask"),
        dict(loss_type="dapo", importance_sampling_mode="sequence_truncate", importance_sampling_level="sequence"),
        dict(loss_type="dr_grpo", importance_sampling_mode="token_truncate", is_ratio_floor=0.8, max_completion_length=12),
        dict(loss_type="bnpo", importance_sampling_mode="sequence_mask", importance_sampling_level="sequence_token"),
    ],
)
def test_full_pipeline_matches_reference(kw):
    batch = random_batch(seed=30, b=6, t=7)
    cfg = GRPOConfig(**{**EVERYTHING, **kw})
    with jax.enable_x64(True):
        got, _ = grpo_loss(to_inputs(batch), cfg)
    want, _, _ = ref.loss_ref(cfg, **ref_kwargs(batch))
    np.testing.assert_allclose(float(got), want, rtol=1e-10, atol=1e-12)


def test_jit_and_vmap_over_micro_batches():
    cfg = GRPOConfig(**EVERYTHING)
    batches = [random_batch(seed=40 + i, b=4, t=5) for i in range(3)]
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *[to_inputs(b, jnp.float32) for b in batches])
    f = jax.jit(grpo_loss, static_argnames="config")
    losses, mets = jax.jit(jax.vmap(lambda x: grpo_loss(x, cfg)))(stacked)
    assert losses.shape == (3,) and all(v.shape == (3,) for v in mets.values())
    for i, b in enumerate(batches):
        loss_i, met_i = f(to_inputs(b, jnp.float32), cfg)
        eager_i, _ = grpo_loss(to_inputs(b, jnp.float32), cfg)
        np.testing.assert_allclose(float(losses[i]), float(loss_i), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(float(eager_i), float(loss_i), rtol=1e-5, atol=1e-7)
        for k, v in met_i.items():
            np.testing.assert_allclose(float(mets[k][i]), float(v), rtol=1e-5, atol=1e-6, err_msg=k)
        want, _, _ = ref.loss_ref(cfg, **ref_kwargs(b))
        np.testing.assert_allclose(float(loss_i), want, rtol=1e-4, atol=1e-6)


def _np_logprobs(hidden, w, ids, tau):
    """float64 log-softmax(h @ W / τ)[id] and entropy, written out in NumPy."""
    z = np.einsum("bth,hv->btv", hidden, w) / tau
    z = z - z.max(-1, keepdims=True)
    logz = np.log(np.exp(z).sum(-1))
    lp = np.take_along_axis(z, ids[..., None], -1)[..., 0] - logz
    p = np.exp(z - logz[..., None])
    return lp, -(p * (z - logz[..., None])).sum(-1)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_hidden_state_path_equals_logprobs_path(level):
    """Same loss, metrics and OPSM inputs through the logprob kernel at τ = 0.7 (open point 2)."""
    rng = np.random.default_rng(50)
    b, t, h, v, tau = 4, 5, 8, 11, 0.7
    batch = random_batch(seed=51, b=b, t=t)
    hidden = rng.normal(size=(b, t, h))
    w = rng.normal(size=(h, v)) / np.sqrt(h)
    ids = rng.integers(0, v, size=(b, t))
    lp, ent = _np_logprobs(hidden, w, ids, tau)
    batch.update(lp=lp, ent=ent)
    cfg = GRPOConfig(**{**EVERYTHING, "importance_sampling_level": level})
    with jax.enable_x64(True):
        via_lp = grpo_loss(to_inputs(batch), cfg)
        via_hidden = grpo_loss(
            to_inputs(batch, logprobs=None, entropy=None)._replace(
                hidden=jnp.asarray(hidden), lm_head=jnp.asarray(w), completion_ids=jnp.asarray(ids)
            ),
            cfg,
            temperature=tau,
        )
    # the kernel forms float32 logits (fp32 lm head, §2.2), hence float32 tolerances
    np.testing.assert_allclose(float(via_hidden[0]), float(via_lp[0]), rtol=1e-5, atol=1e-7)
    assert set(via_hidden[1]) == set(via_lp[1])
    for k in via_lp[1]:
        np.testing.assert_allclose(float(via_hidden[1][k]), float(via_lp[1][k]), rtol=1e-5, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(float(via_lp[0]), ref.loss_ref(cfg, **ref_kwargs(batch))[0], rtol=1e-10, atol=1e-12)


def test_hidden_state_path_under_jit_vmap_and_grad():
    rng = np.random.default_rng(52)
    m_, b, t, h, v = 2, 3, 4, 8, 13
    cfg, tau = GRPOConfig(num_generations=2, beta=0.1, top_entropy_quantile=0.5), 0.8
    w = jnp.asarray(rng.normal(size=(h, v)) / np.sqrt(h), jnp.float32)
    data = LossInputs(
        advantages=jnp.asarray(rng.normal(size=(m_, b)), jnp.float32),
        completion_mask=jnp.ones((m_, b, t)),
        hidden=jnp.asarray(rng.normal(size=(m_, b, t, h)), jnp.float32),
        completion_ids=jnp.asarray(rng.integers(0, v, size=(m_, b, t))),
        old_logprobs=jnp.asarray(-rng.random((m_, b, t)), jnp.float32),
        ref_logprobs=jnp.asarray(-rng.random((m_, b, t)), jnp.float32),
    )

    def total(w, hidden):
        losses, _ = jax.vmap(lambda x: grpo_loss(x._replace(lm_head=w), cfg, temperature=tau))(data._replace(hidden=hidden))
        return losses.sum()

    loss, (gw, gh) = jax.jit(jax.value_and_grad(total, argnums=(0, 1)))(w, data.hidden)
    assert np.isfinite(float(loss)) and np.all(np.isfinite(np.asarray(gw))) and np.all(np.isfinite(np.asarray(gh)))
    assert float(jnp.abs(gw).sum()) > 0 and float(jnp.abs(gh).sum()) > 0
    sep = sum(float(grpo_loss(jax.tree_util.tree_map(lambda x, i=i: x[i], data)._replace(lm_head=w), cfg, temperature=tau)[0]) for i in range(m_))
    np.testing.assert_allclose(float(loss), sep, rtol=1e-5)


def test_bf16_inputs_compute_in_float32():
    batch = random_batch(seed=53)
    loss, met = grpo_loss(to_inputs(batch, jnp.bfloat16), GRPOConfig(num_generations=2))
    assert loss.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in met.values())
    assert np.isfinite(float(loss))


def test_has_learning_signal():
    mask = jnp.array([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    assert bool(has_learning_signal(jnp.array([False, True, False]), mask)) is False
    assert bool(has_learning_signal(jnp.array([False, False, True]), mask)) is True


def test_input_errors():
    cfg = GRPOConfig(num_generations=2)
    z = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match="exactly one of"):
        grpo_loss(LossInputs(advantages=jnp.zeros(2), completion_mask=z), cfg)
    with pytest.raises(ValueError, match="lm_head"):
        grpo_loss(LossInputs(advantages=jnp.zeros(2), completion_mask=z, hidden=jnp.zeros((2, 3, 4))), cfg)
    with pytest.raises(ValueError, match="one per sequence"):
        grpo_loss(LossInputs(advantages=jnp.zeros((2, 3)), completion_mask=z, logprobs=z), cfg)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(LossInputs(advantages=jnp.zeros(2), completion_mask=z, logprobs=z), GRPOConfig(beta=0.1))
    with pytest.raises(ValueError, match="old_logprobs has shape"):
        grpo_loss(LossInputs(advantages=jnp.zeros(2), completion_mask=z, logprobs=z, old_logprobs=jnp.zeros((2, 4))), cfg)
    with pytest.raises(ValueError, match="max_completion_length=2"):
        grpo_loss(LossInputs(advantages=jnp.zeros(2), completion_mask=z, logprobs=z), GRPOConfig(max_completion_length=2))
