"""Tiny models, rollout batches, reward files, run-log readers and multi-device workers for the trainer
tests (models built locally, random, float32)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from jrl.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_byte_tokenizer
from jrl.models import ModelConfig, create_model, save_pretrained
from jrl.train.algorithms.grpo_update import PolicyUpdate, StepBatch
from jrl.train.config import OptimConfig
from jrl.train.learner import Learner

TINY = dict(model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=BOS_ID,
            eos_token_id=EOS_ID, pad_token_id=PAD_ID, initializer_range=0.2)


def tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY, "dtype": "float32", "param_dtype": "float32", **overrides})


def tiny_model(seed: int = 0, **overrides):
    return create_model(tiny_config(**overrides), seed=seed)


def save_tiny_model_dir(path: Path, seed: int = 0, **overrides) -> Path:
    """A random tiny Llama (or what ``overrides`` of its config make it) + jrl's byte tokenizer as a Hugging Face
    directory."""
    save_pretrained(tiny_model(seed, **overrides), path)
    save_byte_tokenizer(path)
    return Path(path)


def random_step_batch(seed: int, n: int = 8, prompt_len: int = 5, completion_len: int = 6,
                      vocab: int = VOCAB_SIZE, with_sampler: bool = True) -> StepBatch:
    """A synthetic rollout: left-padded prompts, right-padded completions with random lengths
    (some truncated), random advantages and sampler log-probs near the true scale."""
    rng = np.random.default_rng(seed)
    p_len = rng.integers(1, prompt_len + 1, n)
    p_mask = (np.arange(prompt_len)[None] >= prompt_len - p_len[:, None]).astype(np.int32)
    c_len = rng.integers(0, completion_len + 1, n)
    c_mask = (np.arange(completion_len)[None] < c_len[:, None]).astype(np.int32)
    p_ids = np.where(p_mask > 0, rng.integers(0, vocab, (n, prompt_len)), PAD_ID).astype(np.int32)
    c_ids = np.where(c_mask > 0, rng.integers(0, vocab, (n, completion_len)), PAD_ID).astype(np.int32)
    samp = np.where(c_mask > 0, -rng.uniform(4.5, 6.5, (n, completion_len)), np.nan).astype(np.float32)
    return StepBatch(
        input_ids=np.concatenate([p_ids, c_ids], 1), attention_mask=np.concatenate([p_mask, c_mask], 1),
        completion_ids=c_ids, completion_mask=c_mask, advantages=rng.standard_normal(n).astype(np.float32),
        truncated=c_len == completion_len, sampler_logprobs=samp if with_sampler else None)


def grpo_learner(model, algo, optim=None, *, total_updates: int, num_iterations: int = 1,
                 temperature: float = 1.0, loss_head: str = "auto",
                 docs_per_step: int | None = None) -> tuple[Learner, PolicyUpdate]:
    """A learner of ``model`` and the GRPO-family update of ``algo`` on it."""
    learner = Learner(model, optim or OptimConfig(), total_updates=total_updates)
    return learner, PolicyUpdate(algo, learner, temperature=temperature, num_iterations=num_iterations, impl="auto",
                                 loss_head=loss_head, docs_per_step=docs_per_step)


def max_rel_err(a, b) -> float:
    """max |a - b| / max |b| over every leaf of two pytrees of the same structure."""
    import jax

    errs = [float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / max(float(np.max(np.abs(np.asarray(y)))), 1e-30))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)]
    return max(errs)


#: A reward module with functions ``low_ids`` (varies between random completions) and ``rare_low_id`` (0 for
#: all completions of many groups); with ``crash`` set,
#: the call after the ``crash``-th raises ``KeyboardInterrupt`` (a simulated kill mid-run).
LOW_IDS_REWARD = '''
import multiprocessing
import os
import signal

CALLS = 0
CRASH_AFTER = {crash}
SIGTERM_AT = {sigterm}


def _call():
    global CALLS
    CALLS += 1
    if CRASH_AFTER is not None and CALLS > CRASH_AFTER:
        raise KeyboardInterrupt("simulated kill")
    if CALLS == SIGTERM_AT:
        # what a scheduler sends mid-step, to the trainer (this worker's parent, or this process without workers)
        os.kill(os.getppid() if multiprocessing.parent_process() else os.getpid(), signal.SIGTERM)


def low_ids(prompts, completions, completion_ids, **kw):
    """Fraction of completion tokens with an id below 128: varies between random completions."""
    _call()
    return [sum(i < 128 for i in ids) / max(1, len(ids)) for ids in completion_ids]


def rare_low_id(prompts, completions, completion_ids, **kw):
    """1 when the completion has a token id below 8, else 0: many groups of random completions get all 0."""
    _call()
    return [float(any(i < 8 for i in ids)) for ids in completion_ids]
'''


def write_reward_file(tmp_path: Path, name: str, crash: int | None = None, sigterm: int | None = None) -> Path:
    """``<tmp_path>/<name>.py`` holding :data:`LOW_IDS_REWARD` (a distinct module name per run): with ``crash``
    it raises KeyboardInterrupt from call ``crash + 1`` on (a kill of the run when the rewards run in its process,
    ``scoring.num_workers=0``); with ``sigterm`` call ``sigterm`` sends the trainer SIGTERM."""
    path = Path(tmp_path) / f"{name}.py"
    path.write_text(LOW_IDS_REWARD.format(crash=crash, sigterm=sigterm))
    return path


def read_metrics_log(out_dir, timing: tuple[str, ...] = ("tokens_per_second",)) -> list[dict]:
    """The rows of ``<out_dir>/metrics.jsonl`` without the metrics that depend on timing (``time/*`` and
    ``timing``), so runs that compute the same thing compare equal."""
    rows = [json.loads(x) for x in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k not in timing} for r in rows]


def run_worker(script: str, *args: str, num_devices: int = 2, timeout: float = 300) -> dict:
    """Run ``tests/train/<script>`` in a child process on ``num_devices`` fake CPU devices; its JSON result
    (the last stdout line starting with ``{``)."""
    import child_processes as helpers  # here: worker scripts import this module, and tests/ is not on their path

    proc = subprocess.run([sys.executable, str(Path(__file__).parent / script), *map(str, args)],
                          env=helpers.worker_env(num_devices), capture_output=True, text=True, timeout=timeout,
                          cwd=helpers.REPO)
    if proc.returncode:
        raise AssertionError(f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\n"
                             f"stderr:\n{proc.stderr[-6000:]}")
    return helpers.parse_json_tail(proc.stdout)
