"""The vLLM rollout engine against a real vLLM server on the tiny default model: sampled-token logprobs
agree with the trainer's for the same weights (base and after a LoRA sync), token ids come back unchanged,
LoRA sync serves the new version and unloads old ones, full sync changes what is served."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from vllm_testlib import EOS_ID, PAD_ID, TINY_MODEL, logprob_tolerance, mean_abs_logprob_diff

from jrl.models import from_pretrained, named_params
from jrl.models.lora import LoraConfig, apply_lora, lora_disabled, lora_layers
from jrl.rollout import SamplingParams
from jrl.rollout.vllm_engine import VLLMRolloutEngine, completion_request
from jrl.rollout.vllm_http import VLLMRequestError

pytestmark = pytest.mark.vllm

TEMPERATURE = 0.8
PARAMS = SamplingParams(max_new_tokens=16, temperature=TEMPERATURE, stop_token_ids=(EOS_ID,))


def _prompts(seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[257] + list(f"{a}+{b}=".encode()) for a, b in rng.integers(0, 99, (3, 2))]


def _lora_model(seed: int = 0):
    model = from_pretrained(TINY_MODEL, dtype="float32")
    return apply_lora(model, LoraConfig(rank=8, alpha=16.0), seed=seed)


def _randomize_lora(model, seed: int, scale: float = 0.3) -> None:
    for i, layer in enumerate(lora_layers(model).values()):
        b = layer.lora_b.get_value()
        layer.lora_b.set_value(scale * jax.random.normal(jax.random.key(seed * 1000 + i), b.shape, b.dtype))


def _engine(model, served, tmp_path, **kw) -> VLLMRolloutEngine:
    return VLLMRolloutEngine(model, config=served.config, sync_dir=tmp_path / "sync", pad_id=PAD_ID, **kw)


def test_logprobs_agree_with_trainer_base_and_after_lora_sync(vllm_server, tmp_path):
    tol = logprob_tolerance(vllm_server.config.dtype)
    model = _lora_model()
    engine = _engine(model, vllm_server, tmp_path, sync="lora")
    base = engine.generate(_prompts(0), PARAMS, num_generations=4, seed=1)
    assert base.policy_version == 0 and base.completion_ids.shape[0] == 12
    base_diff = mean_abs_logprob_diff(model, base, TEMPERATURE)
    # The reported logprobs are those of the sampling distribution: at temperature 1 they disagree.
    assert mean_abs_logprob_diff(model, base, 1.0) > 3 * base_diff
    _randomize_lora(model, seed=1)
    engine.sync_weights(model, 1)
    tuned = engine.generate(_prompts(0), PARAMS, num_generations=4, seed=1)
    tuned_diff = mean_abs_logprob_diff(model, tuned, TEMPERATURE)
    with lora_disabled(model):
        stale_diff = mean_abs_logprob_diff(model, tuned, TEMPERATURE)
    print(f"vLLM ({vllm_server.config.dtype}) vs jrl (float32) mean |logprob diff|: base {base_diff:.2e} "
          f"({int(base.completion_mask.sum())} tokens), after LoRA sync {tuned_diff:.2e} "
          f"({int(tuned.completion_mask.sum())} tokens); vs the base model {stale_diff:.2e}")
    assert base_diff <= tol and tuned_diff <= tol
    assert tuned.policy_version == 1 and stale_diff > 10 * tol  # the server really serves the new adapter


def test_token_ids_round_trip(vllm_server, tmp_path):
    model = _lora_model()
    engine = _engine(model, vllm_server, tmp_path, sync="lora")
    prompts = _prompts(3)
    batch = engine.generate(prompts, PARAMS, num_generations=2, seed=5)
    for r in range(len(batch.prompt_ids)):
        assert batch.prompt_ids[r][batch.prompt_mask[r] > 0].tolist() == prompts[r // 2]
        ids = batch.completion_ids[r][batch.completion_mask[r] > 0]
        assert ((ids >= 0) & (ids < model.config.vocab_size)).all()
        assert (batch.completion_ids[r][batch.completion_mask[r] == 0] == PAD_ID).all()
        assert batch.truncated[r] == (ids[-1] != EOS_ID)
    # The raw answer echoes the prompt ids and the sampled ids, whose bytes are the text (no re-tokenisation).
    answer = engine.client.post("/v1/completions", completion_request(engine.current_name, prompts[0], PARAMS,
                                                                       n=4, seed=9))
    checked = 0
    for choice in answer["choices"]:
        assert choice["prompt_token_ids"] == prompts[0]
        ids = [t for t in choice["token_ids"] if t != EOS_ID]
        if all(t < 128 for t in ids):
            assert bytes(ids).decode() == choice["text"]
            checked += 1
    assert checked >= 1


def test_lora_sync_serves_new_versions_and_unloads_old(vllm_server, tmp_path):
    model = _lora_model()
    engine = _engine(model, vllm_server, tmp_path, sync="lora", keep_versions=2)
    for version in range(1, 5):
        _randomize_lora(model, seed=version)
        engine.sync_weights(model, version)
        assert engine.last_sync_seconds > 0 and engine.sync_metrics == {
            "time/sync": engine.last_sync_seconds, "sync/version": float(version)}
    served = {m["id"] for m in engine.client.get("/v1/models")["data"]}
    mine = {name for name in served if name.startswith(engine.tag)}
    assert mine == {engine.adapter_name(3), engine.adapter_name(4)} and engine.current_name == engine.adapter_name(4)
    assert sorted(p.name for p in (tmp_path / "sync").iterdir()) == ["lora-v3", "lora-v4"]
    batch = engine.generate(_prompts(1), PARAMS, num_generations=2, seed=0)
    assert batch.policy_version == 4
    assert mean_abs_logprob_diff(model, batch, TEMPERATURE) <= logprob_tolerance(vllm_server.config.dtype)
    with pytest.raises(VLLMRequestError) as e:  # an unloaded version is gone from the server
        engine.client.post("/v1/completions", completion_request(engine.adapter_name(1), [257], PARAMS, n=1, seed=0))
    assert e.value.status == 404


@pytest.mark.parametrize("transport", ["filesystem", "shared_memory", "async_filesystem"])
def test_full_sync_changes_outputs(vllm_server, tmp_path, transport):
    """Every full-weight transport serves the new weights from the next request on, tagged with their version."""
    tol = logprob_tolerance(vllm_server.config.dtype)
    model = from_pretrained(TINY_MODEL, dtype="float32")
    original = {k: v.get_value() for k, v in named_params(model).items()}
    engine = _engine(model, vllm_server, tmp_path, sync=transport)
    try:
        before = engine.generate(_prompts(2), PARAMS, num_generations=2, seed=3)
        assert mean_abs_logprob_diff(model, before, TEMPERATURE) <= tol
        for i, (name, param) in enumerate(sorted(named_params(model).items())):
            if name.endswith("kernel"):
                v = param.get_value()
                param.set_value(v + 0.05 * jax.random.normal(jax.random.key(i), v.shape, v.dtype))
        engine.sync_weights(model, 1)
        after = engine.generate(_prompts(2), PARAMS, num_generations=2, seed=3)
        assert after.policy_version == 1 and engine.last_sync_seconds > 0
        assert mean_abs_logprob_diff(model, after, TEMPERATURE) <= tol  # serves the new weights...
        assert not np.array_equal(before.completion_ids, after.completion_ids) or \
            np.abs(before.sampling_logprobs - after.sampling_logprobs)[before.completion_mask > 0].mean() > 10 * tol
        root = engine.transport.files.root if transport == "async_filesystem" else engine.transport.root
        assert sorted(p.name for p in root.iterdir()) == ["full-v1"]
    finally:  # put the base weights back for the other tests on this server
        for name, param in named_params(model).items():
            param.set_value(original[name])
        engine.sync_weights(model, 2)
    restored = engine.generate(_prompts(2), PARAMS, num_generations=2, seed=3)
    np.testing.assert_array_equal(restored.completion_ids, before.completion_ids)
    engine.close()
    if transport == "shared_memory":
        assert not root.exists()  # nothing left in RAM
