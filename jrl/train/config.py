"""The typed config of a GRPO training run (:class:`TrainConfig`) and its sections.

A config file is a Python file defining ``config() -> TrainConfig`` (see ``configs/grpo.py``);
``scripts/train.py --config FILE`` loads it and applies command-line overrides with tyro
(``--max-steps 3 --rollout.temperature 0.8``). Every field has a docstring, which ``--help`` shows.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Literal

from jrl.data.pipeline import DataConfig
from jrl.losses import GRPOConfig
from jrl.models.lora import LoraConfig
from jrl.rollout.base import SamplingParams
from jrl.rollout.vllm_config import VLLMConfig
from jrl.sharding import MeshConfig
from jrl.train.ebft_config import EBFTConfig
from jrl.train.rewards import RewardSpec

#: Rewards of the built-in arithmetic task (exact answer, plus partial credit for the format).
ARITHMETIC_REWARDS = (
    RewardSpec(path="jrl.data.tasks.arithmetic:exact_match", weight=1.0),
    RewardSpec(path="jrl.data.tasks.arithmetic:format_reward", weight=0.5),
)


def _bad(field: str, value, fix: str) -> ValueError:
    return ValueError(f"{field}={value!r} is invalid: {fix}")


def _pos_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which checkpoint to train and in which precision."""

    path: str = "models/tiny-arithmetic"
    """Hugging Face model directory (config.json + safetensors + tokenizer files)."""
    dtype: str = "float32"
    """Compute dtype (``float32`` or ``bfloat16``)."""
    param_dtype: str | None = None
    """Storage dtype of the weights; None = ``dtype``."""

    def __post_init__(self):
        for name in ("dtype", "param_dtype"):
            v = getattr(self, name)
            if v is not None and v not in ("float32", "bfloat16", "float16"):
                raise _bad(f"ModelSpec.{name}", v, "use 'float32', 'bfloat16' or 'float16'")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """How completions are generated."""

    backend: str = "jax"
    """Rollout engine: ``jax`` (the embedded sampler with a KV cache) or ``vllm`` (an external vLLM
    server, configured by ``vllm``)."""
    sync: Literal["auto", "lora", "full"] = "auto"
    """How trained weights reach a ``vllm`` server: ``lora`` (export the PEFT adapter and hot-load it),
    ``full`` (export the whole checkpoint and reload it in place), ``auto`` (``lora`` for a LoRA run,
    else ``full``)."""
    vllm: VLLMConfig = dataclasses.field(default_factory=VLLMConfig)
    """Server address, timeouts, retries and launch flags of the ``vllm`` backend."""
    max_new_tokens: int = 16
    """Most tokens per completion; also the padded completion length of the train step."""
    temperature: float = 1.0
    """Sampling temperature; the loss log-probs use the same one (``algo.temperature`` is set to it)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop tokens; the tokenizer's EOS always stops."""
    sync_interval: int = 1
    """Training steps between weight syncs to the rollout engine (1 = after every step); checkpoint
    steps always sync, so a resumed run samples like the uninterrupted one."""
    prefetch_depth: int = 0
    """Rollout batches generated in a background thread ahead of the trainer (0 = synchronous:
    generate, then train). 1 overlaps generating step k + 1 with training step k."""
    max_staleness: int = 1
    """Largest lag, in policy versions (training steps), between the weights that generated a batch
    and the weights it trains; generation waits when it would be exceeded. Must be >=
    ``sync_interval - 1``; the background thread runs ``min(prefetch_depth, max_staleness -
    sync_interval + 1)`` steps ahead (0 makes a prefetching run exactly the synchronous one)."""

    @property
    def run_ahead(self) -> int:
        """Training steps by which generation runs ahead of the trainer (0 when synchronous)."""
        return min(self.prefetch_depth, self.max_staleness - self.sync_interval + 1)

    def sampling_params(self, eos_ids: tuple[int, ...] = ()) -> SamplingParams:
        stops = tuple(dict.fromkeys(tuple(eos_ids) + tuple(self.stop_token_ids)))
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, stop_token_ids=stops)

    def __post_init__(self):
        self.sampling_params()  # validates the sampling fields
        if self.sync not in ("auto", "lora", "full"):
            raise _bad("RolloutConfig.sync", self.sync, "use 'auto', 'lora' or 'full'")
        if not _pos_int(self.sync_interval):
            raise _bad("RolloutConfig.sync_interval", self.sync_interval, "use an int >= 1 (1 = sync after every step)")
        for name in ("prefetch_depth", "max_staleness"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise _bad(f"RolloutConfig.{name}", v, "use an int >= 0")
        if self.max_staleness < self.sync_interval - 1:
            raise _bad("RolloutConfig.max_staleness", self.max_staleness,
                       f"with sync_interval={self.sync_interval} the sampler's weights are up to "
                       f"{self.sync_interval - 1} steps old between syncs; use max_staleness >= "
                       f"{self.sync_interval - 1} or a smaller sync_interval")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with warmup + schedule, global-norm clipping and gradient accumulation."""

    learning_rate: float = 1e-5
    """Peak learning rate."""
    b1: float = 0.9
    """Adam beta1."""
    b2: float = 0.999
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay (AdamW)."""
    warmup_steps: int = 0
    """Linear warmup from 0 to ``learning_rate`` over this many optimizer steps."""
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    """Learning-rate shape after warmup, decaying to 0 at ``max_steps`` for cosine/linear."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (None = no clipping)."""
    micro_batch_size: int | None = None
    """Sequences per forward/backward pass; the step's ``prompts_per_batch x num_generations``
    sequences are split into micro-batches whose gradients are summed (None = one micro-batch)."""

    def __post_init__(self):
        for name in ("learning_rate", "eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise _bad(f"OptimConfig.{name}", v, "use a finite number > 0")
        for name in ("b1", "b2"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise _bad(f"OptimConfig.{name}", v, "use a number in [0, 1)")
        if not isinstance(self.weight_decay, (int, float)) or self.weight_decay < 0:
            raise _bad("OptimConfig.weight_decay", self.weight_decay, "use a number >= 0")
        if isinstance(self.warmup_steps, bool) or not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise _bad("OptimConfig.warmup_steps", self.warmup_steps, "use an int >= 0")
        if self.schedule not in ("constant", "cosine", "linear"):
            raise _bad("OptimConfig.schedule", self.schedule, "use 'constant', 'cosine' or 'linear'")
        if self.max_grad_norm is not None and (not isinstance(self.max_grad_norm, (int, float))
                                               or not self.max_grad_norm > 0):
            raise _bad("OptimConfig.max_grad_norm", self.max_grad_norm, "use a number > 0, or None for no clipping")
        if self.micro_batch_size is not None and not _pos_int(self.micro_batch_size):
            raise _bad("OptimConfig.micro_batch_size", self.micro_batch_size, "use an int >= 1, or None")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A GRPO run: model, adapters, devices, prompts, rollouts, rewards, objective, optimizer, bookkeeping."""

    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    """The checkpoint to train."""
    lora: LoraConfig | None = None
    """LoRA adapters (base frozen); None = full fine-tune."""
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    """Device mesh (default: FSDP over every device)."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Prompt source and batching (``prompts_per_batch`` prompts per optimizer step)."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Rollout engine and sampling."""
    rewards: tuple[RewardSpec, ...] = ARITHMETIC_REWARDS
    """Reward functions by import path, with weights (default: the arithmetic task's two rewards).
    Not used when ``ebft`` is set: EBFT's reward is feature matching against the ground truth."""
    ebft: EBFTConfig | None = None
    """Energy-based fine-tuning instead of reward functions (None = plain GRPO); ``ebft.mode`` picks the
    structured (GRPO pipeline, feature-matching reward) or strided (raw documents) trainer."""
    algo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)
    """Objective, advantages and sampler correction (``num_generations`` completions per prompt);
    ``algo.temperature`` is always set to ``rollout.temperature``."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer, schedule and gradient accumulation."""
    logprobs_impl: str = "auto"
    """Log-prob kernel of the train step: ``auto``, ``reference``, ``xla``, ``triton``, ``pallas_tpu``, or
    ``triton_saveprobs`` (GPU: faster backward for a bf16 ``[tokens, vocab]`` buffer; never picked by auto)."""
    max_steps: int = 100
    """Training steps; each samples one rollout of ``prompts_per_batch x num_generations``
    completions and makes ``num_iterations`` optimizer updates on it."""
    num_iterations: int = 1
    """mu: optimizer updates per rollout (old log-probs are computed once per rollout when > 1)."""
    output_dir: str = "runs/grpo"
    """Where metrics.jsonl, TensorBoard events, checkpoints and the reward/loss plot go."""
    seed: int = 0
    """Seed of LoRA init and sampling (each step's sampling seed is derived from it and the step)."""
    save_every: int = 50
    """Checkpoint every this many steps (and always at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept."""
    log_every: int = 1
    """Print a metrics line every this many steps (metrics.jsonl gets every step)."""
    resume: bool = False
    """Continue from the latest checkpoint in ``output_dir``."""
    overwrite: bool = False
    """Start afresh in an ``output_dir`` that holds an earlier run, deleting its metrics, TensorBoard
    events, plot and checkpoints (without it, or ``resume``, such a directory is an error)."""

    def __post_init__(self):
        g = self.algo.num_generations
        if g < 2:
            raise _bad("TrainConfig.algo.num_generations", g,
                       "GRPO compares completions of the same prompt; use >= 2 (e.g. 8)")
        if self.algo.temperature != self.rollout.temperature:
            # The loss must score tokens at the temperature they were sampled at (grpo.md §2.1, §19).
            object.__setattr__(self, "algo", dataclasses.replace(self.algo, temperature=self.rollout.temperature))
        if self.algo.max_completion_length is not None and self.algo.max_completion_length < self.rollout.max_new_tokens:
            raise _bad("TrainConfig.algo.max_completion_length", self.algo.max_completion_length,
                       f"it must be >= rollout.max_new_tokens={self.rollout.max_new_tokens}, or None")
        if self.algo.reward_weights is not None:
            raise _bad("TrainConfig.algo.reward_weights", self.algo.reward_weights,
                       "set the weights on the reward specs (TrainConfig.rewards[i].weight) and leave it None")
        if self.ebft is None and not self.rewards:
            raise _bad("TrainConfig.rewards", self.rewards, "give at least one RewardSpec")
        rows = self.data.prompts_per_batch * g
        mb = self.optim.micro_batch_size
        if mb is not None and rows % mb:
            raise _bad("TrainConfig.optim.micro_batch_size", mb,
                       f"it must divide data.prompts_per_batch x algo.num_generations = {rows}")
        for name in ("max_steps", "num_iterations", "log_every", "keep_checkpoints"):
            if not _pos_int(getattr(self, name)):
                raise _bad(f"TrainConfig.{name}", getattr(self, name), "use an int >= 1")
        if isinstance(self.save_every, bool) or not isinstance(self.save_every, int) or self.save_every < 0:
            raise _bad("TrainConfig.save_every", self.save_every, "use an int >= 0 (0 = only at the end)")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise _bad("TrainConfig.seed", self.seed, "use an int")

    @property
    def reward_weights(self) -> tuple[float, ...]:
        """Weights of the reward columns: one per reward spec, or the single EBFT reward's 1.0."""
        if self.ebft is not None:
            return (1.0,)
        return tuple(float(r.weight) for r in self.rewards)


def load_config_file(path: str | Path) -> TrainConfig:
    """Import a Python config file and return its ``config()``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist; pass --config path/to/config.py")
    spec = importlib.util.spec_from_file_location(f"jrl_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fn = getattr(module, "config", None)
    if not callable(fn):
        raise ValueError(f"config file {str(path)!r} defines no function config() returning a TrainConfig")
    cfg = fn()
    if not isinstance(cfg, TrainConfig):
        raise TypeError(f"config() in {str(path)!r} returned {type(cfg).__name__}, expected jrl.train.TrainConfig")
    return cfg
