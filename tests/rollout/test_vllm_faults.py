"""Faults against a real vLLM server: a server serving another base model is refused with a clear error,
and a server killed and restarted mid-run is waited for, gets the current adapter back, and the request
that hit the outage completes."""

from __future__ import annotations

import threading
import time

import jax
import pytest
from vllm_testlib import EOS_ID, PAD_ID, TINY_MODEL, logprob_tolerance, mean_abs_logprob_diff

from jrl.models import from_pretrained, save_pretrained
from jrl.models.lora import LoraConfig, apply_lora, lora_layers
from jrl.rollout import SamplingParams
from jrl.rollout.vllm_engine import VLLMRolloutEngine
from jrl.rollout.vllm_http import VLLMError

pytestmark = pytest.mark.vllm

PARAMS = SamplingParams(max_new_tokens=12, temperature=0.9, stop_token_ids=(EOS_ID,))
PROMPTS = [[257] + list(b"12+30="), [257] + list(b"7+8=")]


def test_server_with_another_base_model_is_refused(vllm_server, tmp_path):
    other = save_pretrained(from_pretrained(TINY_MODEL, dtype="float32"), tmp_path / "other-model")
    model = apply_lora(from_pretrained(other, dtype="float32"), LoraConfig(rank=4))
    with pytest.raises(VLLMError) as e:
        VLLMRolloutEngine(model, config=vllm_server.config, sync="lora", sync_dir=tmp_path / "sync", pad_id=PAD_ID)
    msg = str(e.value)
    assert f"{vllm_server.config.base_urls[0]}/v1/models" in msg and str(TINY_MODEL) in msg and "other-model" in msg
    assert "--model" in msg and "served_model_name" in msg


@pytest.mark.slow  # 45 s: a second server start; the default suite keeps the other fault tests
def test_server_restart_mid_run_resyncs_the_adapter_and_continues(vllm_server, tmp_path):
    server = vllm_server.server
    model = apply_lora(from_pretrained(TINY_MODEL, dtype="float32"), LoraConfig(rank=8, alpha=16.0), seed=1)
    engine = VLLMRolloutEngine(model, config=vllm_server.config, sync="lora", sync_dir=tmp_path / "sync",
                               pad_id=PAD_ID)
    for i, layer in enumerate(lora_layers(model).values()):
        b = layer.lora_b.get_value()
        layer.lora_b.set_value(0.3 * jax.random.normal(jax.random.key(i), b.shape, b.dtype))
    engine.sync_weights(model, 1)
    name = engine.current_name
    server.kill()  # a crash: the adapter and everything else loaded on the server is gone
    assert not engine.client.healthy()
    errors = []

    def restart():
        time.sleep(2.0)  # the engine sees "connection refused" first
        try:
            server.start()
        except BaseException as e:  # surfaced by the assertion below
            errors.append(e)

    thread = threading.Thread(target=restart)
    thread.start()
    t0 = time.monotonic()
    batch = engine.generate(PROMPTS, PARAMS, num_generations=3, seed=2)
    waited = time.monotonic() - t0
    thread.join()
    assert not errors, errors
    print(f"generate waited {waited:.1f} s for the restarted server")
    assert engine.client.reconnects >= 1 and waited < vllm_server.config.restart_timeout + 30
    assert batch.policy_version == 1 and engine.current_name == name
    assert name in {m["id"] for m in engine.client.get("/v1/models")["data"]}
    # The completions come from the re-synced adapter, not the bare base model of the fresh server.
    assert mean_abs_logprob_diff(model, batch, PARAMS.temperature) <= logprob_tolerance(vllm_server.config.dtype)
