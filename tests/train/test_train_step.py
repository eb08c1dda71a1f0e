"""The jitted GRPO step against an unjitted full-logits reference, accumulation invariance, skipping."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from train_testlib import grpo_learner, max_rel_err, random_step_batch, tiny_model

from jrl.losses import GRPOConfig, LossInputs, grpo_loss
from jrl.train.learner import take_rows
from jrl.train.config import OptimConfig
from jrl.train.learner import make_optimizer

ALGO = GRPOConfig(num_generations=2, loss_type="dapo", metrics="full")
TEMPERATURE = 0.7


def make(model, algo, optim=None, **kw):
    return grpo_learner(model, algo, optim, temperature=TEMPERATURE, **kw)


def accumulate(learner, update, batch, signal):
    """(gradient, per-micro-batch metrics, skipped) of one pass of the GRPO term over ``batch``."""
    return learner.accumulate([update.policy_term(learner, batch._replace(has_signal=signal))])


def reference_loss(model, batch, algo):
    """Full [N, S, V] logits, log-softmax at the temperature, gather: the straightforward computation."""
    t = batch.completion_ids.shape[1]
    lp_len = batch.input_ids.shape[1] - t
    logits = model(jnp.asarray(batch.input_ids), attention_mask=jnp.asarray(batch.attention_mask))
    logp = jax.nn.log_softmax(logits[:, lp_len - 1: lp_len - 1 + t] / TEMPERATURE, axis=-1)
    lp = jnp.take_along_axis(logp, jnp.asarray(batch.completion_ids)[..., None], axis=-1)[..., 0]
    inputs = LossInputs(advantages=jnp.asarray(batch.advantages), completion_mask=jnp.asarray(batch.completion_mask),
                        logprobs=lp, sampler_logprobs=None if batch.sampler_logprobs is None
                        else jnp.asarray(batch.sampler_logprobs),
                        old_logprobs=None if batch.old_logprobs is None else jnp.asarray(batch.old_logprobs),
                        truncated=jnp.asarray(batch.truncated))
    return grpo_loss(inputs, algo)[0]


def reference_grads(learner, batch, algo):
    def f(params):
        return reference_loss(nnx.merge(learner.graphdef, params, learner.frozen), batch, algo)

    return jax.value_and_grad(f)(learner.params)


@pytest.mark.parametrize("loss_type", ["dapo"])
def test_step_gradient_and_update_match_reference(loss_type):
    algo = dataclasses.replace(ALGO, loss_type=loss_type)
    optim = OptimConfig(learning_rate=1e-2, max_grad_norm=None)
    learner, update = make(tiny_model(seed=1), algo, optim, total_updates=4)
    batch = random_step_batch(seed=2)
    ref_loss, ref_g = reference_grads(learner, batch, algo)
    acc, collected, skipped = accumulate(learner, update, batch, np.ones(8, bool))
    assert skipped == 0
    assert np.isfinite(float(ref_loss)) and float(jnp.abs(ref_loss)) > 0
    assert abs(float(collected["loss"][0]) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    assert max_rel_err(acc, ref_g) <= 1e-5

    # The optimizer update equals AdamW applied by hand to that (reference-checked) gradient. Adam's
    # first step is ~sign(g), which amplifies float noise of near-zero gradient entries, so the
    # hand update starts from the step's own gradient rather than from the reference one.
    tx, _ = make_optimizer(optim, 4)
    p0 = jax.tree.map(np.asarray, learner.params)
    acc = jax.tree.map(np.asarray, acc)
    updates, _ = tx.update(acc, tx.init(learner.params), learner.params)
    expected = optax.apply_updates(learner.params, updates)
    expected = jax.tree.map(np.asarray, expected)
    metrics = update(learner, batch)
    assert max_rel_err(learner.params, expected) <= 1e-6
    assert max_rel_err(learner.params, p0) > 1e-4  # it moved
    assert metrics["grad_norm"] == pytest.approx(float(optax.tree.norm(ref_g)), rel=1e-5)
    assert metrics["loss"] == pytest.approx(float(ref_loss), rel=1e-5)


@pytest.mark.parametrize("algo", [
    ALGO,
    dataclasses.replace(ALGO, loss_type="grpo", importance_sampling_level="sequence", beta=0.05),
    dataclasses.replace(ALGO, loss_type="bnpo", off_policy_mask_threshold=0.5),
], ids=["dapo", "gspo+kl", "bnpo+opsm"])
def test_loss_fused_head_matches_the_logprob_kernel(algo):
    """The same micro-batches through the loss-fused head and through the log-prob kernel: loss, every
    metric and the gradient agree (float32)."""
    batch = random_step_batch(seed=7)
    batch = batch._replace(old_logprobs=batch.sampler_logprobs - 0.01,
                           ref_logprobs=np.nan_to_num(batch.sampler_logprobs, nan=-3.0) + 0.02)
    optim = OptimConfig(micro_batch_size=4)
    fused, fu = make(tiny_model(seed=8), algo, optim, total_updates=2, loss_head="fused")
    plain, pu = make(tiny_model(seed=8), algo, optim, total_updates=2, loss_head="logprobs")
    assert fu.loss.fused_head and not pu.loss.fused_head
    g1, c1, _ = accumulate(fused, fu, batch, np.ones(8, bool))
    g2, c2, _ = accumulate(plain, pu, batch, np.ones(8, bool))
    assert max_rel_err(g1, g2) <= 1e-5
    assert set(c1) == set(c2)
    for k in c2:
        for a, b in zip(c1[k], c2[k], strict=True):
            assert float(a) == pytest.approx(float(b), rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("loss_type", ["grpo"])
def test_accumulation_invariance(loss_type):
    algo = dataclasses.replace(ALGO, loss_type=loss_type)
    batch = random_step_batch(seed=3)
    one, u1 = make(tiny_model(seed=4), algo, OptimConfig(), total_updates=2)
    two, u2 = make(tiny_model(seed=4), algo, OptimConfig(micro_batch_size=4), total_updates=2)
    g1, c1, _ = accumulate(one, u1, batch, np.ones(8, bool))
    g2, c2, _ = accumulate(two, u2, batch, np.ones(8, bool))
    assert len(c2["loss"]) == 2
    assert float(sum(c2["loss"])) == pytest.approx(float(c1["loss"][0]), rel=1e-5)
    assert max_rel_err(g2, g1) <= 1e-5
    m1 = u1(one, batch)
    m2 = u2(two, batch)
    assert max_rel_err(two.params, one.params) <= 1e-5
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5)
    assert m2["num_tokens"] == m1["num_tokens"] == float(batch.completion_mask.sum())


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_length_bucketed_micro_batches_give_the_padded_update(loss_type):
    # 8 rows of up to 16 completion tokens in micro-batches of 2: sorted by length, each trimmed to a multiple of 4
    algo = dataclasses.replace(ALGO, loss_type=loss_type)
    batch = random_step_batch(seed=11, completion_len=16)._replace(has_signal=np.ones(8, bool))
    padded, u1 = make(tiny_model(seed=4), algo, OptimConfig(micro_batch_size=2, length_bucket=0), total_updates=2)
    trimmed, u2 = make(tiny_model(seed=4), algo, OptimConfig(micro_batch_size=2, length_bucket=4), total_updates=2)
    assert len(u1.policy_terms(padded, batch)) == 1
    terms = u2.policy_terms(trimmed, batch)
    widths = [t.rows.completion_ids.shape[1] for t in terms]
    lengths = batch.completion_mask.sum(-1)
    assert widths == sorted(widths, reverse=True) and min(widths) < 16 and all(w % 4 == 0 for w in widths)
    for t in terms:  # every row's tokens are inside its term's width, and each row is in one term
        assert (t.rows.completion_mask.sum(-1) <= t.rows.completion_ids.shape[1]).all()
    assert sorted(np.concatenate([t.rows.completion_mask.sum(-1) for t in terms]).tolist()) == sorted(lengths.tolist())
    g1, c1, _ = padded.accumulate([u1.policy_term(padded, batch)])
    g2, c2, _ = trimmed.accumulate(terms)
    assert max_rel_err(g2, g1) <= 1e-5
    assert float(sum(c2["loss"])) == pytest.approx(float(sum(c1["loss"])), rel=1e-5)
    m1, m2 = u1(padded, batch), u2(trimmed, batch)
    assert max_rel_err(trimmed.params, padded.params) <= 1e-5
    assert m2["loss"] == pytest.approx(m1["loss"], rel=1e-5)
    assert m2["num_tokens"] == m1["num_tokens"] == float(batch.completion_mask.sum())


def test_the_bnpo_loss_keeps_its_micro_batches():
    algo = dataclasses.replace(ALGO, loss_type="bnpo")
    learner, update = make(tiny_model(seed=4), algo, OptimConfig(micro_batch_size=2, length_bucket=4), total_updates=1)
    batch = random_step_batch(seed=11, completion_len=16)
    assert [t.rows.completion_ids.shape[1] for t in update.policy_terms(learner, batch)] == [16]


def test_each_program_hands_back_its_metrics_as_one_vector():
    """An update's metrics leave the devices as one packed float32 vector per program: one for a single
    micro-batch (gradient and optimizer in one program), one per micro-batch plus the optimizer's otherwise;
    unpacked they are the metrics of the same update run unpacked (one scalar per metric)."""
    batch = random_step_batch(seed=3)
    for mb, programs in ((None, 1), (4, 3)):
        learner, update = make(tiny_model(seed=4), ALGO, OptimConfig(micro_batch_size=mb), total_updates=2)
        collected, _ = learner.step([update.policy_term(learner, batch)])
        assert len(collected.parts) == programs
        assert all(p.values.ndim == 1 and p.values.dtype == jnp.float32 for p in collected.parts)
        assert {"loss", "grad_norm", "learning_rate", "num_tokens"} <= set(collected)
        assert len(collected["loss"]) == (2 if mb else 1) and len(collected["grad_norm"]) == 1
        # The same loss term evaluated by hand at the weights before the update.
        fresh, fresh_update = make(tiny_model(seed=4), ALGO, OptimConfig(micro_batch_size=mb), total_updates=2)
        term = fresh_update.policy_term(fresh, batch)
        for sl, loss in zip(fresh.chunks(8), collected["loss"], strict=True):
            want, metrics = term.loss(fresh.model, jax.tree.map(jnp.asarray, take_rows(term.rows, sl)), term.aux)
            assert loss == pytest.approx(float(want), rel=1e-5)
            assert float(metrics["num_tokens"]) in collected["num_tokens"]


def test_zero_signal_micro_batches_are_skipped_and_counted():
    batch = random_step_batch(seed=5)
    signal = np.array([True] * 4 + [False] * 4)
    learner, update = make(tiny_model(seed=6), ALGO, OptimConfig(micro_batch_size=4), total_updates=2)
    acc, collected, skipped = accumulate(learner, update, batch, signal)
    assert skipped == 1 and len(collected["loss"]) == 1
    # What remains is exactly the first micro-batch's contribution under the step-global normalisers.
    fresh, fresh_update = make(tiny_model(seed=6), ALGO, OptimConfig(micro_batch_size=4), total_updates=2)
    full, _, _ = accumulate(fresh, fresh_update, batch._replace(advantages=np.where(signal, batch.advantages, 0.0)),
                            np.ones(8, bool))
    assert max_rel_err(acc, full) <= 1e-5
    metrics = update(learner, batch._replace(has_signal=signal))
    assert metrics["skipped_zero_adv_batches"] == 1.0


def test_num_iterations_uses_old_logprobs_of_the_rollout():
    batch = random_step_batch(seed=7)
    algo = dataclasses.replace(ALGO, importance_sampling_correction=False)
    learner, update = make(tiny_model(seed=8), algo, OptimConfig(learning_rate=5e-2), total_updates=4,
                           num_iterations=2)
    old = learner.evaluate(update.logprobs, batch)
    metrics = update(learner, batch)
    assert learner.num_updates == 2
    # The second update saw a ratio != 1 (its policy moved away from the rollout's old log-probs).
    assert metrics["kl_new_old"] > 0
    # And its gradient equals the reference loss with those old log-probs at the moved weights.
    ref_loss, ref_g = reference_grads(learner, batch._replace(old_logprobs=old), algo)
    acc, collected, _ = accumulate(learner, update, batch._replace(old_logprobs=old), np.ones(8, bool))
    assert max_rel_err(acc, ref_g) <= 1e-5


def test_docs_per_step_makes_one_update_per_part_against_the_rollouts_old_logprobs():
    batch = random_step_batch(seed=9)  # 8 rows, groups of 2
    algo = dataclasses.replace(ALGO, importance_sampling_correction=False)
    optim = OptimConfig(learning_rate=5e-2, micro_batch_size=2)
    learner, update = make(tiny_model(seed=10), algo, optim, total_updates=4, docs_per_step=4)
    old = learner.evaluate(update.logprobs, batch)
    metrics = update(learner, batch)
    assert learner.num_updates == 2 and metrics["kl_new_old"] > 0  # the second update's policy had moved
    # The same two updates by hand: rows 0-3 then rows 4-7, each a whole update with its own normalisers, both
    # against the log-probs of the weights before the first.
    ref, ref_update = make(tiny_model(seed=10), algo, optim, total_updates=4)
    for sl in (slice(0, 4), slice(4, 8)):
        ref.step([ref_update.policy_term(ref, take_rows(batch._replace(old_logprobs=old), sl))])
    assert max_rel_err(learner.params, ref.params) <= 1e-5
    # One part = the whole batch: the plain update.
    whole, whole_update = make(tiny_model(seed=10), algo, optim, total_updates=4, docs_per_step=8)
    plain, plain_update = make(tiny_model(seed=10), algo, optim, total_updates=4)
    whole_update(whole, batch), plain_update(plain, batch)
    assert whole.num_updates == plain.num_updates == 1 and max_rel_err(whole.params, plain.params) == 0


def test_docs_per_step_must_be_whole_groups_dividing_the_step():
    from jrl.data.pipeline import DataConfig
    from jrl.train.config import TrainConfig

    cfg = TrainConfig(data=DataConfig(prompts_per_batch=4), algo=GRPOConfig(num_generations=4),
                      optim=OptimConfig(micro_batch_size=4), docs_per_step=8, num_iterations=3)
    assert cfg.updates_per_step == 6
    for bad in (6, 12, 2):  # not whole groups, not a divisor of 16 rows, not a multiple of micro_batch_size
        with pytest.raises(ValueError, match=rf"TrainConfig\.docs_per_step={bad}.*divisor of the 16 rows"):
            dataclasses.replace(cfg, docs_per_step=bad)


def test_bad_micro_batch_size():
    learner, update = make(tiny_model(seed=0), ALGO, OptimConfig(micro_batch_size=3), total_updates=1)
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        update(learner, random_step_batch(seed=0))


def test_router_losses_join_a_moe_update():
    """A MoE model's router statistics are metrics of every update; with coefficients the loss grows by exactly
    ``aux_coef · aux + z_coef · z`` (with micro-batches too) and the router trains differently; a dense model
    refuses the coefficients."""
    moe = dict(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    batch = random_step_batch(seed=3)
    algo = GRPOConfig(num_generations=2, metrics="basic")
    runs = {}
    for coefs in ((0.0, 0.0), (0.5, 0.1)):
        for mb in (None, 4):
            optim = OptimConfig(learning_rate=1e-2, micro_batch_size=mb, router_aux_loss_coef=coefs[0],
                                router_z_loss_coef=coefs[1])
            learner, update = grpo_learner(tiny_model(seed=4, **moe), algo, optim, total_updates=1)
            runs[coefs, mb] = update(learner, batch), np.asarray(learner.model.layers.mlp.router.kernel[...])
    for mb in (None, 4):
        (plain, plain_router), (weighted, weighted_router) = runs[(0.0, 0.0), mb], runs[(0.5, 0.1), mb]
        assert plain["moe/expert_load_max_over_mean"] >= 1.0 and plain["moe/aux_loss"] >= 1.0 - 1e-6
        for name in ("moe/aux_loss", "moe/router_z_loss", "moe/expert_load_max_over_mean"):
            assert weighted[name] == pytest.approx(plain[name], rel=1e-6), name  # measured before the update
        want = plain["loss"] + 0.5 * plain["moe/aux_loss"] + 0.1 * plain["moe/router_z_loss"]
        assert weighted["loss"] == pytest.approx(want, rel=1e-5), mb
        assert np.abs(weighted_router - plain_router).max() > 1e-6
    with pytest.raises(ValueError, match=r"OptimConfig.router_z_loss_coef=0.1 has no effect: the model has no MoE"):
        grpo_learner(tiny_model(), algo, OptimConfig(router_z_loss_coef=0.1), total_updates=1)


def test_learners_of_equal_models_share_the_compiled_step():
    """The step's static model definition (update_programs.Static, hashed once) compares by value: a second learner of
    an equal model reuses the first one's compiled program, and a different model compiles its own."""
    from jrl.train import update_programs

    step = update_programs.micro_step_and_apply
    batch = random_step_batch(seed=2)
    first, update = make(tiny_model(seed=1), ALGO, total_updates=4)
    update(first, batch)
    compiled = step._cache_size()
    second, update = make(tiny_model(seed=3), ALGO, total_updates=4)
    assert second._static_graphdef is not first._static_graphdef
    assert second._static_graphdef == first._static_graphdef
    update(second, batch)
    assert step._cache_size() == compiled
    other, update = make(tiny_model(seed=1, num_hidden_layers=3), ALGO, total_updates=4)
    assert other._static_graphdef != first._static_graphdef
    update(other, batch)
    assert step._cache_size() == compiled + 1
