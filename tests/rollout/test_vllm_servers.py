"""Several real vLLM servers behind ``rollout.vllm.base_urls``: requests split across them, every LoRA sync reaches
each, and one killed mid-run is skipped (its requests served by the other, no step lost), then synced to the version
it missed when it is back and used again."""

from __future__ import annotations

import dataclasses
import re

import jax
import pytest
from vllm_testlib import EOS_ID, PAD_ID, TINY_MODEL, free_port, logprob_tolerance, make_server, mean_abs_logprob_diff
from vllm_testlib import server_config

from jrl.models import from_pretrained
from jrl.models.lora import LoraConfig, apply_lora, lora_layers
from jrl.rollout import SamplingParams
from jrl.rollout.config import RolloutConfig
from jrl.rollout.vllm_engine import MultiServerEngine, make_vllm_engine
from jrl.rollout.vllm_http import VLLMClient

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~2 min: a second server, started twice

PARAMS = SamplingParams(max_new_tokens=8, temperature=0.9, stop_token_ids=(EOS_ID,))
PROMPTS = [[257] + list(f"{a}+{b}=".encode()) for a, b in [(1, 2), (30, 4), (7, 8), (12, 30), (5, 5), (9, 41)]]


def _served_requests(url: str) -> float:
    """Completions the server at ``url`` finished (its Prometheus counter ``vllm:request_success_total``, which counts
    each of a request's ``n`` samples)."""
    text = VLLMClient(url).get("/metrics")
    return sum(float(m.group(1)) for m in re.finditer(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M))


def _perturb(model, seed: int) -> None:
    for i, layer in enumerate(lora_layers(model).values()):
        b = layer.lora_b.get_value()
        layer.lora_b.set_value(0.3 * jax.random.normal(jax.random.key(seed * 1000 + i), b.shape, b.dtype))


def _adapters(url: str) -> set[str]:
    return {m["id"] for m in VLLMClient(url).get("/v1/models")["data"]}


def test_two_servers_share_requests_get_every_sync_and_survive_a_restart(vllm_server, tmp_path):
    second_cfg = server_config(free_port())
    second = make_server(second_cfg, tmp_path / "second.log").start()
    try:
        urls = (vllm_server.config.base_urls[0], second_cfg.base_urls[0])
        cfg = dataclasses.replace(vllm_server.config, base_urls=urls)
        model = apply_lora(from_pretrained(TINY_MODEL, dtype="float32"), LoraConfig(rank=8, alpha=16.0), seed=1)
        rollout = RolloutConfig(backend="vllm", sync="lora", vllm=cfg)
        engine = make_vllm_engine(model, pad_id=PAD_ID, mesh=None, rules=None, rollout=rollout, output_dir=tmp_path)
        assert isinstance(engine, MultiServerEngine)
        tol = logprob_tolerance(cfg.dtype)
        try:
            # Version 1 reaches both servers; the requests of one batch are split over them.
            _perturb(model, 1)
            engine.sync_weights(model, 1)
            for server in engine.servers:
                assert server.current_name in _adapters(server.base_url)
            before = [_served_requests(u) for u in urls]
            batch = engine.generate(PROMPTS, PARAMS, num_generations=2, seed=3)
            served = [_served_requests(u) - b for u, b in zip(urls, before)]
            assert batch.policy_version == 1 and batch.completion_ids.shape[0] == 2 * len(PROMPTS)
            assert sum(served) == 2 * len(PROMPTS) and min(served) >= 2, served
            assert mean_abs_logprob_diff(model, batch, PARAMS.temperature) <= tol

            # The second server dies: the batch is still complete, served by the first; version 2 reaches only it.
            second.kill()
            before = _served_requests(urls[0])
            batch = engine.generate(PROMPTS, PARAMS, num_generations=2, seed=4)
            assert _served_requests(urls[0]) - before == 2 * len(PROMPTS)
            assert engine.up == [True, False]
            _perturb(model, 2)
            engine.sync_weights(model, 2)
            batch = engine.generate(PROMPTS, PARAMS, num_generations=2, seed=5)
            assert batch.policy_version == 2
            assert mean_abs_logprob_diff(model, batch, PARAMS.temperature) <= tol

            # Back: it gets version 2 (which it missed) before serving again, and takes requests.
            second.start()
            requests = list(engine.requests)
            batch = engine.generate(PROMPTS, PARAMS, num_generations=2, seed=6)
            assert engine.up == [True, True]
            assert engine.servers[1].version == 2 and engine.servers[1].current_name in _adapters(urls[1])
            assert engine.requests[1] > requests[1]
            assert mean_abs_logprob_diff(model, batch, PARAMS.temperature) <= tol
        finally:
            engine.close()
    finally:
        second.stop()
