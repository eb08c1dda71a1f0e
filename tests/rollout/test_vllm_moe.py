"""LoRA on a MoE model's experts and routers, served by a real vLLM server (CPU build): the full checkpoint the
``filesystem`` weight sync writes for such a run (adapters merged, ``rollout.sync='auto'``) is read by vLLM as the
trainer's adapted model: log-probs of prompts and of sampled tokens agree.

vLLM 0.32's CPU build cannot take part in such a run itself: with ``--enable-lora`` its LoRA fused-MoE layer calls
Triton kernels the CPU build lacks (the worker dies at the first request), and after ``reload_weights`` of a MoE
checkpoint (even the one it started from) it serves log-probs about 1 nat off; so the server here starts on the
merged checkpoint, and the rollout engine refuses ``device='cpu'`` for MoE models."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from vllm_testlib import EOS_ID, PAD_ID, free_port, logprob_tolerance, server_config

from jrl.data.tokenizer import save_byte_tokenizer
from jrl.models import ModelConfig, create_model, from_pretrained, merge_lora, save_pretrained
from jrl.models.lora import MOE_LORA_TARGETS, LoraConfig, LoRAParam, apply_lora, lora_disabled
from jrl.rollout.vllm_http import VLLMClient
from jrl.rollout.vllm_server import VLLMServer, server_command

pytestmark = pytest.mark.vllm

#: head_dim 64 (the CPU attention backend's smallest), 4 experts of which 2 per token, the byte tokenizer's ids.
MOE = ModelConfig(model_type="qwen3_moe", vocab_size=262, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=64, qk_norm=True, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=64, bos_token_id=257, eos_token_id=EOS_ID,
                  pad_token_id=PAD_ID, dtype="float32", param_dtype="float32", initializer_range=0.1)
PROMPTS = [[257] + list(text.encode()) for text in ("12*34=408", "5*6=30 and 7*8=", "99*99=")]


def _log_probs(model, ids: list[int]) -> np.ndarray:
    """log p(ids[i] | ids[:i]) for i >= 1 under ``model`` (float32)."""
    logp = jax.nn.log_softmax(model(jnp.asarray([ids]))[0], axis=-1)
    return np.asarray(logp[jnp.arange(len(ids) - 1), jnp.asarray(ids[1:])], np.float64)


# 109 s alone, 135 s beside a second test process (2-core CPU); the default suite checks the merged expert-LoRA
# export against transformers + peft (tests/models/test_model_peft.py) and the LoRA sync to a real vLLM server
# (test_vllm_e2e.py)
@pytest.mark.slow
def test_merged_expert_lora_checkpoint_is_served_as_the_adapted_model(tmp_path):
    base_dir = save_pretrained(create_model(MOE, seed=0), tmp_path / "base", progress=False)
    save_byte_tokenizer(base_dir)
    model = apply_lora(from_pretrained(base_dir, dtype="float32"),
                       LoraConfig(rank=8, alpha=16.0, target_modules=("q_proj",), target_parameters=MOE_LORA_TARGETS))
    key = jax.random.key(3)
    for i, (_, var) in enumerate(sorted(nnx.to_flat_state(nnx.state(model, LoRAParam)), key=lambda kv: str(kv[0]))):
        var.set_value(0.3 * jax.random.normal(jax.random.fold_in(key, i), var.shape, var.dtype))
    merged_dir = save_pretrained(merge_lora(model), tmp_path / "merged", progress=False)  # what a sync writes

    cfg = server_config(free_port(), dtype="float32")  # the weights are under test, not bfloat16 rounding
    tol = logprob_tolerance(cfg.dtype)
    argv, env = server_command(cfg, model=merged_dir, lora_rank=None)
    server = VLLMServer(argv, env, base_url=cfg.base_urls[0], log_file=tmp_path / "server.log",
                        startup_timeout=cfg.startup_timeout)
    server.start()
    try:
        client = VLLMClient(cfg.base_urls[0], connect_timeout=cfg.connect_timeout, read_timeout=cfg.read_timeout)
        diffs, stale = [], []
        for seed, prompt in enumerate(PROMPTS):
            out = client.post("/v1/completions", {
                "model": str(merged_dir), "prompt": prompt, "max_tokens": 6, "echo": True, "logprobs": 0,
                "temperature": 1.0, "seed": seed, "return_token_ids": True, "stop_token_ids": [EOS_ID]})["choices"][0]
            ids = prompt + list(out["token_ids"])
            served = np.asarray(out["logprobs"]["token_logprobs"][1:], np.float64)  # prompt, then sampled tokens
            assert len(served) == len(ids) - 1 and np.isfinite(served).all()
            diffs.append(np.abs(_log_probs(model, ids) - served).mean())
            with lora_disabled(model):
                stale.append(np.abs(_log_probs(model, ids) - served).mean())
    finally:
        server.stop()
    print(f"vLLM ({cfg.dtype}) serving the merged expert-LoRA checkpoint vs jrl's adapted model (float32): mean "
          f"|logprob diff| per prompt {np.round(diffs, 6).tolist()}; vs the base model {np.round(stale, 3).tolist()}")
    assert max(diffs) <= tol
    assert min(stale) > 10 * tol  # the adapters change the model: an unmerged export would fail above
