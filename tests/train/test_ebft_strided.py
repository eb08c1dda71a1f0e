"""The strided EBFT trainer: documents and anchors from the data, trainer log-probs equal the sampler's,
ground-truth blocks share the generated blocks' conditioning, rewards and advantages per valid block, the
loss against a plain-forward reference, micro-batching, and a short run with metrics and exact resume."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_testlib import max_rel_err, tiny_model

from jrl.data.pipeline import DataConfig
from jrl.data.tasks.arithmetic import ArithmeticConfig
from jrl.data.tokenizer import PAD_ID
from jrl.losses.ebft import ebft_advantages, feature_rewards
from jrl.models import strided as st
from jrl.rollout import SamplingParams
from jrl.rollout.strided_sampler import generate_blocks
from jrl.train.algorithms.ebft_strided import (
    EBFTStrided,
    StridedBatch,
    block_logprobs,
    block_rewards,
    build_documents,
    ce_token_mask,
    document_layout,
)
from jrl.train.config import ModelSpec, OptimConfig, RolloutConfig, TrainConfig
from jrl.train.ebft_config import EBFTConfig
from jrl.train.learner import Learner
from jrl.train.policy_loading import Policy

EBFT = EBFTConfig(context_length=3, stride=2, generate_max_len=3, n_samples_per_prompt=3, feature_layers=(0.0, 1.0))
TEMPERATURE = 0.8


def _algorithm(model, ebft=EBFT, optim=None):
    """(learner, the strided algorithm) of ``model``."""
    optim = optim or OptimConfig()
    cfg = TrainConfig(algorithm="ebft_strided", ebft=ebft, rollout=RolloutConfig(temperature=TEMPERATURE),
                      data=DataConfig(prompts_per_batch=2), optim=optim)
    learner = Learner(model, optim, total_updates=1)
    return learner, EBFTStrided(cfg, Policy(tokenizer=None, pad_id=PAD_ID, mesh=None, rules={}, model=model), learner)


def _features(learner, algo, ids, anchors):
    return learner.evaluate(algo.features, (ids, anchors), params=algo.feature_params, disable_lora=learner.lora)


def _accumulate(learner, algo, batch):
    """(gradient, summed metrics) of the step loss over the micro-batches."""
    grads, collected, _ = learner.accumulate([algo.loss_term(learner, batch)])
    return grads, {k: float(sum(v)) for k, v in collected.items()}


def test_documents_layout_and_ce_mask():
    # Structured: prompt lengths 5 and 7, completions of 6 and 2 tokens; c = 3, s = 2, g = 3.
    docs = build_documents([[1] * 5, [2] * 7], [[3] * 6, [4] * 2], pad_id=PAD_ID, multiple_of=8)
    assert docs.ids.shape == (2, 16) and docs.lengths.tolist() == [11, 9] and docs.prompt_lengths.tolist() == [5, 7]
    assert docs.ids[0, :11].tolist() == [1] * 5 + [3] * 6 and (docs.ids[0, 11:] == PAD_ID).all()
    layout = document_layout(docs, dataclasses.replace(EBFT, min_completion_prefix=1))
    # a_0 = max(3, 5 + 1) = 6 and max(3, 8) = 8; J = max(⌊(16-3-6)/2⌋+1, ⌊(16-3-8)/2⌋+1) = 4.
    assert layout.anchors.tolist() == [[6, 8, 10, 12], [8, 10, 12, 14]]
    # Valid while a_j + 3 <= length: row 0 (11): 6, 8; row 1 (9): none.
    assert layout.valid.tolist() == [[True, True, False, False], [False] * 4]
    # CE targets: completion tokens before the padding.
    assert np.nonzero(ce_token_mask(docs)[0])[0].tolist() == list(range(5, 11))
    assert np.nonzero(ce_token_mask(docs)[1])[0].tolist() == [7, 8]
    # Plain documents: a_0 = c, CE on every token after the first.
    plain = build_documents([[1] * 9], None, pad_id=PAD_ID, multiple_of=4)
    assert plain.prompt_lengths is None and plain.ids.shape == (1, 12)
    layout = document_layout(plain, EBFT)
    assert layout.anchors.tolist() == [[3, 5, 7, 9]] and layout.valid.tolist() == [[True, True, False, False]]
    assert np.nonzero(ce_token_mask(plain)[0])[0].tolist() == list(range(1, 9))
    with pytest.raises(ValueError, match="room for one block"):
        document_layout(build_documents([[1] * 4], None, pad_id=PAD_ID, multiple_of=4), EBFT)


@functools.cache
def _rollout(seed=0, batch=2, seq_len=12):
    """(model, documents, layout, samples) of two random plain documents (cached: the tests only read them)."""
    model = tiny_model(seed=seed)
    rng = np.random.default_rng(seed)
    docs = build_documents([rng.integers(0, 250, n).tolist() for n in (seq_len, seq_len - 3)][:batch], None,
                           pad_id=PAD_ID, multiple_of=4)
    layout = document_layout(docs, EBFT)
    samples = generate_blocks(model, docs.ids, layout.anchors, context_length=EBFT.context_length,
                              generate_len=EBFT.generate_max_len, num_samples=EBFT.n_samples_per_prompt,
                              params=SamplingParams(temperature=TEMPERATURE), seed=seed)
    return model, docs, layout, samples


def _packed(docs, layout, samples):
    b, n, num, g = samples.tokens.shape
    ids = np.asarray(st.pack(np.repeat(docs.ids, n, 0), samples.tokens.reshape(b * n, num, g)))
    return ids, np.repeat(layout.anchors, n, 0)


def test_trainer_block_logprobs_equal_sampler():
    model, docs, layout, samples = _rollout()
    learner, algo = _algorithm(model)
    ids, anchors = _packed(docs, layout, samples)
    lp, _ = jax.jit(lambda i, a: block_logprobs(learner.model, i, a, algo.loss.geometry, temperature=TEMPERATURE,
                                                impl="auto"))(ids, anchors)
    sampled = samples.logprobs.reshape(ids.shape[0], -1)
    assert np.isfinite(sampled).all()
    assert np.abs(np.asarray(lp) - sampled).max() <= 1e-5 * np.abs(sampled).max()


def test_ground_truth_blocks_share_the_generated_conditioning():
    """A generated block equal to the ground truth gets exactly the ground truth's embedding (so cos = 1
    and alignment = 2); reading the ground truth off the causal document pass would not."""
    model, docs, layout, samples = _rollout()
    learner, algo = _algorithm(model)
    b, n, num, g = samples.tokens.shape
    gt_blocks = np.asarray(st.ground_truth_blocks(docs.ids, layout.anchors, g))
    tokens = samples.tokens.copy()
    tokens[:, 0] = gt_blocks
    ids, anchors = _packed(docs, layout, dataclasses.replace(samples, tokens=tokens))
    gt_ids = np.asarray(st.pack(docs.ids, gt_blocks))
    emb = _features(learner, algo, np.concatenate([ids, gt_ids]), np.concatenate([anchors, layout.anchors]))
    gen, gt = emb[:b * n].reshape(b, n, num, -1), emb[b * n:]
    v = layout.valid
    assert max_rel_err(gen[:, 0][v], gt[v]) <= 1e-5
    assert np.abs(gen[:, 1][v] - gt[v]).max() > 1e-3  # a sampled block differs
    _, metrics = feature_rewards(gen[:, 0][v][:, None], gt[v], diversity_coef=0.0)
    assert abs(metrics["ebft/alignment"] - 2.0) <= 1e-5
    # The causal document pass gives other final hidden states for the same tokens (the window matters).
    seq_len = docs.ids.shape[1]
    causal = np.asarray(jax.jit(model.hidden_states)(jnp.asarray(docs.ids)))
    last = causal[np.arange(b)[:, None], np.minimum(layout.anchors + g - 1, seq_len - 1)]  # [B, J, D]
    packed = np.asarray(jax.jit(lambda i, p, m: model.hidden_states(i, positions=p, mask=m))(
        gt_ids, st.packed_roles(seq_len, layout.anchors, g)[2], st.strided_mask(seq_len, layout.anchors, 3, g)))
    assert np.abs(packed[:, st.block_slots(seq_len, num, g)[:, -1]][v] - last[v]).max() > 1e-3


def test_block_rewards_are_per_valid_block_groups():
    rng = np.random.default_rng(3)
    b, n, num, e = 3, 4, 5, 6
    gen, gt = rng.standard_normal((b, n, num, e)), rng.standard_normal((b, num, e))
    valid = rng.random((b, num)) < 0.6
    valid[0, 0] = True
    cfg = dataclasses.replace(EBFT, n_samples_per_prompt=n, diversity_coef=0.5)
    adv, metrics = block_rewards(gen, gt, valid, cfg)
    assert adv.shape == (b, n, num) and (adv[np.broadcast_to(~valid[:, None], adv.shape)] == 0).all()
    groups = [(i, j) for i in range(b) for j in range(num) if valid[i, j]]
    rewards, _ = feature_rewards(np.stack([gen[i, :, j] for i, j in groups]), np.stack([gt[i, j] for i, j in groups]),
                                 diversity_coef=0.5)
    want = np.asarray(ebft_advantages(rewards, "rloo"))
    for k, (i, j) in enumerate(groups):
        np.testing.assert_allclose(adv[i, :, j], want[k], rtol=1e-6, atol=1e-6)
    assert metrics["ebft/num_blocks"] == len(groups) / b
    assert abs(metrics["ebft/advantages_std"] - float(np.std(want))) <= 1e-6


def test_lora_feature_network_is_the_base_model():
    """With LoRA the features come from the base weights (adapters off, no copy); the policy's own outputs
    do use the adapters. Full fine-tuning keeps a frozen copy of the initial weights."""
    from jrl.models.lora import LoraConfig, apply_lora, lora_layers

    _, docs, layout, samples = _rollout()
    ids, anchors = _packed(docs, layout, samples)
    full, full_algo = _algorithm(tiny_model(seed=0))
    lora_model = apply_lora(tiny_model(seed=0), LoraConfig(rank=2, alpha=4.0))
    for i, layer in enumerate(lora_layers(lora_model).values()):
        layer.lora_b.set_value(jax.random.normal(jax.random.key(i), layer.lora_b[...].shape) * 0.3)
    lora, lora_algo = _algorithm(lora_model)
    assert lora_algo.feature_params is None and full_algo.feature_params is not None
    assert max_rel_err(_features(lora, lora_algo, ids, anchors), _features(full, full_algo, ids, anchors)) <= 1e-5
    geometry = full_algo.loss.geometry
    with_adapters, base = (np.asarray(jax.jit(lambda i, a, m=m: block_logprobs(
        m, i, a, geometry, temperature=TEMPERATURE, impl="auto")[0])(ids, anchors)) for m in (lora.model, full.model))
    assert np.abs(with_adapters - base).max() > 1e-3


def _step_batch(seed=0):
    model, docs, layout, samples = _rollout()
    ids, anchors = _packed(docs, layout, samples)
    n, num, g = EBFT.n_samples_per_prompt, layout.anchors.shape[1], EBFT.generate_max_len
    rng = np.random.default_rng(seed)
    block_mask = np.repeat(np.repeat(layout.valid, n, 0), g, 1).astype(np.float32)
    adv = np.repeat(rng.standard_normal((ids.shape[0], num)), g, 1).astype(np.float32)
    batch = StridedBatch(ids, anchors, block_mask, adv, np.repeat(ce_token_mask(docs), n, 0),
                         samples.logprobs.reshape(ids.shape[0], -1))
    return model, batch


CFG = dataclasses.replace(EBFT, rl_coef=0.7, ce_coef=0.3)


def test_loss_equals_plain_forward_reference_and_micro_batching():
    model, batch = _step_batch()
    rows = batch.input_ids.shape[0]
    # A fresh copy of the weights: the update donates (consumes) the learner's arrays.
    learner, algo = _algorithm(tiny_model(seed=0), CFG, OptimConfig(learning_rate=1e-2))
    split, split_algo = _algorithm(model, CFG, OptimConfig(learning_rate=1e-2, micro_batch_size=rows // 2))
    # Reference: model(...) logits with the strided mask, log_softmax at the sampling temperature.
    seq_len, g = batch.ce_mask.shape[1], CFG.generate_max_len
    anchors = jnp.asarray(batch.anchors)
    _, _, pos, _ = st.packed_roles(seq_len, anchors, g)
    mask = st.strided_mask(seq_len, anchors, CFG.context_length, g)
    logits = np.asarray(jax.jit(lambda i, p, m: model(i, positions=p, mask=m))(batch.input_ids, pos, mask), np.float64)
    pred = np.asarray(st.prediction_indices(seq_len, anchors, g)).reshape(rows, -1)

    def logp(z, targets):
        z = z - z.max(-1, keepdims=True)
        z = z - np.log(np.exp(z).sum(-1, keepdims=True))
        return np.take_along_axis(z, targets[..., None], -1)[..., 0]

    lp = logp(np.take_along_axis(logits, pred[..., None], 1) / TEMPERATURE, batch.input_ids[:, seq_len:])
    m = batch.block_mask
    rl = np.sum(-lp * batch.advantages * m) / m.sum()
    cm = batch.ce_mask[:, 1:]
    ce = np.sum(-logp(logits[:, :seq_len - 1], batch.input_ids[:, 1:seq_len]) * cm) / cm.sum()
    grads, metrics = _accumulate(learner, algo, batch)
    assert abs(metrics["loss"] - (0.7 * rl + 0.3 * ce)) <= 1e-5 * abs(0.7 * rl + 0.3 * ce)
    assert abs(metrics["ebft/rl_loss"] - rl) <= 1e-5 * abs(rl) and abs(metrics["ebft/ce_loss"] - ce) <= 1e-5 * ce
    assert metrics["sampling/logp_diff"] <= 1e-5
    # Two micro-batches with step-global normalisers: the same loss and gradient.
    split_grads, split_metrics = _accumulate(split, split_algo, batch)
    assert abs(split_metrics["loss"] - metrics["loss"]) <= 1e-5 * abs(metrics["loss"])
    assert max_rel_err(split_grads, grads) <= 1e-5
    before = jax.tree.map(np.asarray, learner.params)
    out = algo.update(learner, batch)
    assert out["grad_norm"] > 0 and max_rel_err(learner.params, before) > 1e-4


def _run_config(model_dir, out, **kw):
    ebft = dataclasses.replace(EBFT, context_length=8, stride=4, generate_max_len=4, n_samples_per_prompt=2,
                               feature_layers=(0.5, 1.0), ce_coef=0.1)
    data = DataConfig(prompts_per_batch=2, max_prompt_length=64, arithmetic=ArithmeticConfig(num_examples=40))
    return TrainConfig(algorithm="ebft_strided", model=ModelSpec(path=str(model_dir)), data=data, ebft=ebft,
                       rollout=RolloutConfig(temperature=TEMPERATURE), optim=OptimConfig(learning_rate=1e-3),
                       output_dir=str(out), **kw)


def test_strided_run_writes_metrics_and_resumes_exactly(tiny_model_dir, tmp_path):
    from jrl.train.trainer import train

    straight = train(_run_config(tiny_model_dir, tmp_path / "a", max_steps=2, save_every=0), progress=False)
    keys = ("ebft/alignment", "ebft/diversity", "ebft/reward", "ebft/cfm_loss", "ebft/rl_loss", "ebft/ce_loss",
            "ebft/advantages_std", "ebft/num_blocks", "loss", "grad_norm", "sampling/logp_diff")
    assert [h["step"] for h in straight] == [1, 2]
    for h in straight:
        assert all(np.isfinite(h[k]) for k in keys), h
        assert h["ebft/num_blocks"] > 0 and h["sampling/logp_diff"] <= 1e-4
    lines = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert lines == straight and (tmp_path / "a" / "curves.png").is_file()

    train(_run_config(tiny_model_dir, tmp_path / "b", max_steps=1, save_every=0), progress=False)
    resumed = train(_run_config(tiny_model_dir, tmp_path / "b", max_steps=2, save_every=0, resume=True),
                    progress=False)
    assert [h["step"] for h in resumed] == [1, 2]
    for k in keys:
        assert abs(resumed[-1][k] - straight[-1][k]) <= 1e-5 * max(1.0, abs(straight[-1][k])), k


def test_plain_text_documents_from_a_file(tiny_model_dir, tmp_path):
    """Records without the ground-truth column are plain documents: the text column tokenized as is."""
    from jrl.train.trainer import Trainer

    texts = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs"]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    data = DataConfig(source=str(tmp_path / "docs.jsonl"), prompt_column="text", use_chat_template=False,
                      prompts_per_batch=2, shuffle=False)
    cfg = TrainConfig(algorithm="ebft_strided", model=ModelSpec(path=str(tiny_model_dir)), data=data, ebft=EBFT,
                      output_dir=str(tmp_path / "run"))
    trainer = Trainer(cfg, progress=False)
    try:
        docs = trainer.algorithm.documents(next(trainer.loader))
    finally:
        trainer.close()
    assert docs.prompt_lengths is None
    want = [trainer.tokenizer(t)["input_ids"] for t in texts]
    assert [row[:n].tolist() for row, n in zip(docs.ids, docs.lengths)] == want
    assert want[0][1:] == list(texts[0].encode())  # BOS, then the bytes
    assert document_layout(docs, EBFT).anchors[0, 0] == EBFT.context_length
