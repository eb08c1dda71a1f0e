"""The typed config of a training run (:class:`TrainConfig`) and its sections.

A config file is a Python file defining ``config() -> TrainConfig`` (see ``configs/grpo.py``);
``scripts/train.py --config FILE`` loads it and applies command-line overrides with tyro
(``--max-steps 3 --rollout.temperature 0.8``). Every field has a docstring, which ``--help`` shows.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Annotated, Generic, Literal, TypeVar

from tyro.constructors import PrimitiveConstructorSpec

from jrl.data.config import DataConfig
from jrl.kernels.attention import available_impls
from jrl.models.lora_config import LoraConfig
from jrl.models.remat import REMAT_NAMES
from jrl.rollout.config import RolloutConfig
from jrl.sharding.mesh import MeshConfig
from jrl.train.ebft_config import EBFTConfig
from jrl.train.eval_config import EvalConfig
from jrl.explore.config import ExploreConfig
from jrl.train.wandb_config import WandbConfig
from jrl.train.optim_config import OptimConfig
from jrl.sources.config import ReplayConfig, RerollConfig
from jrl.envs.config import EnvConfig
from jrl.rewards.config import RewardSpec
from jrl.validation import check_choice, check_int, check_real, invalid

#: Rewards of the built-in arithmetic task (exact answer, plus partial credit for the format).
ARITHMETIC_REWARDS = (
    RewardSpec(path="jrl.data.tasks.arithmetic:exact_match", weight=1.0),
    RewardSpec(path="jrl.data.tasks.arithmetic:format_reward", weight=0.5),
)


DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Which checkpoint to train and in which precision."""

    path: str = "models/tiny-arithmetic"
    """Hugging Face model directory (config.json + safetensors + tokenizer files)."""
    dtype: str = "float32"
    """Compute dtype (``float32`` or ``bfloat16``)."""
    param_dtype: str | None = None
    """Storage dtype of the weights; None = ``dtype``."""
    attention: str = "auto"
    """Attention implementation (``auto``, ``reference``, ``xla``, ``cudnn``, ``splash``): ``auto`` takes
    cuDNN flash attention on an NVIDIA GPU, splash attention on TPU, and on CPU the dense path for short
    rows and the blocked one (memory O(block²)) for long rows. The embedded sampler's decode steps use a
    Pallas kernel on an NVIDIA GPU and the dense path elsewhere; ``reference`` makes them dense everywhere."""
    remat: str = "auto"
    """Recompute in the backward instead of keeping, per decoder layer: ``auto`` (on a GPU
    ``dots_and_attention_saveable``, which keeps the weight matmuls' and the cuDNN attention's outputs, on a TPU
    ``dots_with_no_batch_dims_saveable``, the weight matmuls' only: on an H100 both faster and smaller than
    keeping everything, benchmarks/RESULTS.md; ``none`` on CPU), ``none``, ``full``, ``dots_saveable``,
    ``dots_with_no_batch_dims_saveable``, ``dots_and_attention_saveable``, ``offload_dots_with_no_batch_dims``."""
    scan_layers: bool = True
    """Keep the decoder layers stacked and run them with ``jax.lax.scan``: one compiled layer body, so the first
    step compiles in about the same time at any depth. Models whose layers differ (Qwen3-MoE with dense
    ``mlp_only_layers``) always run unrolled. ``False`` unrolls a Python loop over separate layers."""
    fsdp_prefetch: bool = True
    """On a mesh of ``data`` and ``fsdp`` axes, run the scanned layers and the loss-fused head per device with their
    FSDP collectives placed by hand: each layer's weights gathered inside its rematerialisation checkpoint (again in
    the backward), its gradient reduce-scattered as the backward leaves it (a dense model; measured in
    benchmarks/RESULTS.md "Scale-out"). ``False`` leaves the collectives to XLA's partitioner (slower)."""
    fsdp_layers_per_gather: int | None = None
    """On that path: 0 gathers each layer's weights inside its checkpoint (and again in the backward); ``P`` >= 1 runs
    the layers in groups of ``P``, each group's weights gathered at once before it and kept for the backward, its
    gradient reduce-scattered when its backward ends (fewer, larger collectives, the weights moved once; the whole
    weights on every device; more compile time, the groups unrolled). ``None``: 2 on a GPU where the whole weights
    and a device's share of the training state take at most half its memory, else 0 (measured on 2 H200s:
    0.935-0.948 of one GPU's speed per GPU against 0.894 per layer; :mod:`jrl.train.fsdp_gathers`). Applies where an
    update runs that path, not where ``optim.grad_sync`` accumulates per device."""
    expert_capacity: float = 0.0
    """With expert parallelism (``mesh.expert`` > 1): the rows a device's experts run, as a multiple of its even share
    of the routed (token, expert) rows; rows routed to a device past that are dropped (they add nothing to their
    token, as with a capacity factor). 0 = dropless (every row runs; exact, slower: measured in
    benchmarks/RESULTS.md, a Qwen3-30B-A3B layer on 4 H200s at 1.25 runs in 0.74x the dropless time)."""
    expert_chunks: int = 1
    """With expert parallelism: run a device's tokens in this many chunks, each gathered over the expert axis and
    handed back on its own, so that one chunk's collectives can run beside another's experts (the same output
    dropless; a capacity applies per chunk). Must divide a device's tokens per micro-batch. On two H200s it made the
    Qwen3-30B-A3B layer slower (5.74 ms at 1, 6.86 at 2, 8.28 at 4 chunks; benchmarks/RESULTS.md, nineteenth
    session): XLA overlapped nothing there."""
    grad_reduce_dtype: str | None = None
    """Dtype of the weight gradients' reduce-scatter on that path: ``None`` = the weights' storage dtype, ``float32``
    to sum bf16 weights' gradients in float32 (twice the bytes)."""

    def __post_init__(self):
        check_choice(self, "dtype", DTYPES)
        if self.param_dtype is not None:
            check_choice(self, "param_dtype", DTYPES)
        check_choice(self, "attention", tuple(available_impls()))
        check_choice(self, "remat", REMAT_NAMES)
        if self.grad_reduce_dtype is not None:
            check_choice(self, "grad_reduce_dtype", DTYPES)
        check_int(self, "expert_chunks", lo=1, fix="use 1 (no chunks) or a divisor of a device's tokens")
        check_int(self, "fsdp_layers_per_gather", lo=0, optional=True, fix="use None (automatic), 0 (each layer "
                  "gathered in its checkpoint) or a number of layers gathered at once, e.g. 2")
        check_real(self, "expert_capacity", ge=0, fix="use 0 (dropless) or a multiple >= 1 of a device's even "
                   "share, e.g. 1.25")
        if 0 < self.expert_capacity < 1:
            raise invalid("ModelSpec", "expert_capacity", self.expert_capacity, "use 0 or a value >= 1",
                          why="below 1 the buffer is smaller than an evenly routed device's rows")


@dataclasses.dataclass(frozen=True)
class ScoringConfig:
    """How the reward functions run (:mod:`jrl.rewards.pool`): in worker processes, each call (one function
    on a block of whole groups) with a timeout, so a function that hangs, crashes its process or raises costs
    only the rows of that call (they get no reward, and the failure is counted and logged)."""

    num_workers: int = 1
    """Worker processes; up to this many calls run at once. 0 = in the trainer's process: no timeout and no
    crash isolation (a function that hangs hangs the run), e.g. to step through a function in a debugger."""
    timeout_s: float = 120.0
    """Seconds one call may run before its worker is killed and its rows get no reward
    (``reward/<fn>/timeouts``); needs ``num_workers`` >= 1."""
    max_failed_steps: int = 3
    """Stop the run with an error once a reward function has failed (raised, crashed, timed out or returned
    something other than one number per completion) on every call of this many consecutive steps."""
    stream_groups: int = 0
    """Score while generating: the step's prompts are generated in chunks of this many, and each chunk's reward
    calls go to the workers as soon as it is generated, so they run while the next chunk is generated; the
    advantages wait for every chunk (the same as unchunked for the same completions). Pays off with slow rewards
    (verifiers, sandboxes) and an engine that samples a chunk about as fast as a batch (a vLLM server). Needs
    ``num_workers`` >= 1 and must divide ``data.prompts_per_batch``; 0 = generate the whole batch, then score it."""

    def __post_init__(self):
        check_int(self, "num_workers", lo=0, fix="use an int >= 0 (0 = in the trainer's process)")
        check_real(self, "timeout_s", gt=0, fix="use a number of seconds > 0")
        check_int(self, "max_failed_steps", lo=1)
        check_int(self, "stream_groups", lo=0, fix="use an int >= 0 (0 = score after the whole batch is generated)")
        if self.stream_groups and self.num_workers == 0:
            raise invalid("ScoringConfig", "stream_groups", self.stream_groups,
                          "scoring while generating needs worker processes: set num_workers >= 1")
        if self.num_workers == 0 and self.timeout_s != ScoringConfig.timeout_s:
            raise invalid("ScoringConfig", "timeout_s", self.timeout_s,
                          "a timeout needs worker processes: set num_workers >= 1, or leave timeout_s at its default")


#: ``--rewards`` on the command line: ``path:function[=weight]`` strings (:meth:`RewardSpec.parse`).
RewardArg = Annotated[RewardSpec, PrimitiveConstructorSpec(
    nargs=1, metavar="PATH:FN[=WEIGHT]", instance_from_str=lambda args: RewardSpec.parse(args[0]),
    is_instance=lambda x: isinstance(x, RewardSpec), str_from_instance=lambda spec: [spec.format()])]


#: The sections of :class:`TrainConfig` that belong to algorithms besides each one's own ``algo``: shared by the
#: algorithms that name them in ``sections`` and unset (at their defaults) for the others.
ALGORITHM_SECTIONS = ("ebft",)

#: The type of the ``algo`` section: the selected algorithm's ``config_type``.
AlgoConfigT = TypeVar("AlgoConfigT")


@dataclasses.dataclass(frozen=True)
class TrainConfig(Generic[AlgoConfigT]):
    """A training run: algorithm, model, adapters, devices, prompts, rollouts, rewards, objective, optimizer,
    bookkeeping. Fields an algorithm or rollout backend does not read must keep their defaults (a set
    value there is an error naming the field), so every flag of ``--help`` has an effect. ``algo`` is the
    algorithm's own section, of the type it registers; the command line offers that type's flags."""

    algorithm: str = "grpo"
    """Training algorithm (an ``ALGORITHMS`` name): ``grpo`` (reward functions, GRPO-family loss of
    ``algo``), ``ebft_structured`` (feature-matching reward against ``ebft.gt_column`` on the GRPO
    pipeline) or ``ebft_strided`` (raw documents, generated blocks, REINFORCE + CE)."""

    mode: Literal["both", "train", "explore"] = "both"
    """``both``: one process samples, scores and trains. ``train``: this process only trains, on scored groups that
    explorer processes put in the experience queue, and publishes its weights for them (``explore`` section).
    ``explore``: this process only samples and scores (``jrl explore`` is ``jrl train --mode explore``); start it
    with the trainer's config. Several explorers may join and leave while a trainer runs."""
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    """The checkpoint to train."""
    lora: LoraConfig | None = None
    """LoRA adapters (base frozen); None = full fine-tune."""
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    """Device mesh (default: FSDP over every device; for a mixture-of-experts model on the devices of one process,
    expert parallel over all of them where its training state fits, ``jrl.sharding.learner_mesh``)."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """Prompt source and batching (``prompts_per_batch`` prompts per optimizer step)."""
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    """Rollout engine and sampling."""
    rewards: tuple[RewardArg, ...] = ARITHMETIC_REWARDS
    """Reward functions by import path, with weights (default: the arithmetic task's two rewards); on the command
    line a list of ``path:function[=weight]`` (``--rewards my_rewards.py:correct=1 my_rewards.py:short=0.2``);
    ``grpo`` only (EBFT's reward is feature matching against the ground truth)."""
    scoring: ScoringConfig = dataclasses.field(default_factory=ScoringConfig)
    """Where the reward functions run: worker processes, per-call timeout, when failures stop the run."""
    replay: ReplayConfig = dataclasses.field(default_factory=ReplayConfig)
    """Replay of earlier groups with a learning signal in place of a step's groups without (off by default)."""
    reroll: RerollConfig = dataclasses.field(default_factory=RerollConfig)
    """Deferred re-roll of prompts whose completions all failed (off by default)."""
    ebft: EBFTConfig = dataclasses.field(default_factory=EBFTConfig)
    """Feature network, reward and loss knobs of the ``ebft_structured`` / ``ebft_strided`` algorithms."""
    algo: AlgoConfigT = None
    """The algorithm's own section, of the type it registers (``config_type``); None = that type's defaults. For
    ``grpo`` and ``ebft_structured`` a :class:`~jrl.losses.GRPOConfig`: objective, advantages and sampler correction
    (``num_generations`` completions per prompt) of the GRPO-family update, log-probs taken at
    ``rollout.temperature``; ``ebft_strided`` has none (its knobs are in ``ebft``)."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """Optimizer, schedule and gradient accumulation."""
    logprobs_impl: Literal["auto", "reference", "xla", "triton", "pallas_tpu", "triton_saveprobs"] = "auto"
    """Log-prob kernel of the train step: ``auto``, ``reference``, ``xla``, ``triton``, ``pallas_tpu``, or
    ``triton_saveprobs`` (GPU: faster backward for a bf16 ``[tokens, vocab]`` buffer; never picked by auto)."""
    loss_head: Literal["auto", "fused", "logprobs"] = "auto"
    """How the GRPO-family loss reaches the LM head in the train step: ``fused`` computes the logits of a chunk
    of rows once and the loss and its gradients in that pass (three head matmuls; needs a loss that sums over
    rows, so ``algo.top_entropy_quantile`` = 1); ``logprobs`` goes through the ``logprobs_impl`` kernel (which
    recomputes the logits in the backward); ``auto`` is ``fused`` on GPU/TPU where the loss allows it."""
    max_steps: int = 100
    """Training steps; each samples one rollout of ``prompts_per_batch x num_generations``
    completions and makes ``num_iterations`` passes over it (one optimizer update per ``docs_per_step``)."""
    num_iterations: int = 1
    """mu: passes over each rollout (old log-probs are computed once per rollout when a rollout makes more than
    one optimizer update)."""
    docs_per_step: int | None = None
    """Sequences per optimizer update (Fast-LLM's ``docs_per_step``): each rollout's ``prompts_per_batch x
    num_generations`` sequences are split, in whole groups and in batch order, into updates of this many, so a
    step makes ``rows / docs_per_step x num_iterations`` updates; None = the whole rollout in one update. A
    multiple of ``algo.num_generations`` and of ``optim.micro_batch_size`` that divides the step's rows."""
    output_dir: str = "runs/grpo"
    """Where metrics.jsonl, TensorBoard events, checkpoints and the reward/loss plot go."""
    compile_cache_dir: str | None = "~/.cache/jrl/jax"
    """JAX's persistent compilation cache: programs compiled by one run are read back by the next (and, on GPUs,
    shared by the devices of a data-parallel sampler); bounded, least recently used entries evicted. None leaves
    JAX's own setting (``JAX_COMPILATION_CACHE_DIR``) alone."""
    seed: int = 0
    """Seed of LoRA init and sampling (each step's sampling seed is derived from it and the step)."""
    save_every: int = 50
    """Checkpoint every this many steps (and always at the end); 0 = only at the end."""
    keep_checkpoints: int = 2
    """Most recent checkpoints kept."""
    log_every: int = 1
    """Print a metrics line every this many steps (metrics.jsonl gets every step)."""
    eval_every: int = 0
    """Evaluate on held-out prompts (the ``eval`` section) before the first step and every this many steps:
    ``eval/*`` metrics in ``eval.jsonl`` and TensorBoard, sample completions in ``eval_samples.jsonl``; 0 = never.
    A multiple of ``rollout.sync_interval`` (the engine must hold the current weights)."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Eval prompts, decodings and logged samples of ``eval_every``."""
    explore: ExploreConfig = dataclasses.field(default_factory=ExploreConfig)
    """Experience queue, published weights and explorer settings of ``mode='train'`` / ``'explore'``."""
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    """Multi-turn episodes against an environment (``env.name``; :mod:`jrl.envs`) instead of one completion per
    prompt; the episode's reward is one more reward column beside the reward functions' (which may then be none)."""
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)
    """Weights & Biases logging (off unless ``wandb.project`` is set; offline by default)."""
    step_timeout_s: float = 3600.0
    """A training step (generation, scoring and update), an evaluation or an explorer's batch still running after
    this many seconds (or after 4x the longest step so far, when that is longer) ends the process with exit status
    1, the stacks of its threads printed (:mod:`jrl.train.watchdog`): a program stuck on the devices, e.g. one GPU
    out of memory while the others wait for it in a collective, would otherwise hang the run. Continue with
    ``resume``. 0 = never."""
    resume: bool = False
    """Continue from the newest intact checkpoint in ``output_dir`` (a damaged newer one is named in a
    warning and skipped)."""
    resume_from: int | None = None
    """Continue from the checkpoint of this step in ``output_dir`` (implies ``resume``; no fallback)."""
    overwrite: bool = False
    """Start afresh in an ``output_dir`` that holds an earlier run, deleting its metrics, TensorBoard
    events, plot and checkpoints (without it, or ``resume``, such a directory is an error)."""

    def __post_init__(self):
        from jrl.train.algorithms import ALGORITHMS

        if self.compile_cache_dir is not None and not (isinstance(self.compile_cache_dir, str)
                                                       and self.compile_cache_dir.strip()):
            raise invalid("TrainConfig", "compile_cache_dir", self.compile_cache_dir,
                          "name a directory (e.g. '~/.cache/jrl/jax') or pass None to leave JAX's setting alone")
        if self.algorithm not in ALGORITHMS:
            raise invalid("TrainConfig", "algorithm", self.algorithm, f"use one of {ALGORITHMS.names()} "
                          "(ebft.mode='structured' / 'strided' is now algorithm='ebft_structured' / 'ebft_strided')")
        algorithm = ALGORITHMS.get(self.algorithm)
        self._check_algorithm_sections(algorithm)
        reject_unused(self, algorithm.ignores, f"algorithm={self.algorithm!r}")
        from jrl.rollout import ROLLOUT_ENGINES

        engine = ROLLOUT_ENGINES.get(self.rollout.backend)
        reject_unused(self, engine.ignores, f"rollout.backend={self.rollout.backend!r}")
        if self.rollout.kv.layout == "dense":  # every other rollout.kv knob is the paged layout's
            reject_unused(self, tuple(f"rollout.kv.{f.name}" for f in dataclasses.fields(self.rollout.kv)
                                      if f.name != "layout"),
                          "rollout.kv.layout='dense'", "set rollout.kv.layout='paged'")
        missing = sorted(algorithm.engine_needs - engine.capabilities)
        if missing:
            raise invalid("TrainConfig", "rollout.backend", self.rollout.backend,
                          f"use a backend that has {missing} (algorithm={self.algorithm!r} needs it)")
        self._check_env()
        self._check_partial(algorithm)
        if "rewards" not in algorithm.ignores and not self.rewards and self.env.name is None:
            raise invalid("TrainConfig", "rewards", self.rewards, "give at least one RewardSpec")
        rows = self.data.prompts_per_batch * _value_at(self, algorithm.samples_field)
        mb = self.optim.micro_batch_size
        if mb is not None and rows % mb:
            raise invalid("TrainConfig", "optim.micro_batch_size", mb,
                          f"it must divide the {rows} rows of a step (data.prompts_per_batch x "
                          f"{algorithm.samples_field})")
        docs = self.docs_per_step
        check_int(self, "docs_per_step", lo=1, optional=True, fix="use a positive int, or None for whole rollouts")
        if docs is not None and (rows % docs or docs % _value_at(self, algorithm.samples_field) or (mb and docs % mb)):
            raise invalid("TrainConfig", "docs_per_step", docs,
                          f"use a divisor of the {rows} rows of a step that is a multiple of "
                          f"{algorithm.samples_field}={_value_at(self, algorithm.samples_field)} (whole groups) and of "
                          f"optim.micro_batch_size={mb}")
        stream = self.scoring.stream_groups
        if stream and self.data.prompts_per_batch % stream:
            raise invalid("TrainConfig", "scoring.stream_groups", stream,
                          f"use a divisor of data.prompts_per_batch={self.data.prompts_per_batch}")
        check_int(self, "eval_every", lo=0, fix="use an int >= 0 (0 = no evaluation)")
        self._check_mode(algorithm)
        if self.eval_every == 0:
            reject_unused(self, ("eval",), "eval_every=0")
        elif self.eval_every % self.rollout.sync_interval:
            raise invalid("TrainConfig", "eval_every", self.eval_every,
                          f"use a multiple of rollout.sync_interval={self.rollout.sync_interval}, so the engine holds "
                          "the current weights at every evaluation")
        for name in ("max_steps", "num_iterations", "log_every", "keep_checkpoints"):
            check_int(self, name, lo=1)
        check_choice(self, "loss_head", ("auto", "fused", "logprobs"))
        check_int(self, "save_every", lo=0, fix="use an int >= 0 (0 = only at the end)")
        check_real(self, "step_timeout_s", ge=0, fix="use a number of seconds >= 0 (0 = never)")
        check_int(self, "seed", lo=-2**63, fix="use an int")
        check_int(self, "resume_from", lo=1, optional=True,
                  fix="use the step of a checkpoint in output_dir/checkpoints, or None")
        algorithm.check_config(self)

    def _check_algorithm_sections(self, algorithm) -> None:
        """``algo`` of the algorithm's ``config_type`` (None becomes that type's defaults; unset when it has none),
        and the shared algorithm sections it does not read left unset."""
        own, user = algorithm.config_type, f"algorithm={self.algorithm!r}"
        if own is None:
            reject_unused(self, ("algo",), user)
        elif self.algo is None:
            object.__setattr__(self, "algo", own())  # frozen: the one normalisation a constructed config gets
        elif not isinstance(self.algo, own):
            raise invalid("TrainConfig", "algo", self.algo, f"{user} reads an algo section of type {own.__name__}; "
                          f"pass algo={own.__name__}(...) or None (its defaults)")
        reject_unused(self, tuple(s for s in ALGORITHM_SECTIONS if s not in algorithm.sections), user)

    def _check_partial(self, algorithm) -> None:
        """``rollout.partial``: an algorithm that trains on it, the paged sampler, a staleness bound a carried row
        can live with when generation runs ahead, and none of the parts that hand a step's prompts on."""
        if not self.rollout.partial:
            if self.rollout.partial_kv != "keep":
                raise invalid("TrainConfig", "rollout.partial_kv", self.rollout.partial_kv, "it says what partial "
                              "rollouts' carried rows continue from; set rollout.partial=True or leave it at 'keep'")
            return
        if "partial" not in algorithm.capabilities:
            raise invalid("TrainConfig", "rollout.partial", True, f"algorithm={self.algorithm!r} does not train on "
                          "partial rollouts; use algorithm='grpo' or rollout.partial=False")
        if self.rollout.kv.layout != "paged":
            raise invalid("TrainConfig", "rollout.partial", True, "partial rollouts continue rows on the paged "
                          "sampler; set rollout.kv.layout='paged'")
        if self.rollout.run_ahead >= self.rollout.max_staleness:
            raise invalid("TrainConfig", "rollout.max_staleness", self.rollout.max_staleness,
                          f"with rollout.partial=True a row carried to the next step is at least "
                          f"{self.rollout.run_ahead + 1} version(s) old there (generation runs "
                          f"{self.rollout.run_ahead} step(s) ahead with prefetch_depth={self.rollout.prefetch_depth}), "
                          f"so every carried row would start again; use max_staleness >= "
                          f"{self.rollout.run_ahead + 1} (e.g. 4 for completions longer than a step's generation)")
        for field, value, why in (("mode", self.mode != "both", "the carried rows live in the trainer's sampler"),
                                  ("env.name", self.env.name is not None, "episodes are not continued"),
                                  ("scoring.stream_groups", self.scoring.stream_groups, "groups finish out of order"),
                                  ("replay.buffer_size", self.replay.buffer_size, "not built yet"),
                                  ("reroll.start_fraction", self.reroll.start_fraction < 1.0, "not built yet")):
            if value:
                raise invalid("TrainConfig", field, _value_at(self, field), f"leave it at its default with "
                              f"rollout.partial=True ({why})")

    def _check_env(self) -> None:
        """``env``: a registered environment, a sampler that can play it, an episode budget the loss takes."""
        if self.env.name is None:
            reject_unused(self, ("env",), "env.name=None (single-turn rollouts)", "set env.name to play episodes")
            return
        from jrl.envs import ENVIRONMENTS

        if self.env.name not in ENVIRONMENTS:
            raise invalid("TrainConfig", "env.name", self.env.name, f"use one of {ENVIRONMENTS.names()} or None")
        if self.env.reuse_kv_cache and self.rollout.backend == "jax" and self.rollout.kv.layout == "paged":
            raise invalid("TrainConfig", "env.reuse_kv_cache", True, "the paged KV cache keeps no sessions across "
                          "turns; set env.reuse_kv_cache=False (each turn prefills the conversation) or "
                          "rollout.kv.layout='dense'")

    def _check_mode(self, algorithm) -> None:
        check_choice(self, "mode", ("both", "train", "explore"))
        if self.mode == "both":
            reject_unused(self, ("explore",), "mode='both'", "set mode='train' (trainer) or 'explore' (explorer)")
            return
        if "explorer" not in algorithm.capabilities:
            raise invalid("TrainConfig", "mode", self.mode, f"algorithm={self.algorithm!r} runs in one process only; "
                          "use mode='both'")
        split = f"mode={self.mode!r} (trainer and explorers in separate processes)"
        if self.rollout.prefetch_depth:
            raise invalid("TrainConfig", "rollout.prefetch_depth", self.rollout.prefetch_depth,
                          f"{split} already overlaps generation and training; use 0")
        if self.rollout.devices:
            raise invalid("TrainConfig", "rollout.devices", self.rollout.devices,
                          f"with {split} each process has its own devices; use 0")
        if self.eval_every:
            raise invalid("TrainConfig", "eval_every", self.eval_every,
                          f"{split}: the trainer has no sampler to evaluate with; use 0 and evaluate a checkpoint")
        reject_unused(self, ("reroll",), f"{split} (explorers choose the prompts)", "use mode='both'")

    @property
    def resuming(self) -> bool:
        """Whether the run continues from a checkpoint (``resume`` or ``resume_from``)."""
        return self.resume or self.resume_from is not None

    @property
    def samples_per_prompt(self) -> int:
        """Completions per prompt: the value of the algorithm's ``samples_field`` (a group's size)."""
        from jrl.train.algorithms import ALGORITHMS

        return int(_value_at(self, ALGORITHMS.get(self.algorithm).samples_field))

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates one step makes: ``num_iterations`` passes of ``rows / docs_per_step`` updates."""
        rows = self.data.prompts_per_batch * self.samples_per_prompt
        return self.num_iterations * (rows // self.docs_per_step if self.docs_per_step else 1)

    @property
    def reward_weights(self) -> tuple[float, ...]:
        """Weights of the reward columns: one per reward spec, or 1.0 for the single reward of an algorithm that
        reads no reward functions (it ignores ``rewards``: EBFT's feature-matching reward)."""
        from jrl.train.algorithms import ALGORITHMS

        if "rewards" in ALGORITHMS.get(self.algorithm).ignores:
            return (1.0,)
        return tuple(float(r.weight) for r in self.rewards) + ((self.env.reward_weight,) if self.env.name else ())


def _default_at(path: str):
    """The default value of the dotted ``path`` of :class:`TrainConfig` (e.g. ``rollout.vllm``)."""
    obj: object = TrainConfig
    for part in path.split("."):
        f = {x.name: x for x in dataclasses.fields(obj)}[part]
        obj = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return obj


def _value_at(cfg: TrainConfig, path: str):
    """The value of the dotted ``path`` of ``cfg``."""
    value: object = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return value


def reject_unused(cfg: TrainConfig, paths: tuple[str, ...], user: str,
                  instead: str = "choose an algorithm / backend that reads it") -> None:
    """An error for the first of ``paths`` (fields ``user`` does not read) that is set to a non-default value."""
    for path in paths:
        value, default = _value_at(cfg, path), _default_at(path)
        if value != default:
            raise invalid("TrainConfig", path, value, f"{user} does not use it; leave it at its default "
                          f"({default!r}) or {instead}")


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
