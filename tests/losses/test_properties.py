"""Property tests (hypothesis): random shapes, masks with empty sequences, all-zero advantages,
extreme log-probs and garbage (NaN / ±1e30) at masked positions never give NaN/Inf, and masked
tokens get exactly zero gradient. Advantages stay finite and match the reference on random rewards."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import losses_reference_np as ref
from jrl.losses import GRPOConfig, LossInputs, compute_advantages, grpo_loss

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)
SHAPES = [(1, 1), (2, 3), (3, 6)]

CONFIGS = {
    "grpo_tokenmask_opsm_entropy": GRPOConfig(
        num_generations=2,
        loss_type="grpo",
        beta=0.1,
        off_policy_mask_threshold=0.2,
        top_entropy_quantile=0.5,
        importance_sampling_mode="token_mask",
    ),
    "dapo_gspo_seqmask_biaskl": GRPOConfig(
        num_generations=2,
        loss_type="dapo",
        importance_sampling_level="sequence",
        importance_sampling_mode="sequence_mask",
        beta=0.1,
        use_bias_correction_kl=True,
    ),
    "drgrpo_gspotoken_seqtrunc_delta": GRPOConfig(
        num_generations=2,
        loss_type="dr_grpo",
        importance_sampling_level="sequence_token",
        importance_sampling_mode="sequence_truncate",
        delta=2.0,
        mask_truncated_completions=True,
    ),
    "bnpo_tokentrunc_floor": GRPOConfig(
        num_generations=2, loss_type="bnpo", importance_sampling_mode="token_truncate", is_ratio_floor=0.5, beta=0.05
    ),
}


@functools.cache
def _compiled(name):
    cfg = CONFIGS[name]
    return jax.jit(jax.value_and_grad(lambda lp, inp: grpo_loss(inp._replace(logprobs=lp), cfg), has_aux=True))


@st.composite
def batches(draw):
    b, t = draw(st.sampled_from(SHAPES))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    extreme = draw(st.booleans())
    zero_adv = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    cm = (np.arange(t)[None] < np.array(lengths)[:, None]).astype(np.float32)
    tool = (rng.random((b, t)) > 0.2).astype(np.float32)
    trunc = rng.random(b) < 0.5

    def logp():
        if extreme:  # log-probs spanning 1e-3 .. 1e4 nats, so ratios far beyond exp's float32 range
            return -(10.0 ** rng.uniform(-3, 4, size=(b, t)))
        return -rng.gamma(1.0, 1.0, size=(b, t))

    lp, old, refp, samp = logp(), logp(), logp(), logp()
    ent = rng.gamma(2.0, 0.5, size=(b, t)) * (1e3 if extreme else 1.0)
    adv = np.zeros(b) if zero_adv else rng.normal(0, 3.0, size=b)
    pad = cm == 0
    lp[pad] = rng.choice([-1e30, 1e30], size=pad.sum())  # garbage where the loss must not look
    for x in (old, refp, samp, ent):
        x[pad] = np.nan
    samp[rng.random((b, t)) < 0.1] = np.nan
    return dict(cm=cm, tool=tool, trunc=trunc, lp=lp, old=old, ref=refp, samp=samp, ent=ent, adv=adv)


@pytest.mark.parametrize("name", list(CONFIGS))
@SETTINGS
@given(data=batches())
def test_loss_and_gradients_are_finite_and_masked(name, data):
    cfg = CONFIGS[name]
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    inp = LossInputs(
        advantages=f32(data["adv"]),
        completion_mask=f32(data["cm"]),
        logprobs=f32(data["lp"]),
        old_logprobs=f32(data["old"]),
        ref_logprobs=f32(data["ref"]),
        sampler_logprobs=f32(data["samp"]),
        entropy=f32(data["ent"]),
        tool_mask=f32(data["tool"]),
        truncated=jnp.asarray(data["trunc"]),
    )
    (loss, met), g = _compiled(name)(inp.logprobs, inp)
    g = np.asarray(g)
    assert np.isfinite(float(loss))
    for k, v in met.items():
        assert np.isfinite(float(v)), k
    assert np.all(np.isfinite(g))
    m = data["cm"] * data["tool"]
    if cfg.mask_truncated_completions:
        m = m * (1 - data["trunc"])[:, None]
    assert np.all(g[m == 0] == 0.0)
    if cfg.beta == 0.0 and not np.any(data["adv"]):
        assert float(loss) == 0.0 and np.all(g == 0.0)


@SETTINGS
@given(
    g=st.sampled_from([1, 2, 4]),
    groups=st.sampled_from([1, 3]),
    k=st.sampled_from([1, 3]),
    nan_frac=st.sampled_from([0.0, 0.3, 1.0]),
    mode=st.sampled_from(["group", "batch", "none", "gdpo", "rloo"]),
    constant=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_advantages_are_finite_and_match_reference(g, groups, k, nan_frac, mode, constant, seed):
    if mode == "rloo" and g < 2:
        return
    rng = np.random.default_rng(seed)
    r = np.round(rng.normal(size=(g * groups, k)), 1) if not constant else np.ones((g * groups, k))
    r[rng.random(r.shape) < nan_frac] = np.nan
    w = tuple(rng.uniform(0.1, 2.0, size=k))
    kw = dict(group_size=g, reward_weights=w)
    if mode == "gdpo":
        kw["aggregation"] = "normalize_then_sum"
        want = ref.adv_normalize_then_sum(r, g, w)
    elif mode == "rloo":
        kw["estimator"] = "rloo"
        want = ref.adv_rloo(r, g, w)
    else:
        kw["scale_rewards"] = mode
        want = ref.adv_sum_then_normalize(r, g, w, mode)
    with jax.enable_x64(True):
        a = np.asarray(compute_advantages(jnp.asarray(r), **kw))
    assert np.all(np.isfinite(a))
    np.testing.assert_allclose(a, want, rtol=1e-9, atol=1e-9)
