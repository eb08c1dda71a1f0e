"""Every field ``scripts/train.py --help`` documents either reaches the code path it documents or is
rejected: the fields of ``TrainConfig`` (and its sections) are walked; each must appear in ``--help``, and
is either read by real runs of the three algorithms (a 2-step run each, LoRA on, every section exercised),
by the vLLM backend's own code, by a trainer fed by an explorer (``mode='train'`` / ``'explore'``) and by a
multi-turn run (``env``) and by a run on the paged sampler (``rollout.kv``), or —
where the chosen algorithm / backend ignores it — refused at config construction with an error naming it."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import subprocess
import sys
import threading
import types
import typing
from pathlib import Path

import pytest
from train_testlib import write_reward_file

from jrl.data.pipeline import DataConfig
from jrl.data.tasks.arithmetic import ArithmeticConfig
from jrl.envs import EnvConfig
from jrl.losses import GRPOConfig
from jrl.models.lora import LoraConfig
from jrl.rollout.config import RolloutConfig
from jrl.rollout.kv_config import KVCacheConfig
from jrl.rollout.vllm_config import VLLMConfig
from jrl.train.algorithms import ALGORITHMS
from jrl.train.config import ALGORITHM_SECTIONS, ModelSpec, OptimConfig, ScoringConfig, TrainConfig
from jrl.train.ebft_config import EBFTConfig
from jrl.train.evaluation import EvalConfig
from jrl.train.observability import WandbConfig
from jrl.sources.replay import ReplayConfig
from jrl.sources.reroll import RerollConfig
from jrl.rewards.functions import RewardSpec

ROOT = Path(__file__).resolve().parents[2]

#: Reads from these functions (and from these files) check or copy a config, they do not use it.
NOT_A_USE = {"__post_init__", "__eq__", "__hash__", "__repr__", "reject_unused", "_default_at"}
NOT_A_USE_FILES = ("dataclasses.py", "validation.py")


def _sections(cls) -> dict[str, type]:
    """Dotted path → dataclass type of every section under ``cls`` (optional sections included)."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        args = typing.get_args(t) if isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union else (t,)
        for a in args:
            if dataclasses.is_dataclass(a) and a is not RewardSpec:
                out[f.name] = a
                out.update({f"{f.name}.{k}": v for k, v in _sections(a).items()})
    return out


def leaf_fields() -> dict[str, tuple[type, str]]:
    """Dotted path → (owning dataclass, field name) of every leaf knob of ``TrainConfig``."""
    owners = {"": TrainConfig, **_sections(TrainConfig)}
    leaves = {}
    for prefix, cls in owners.items():
        for f in dataclasses.fields(cls):
            path = f"{prefix}.{f.name}" if prefix else f.name
            if path not in owners:
                leaves[path] = (cls, f.name)
    return leaves


@contextlib.contextmanager
def traced_reads():
    """Record ``(class, field)`` of every read of a config field made by the code under test."""
    classes = {cls for cls, _ in leaf_fields().values()}
    seen: set[tuple[type, str]] = set()
    originals = {}
    for cls in classes:
        names = {f.name for f in dataclasses.fields(cls)}
        original = cls.__getattribute__

        def tracing(self, name, _cls=cls, _names=names, _original=original):
            if name in _names:
                caller = sys._getframe(1).f_code
                if caller.co_name not in NOT_A_USE and not caller.co_filename.endswith(NOT_A_USE_FILES):
                    seen.add((_cls, name))
            return _original(self, name)

        originals[cls] = original
        cls.__getattribute__ = tracing
    try:
        yield seen
    finally:
        for cls, original in originals.items():
            cls.__getattribute__ = original


def _runs(model_dir: Path, tmp: Path) -> list[TrainConfig]:
    """Short real runs that together exercise every section: GRPO with LoRA, a KL term, two updates per
    rollout, prefetching, eval, W&B, replay, re-roll and streaming scoring; EBFT structured with its CE term;
    EBFT strided."""
    reward = write_reward_file(tmp, "walk_reward")
    data = DataConfig(prompts_per_batch=2, max_prompt_length=64, seed=1, arithmetic=ArithmeticConfig(num_examples=16))
    base = TrainConfig(model=ModelSpec(path=str(model_dir)), lora=LoraConfig(rank=2, alpha=4.0), data=data,
                       optim=OptimConfig(learning_rate=1e-3, micro_batch_size=4, warmup_steps=1), max_steps=2,
                       save_every=1, seed=3)
    grpo = dataclasses.replace(
        base, rewards=(RewardSpec(path=f"{reward}:low_ids"),), output_dir=str(tmp / "grpo"), num_iterations=2,
        algo=GRPOConfig(num_generations=2, beta=0.01, off_policy_mask_threshold=0.5, top_entropy_quantile=0.5),
        rollout=RolloutConfig(max_new_tokens=6, prefetch_depth=1, stop_token_ids=(10,)), eval_every=2,
        eval=EvalConfig(holdout=2, batch_size=1, decodings=("greedy", "sampled"), num_samples=1),
        wandb=WandbConfig(project="jrl-help-walk"), replay=ReplayConfig(buffer_size=2),
        reroll=RerollConfig(start_fraction=0.5), scoring=ScoringConfig(stream_groups=1))
    structured = dataclasses.replace(
        base, algorithm="ebft_structured", output_dir=str(tmp / "structured"), algo=GRPOConfig(num_generations=2),
        ebft=EBFTConfig(feature_layers=(0.5, 1.0), ce_coef=0.1, adaptive_min_tokens=4, embed_method="concat"),
        rollout=RolloutConfig(max_new_tokens=6))
    strided = dataclasses.replace(
        base, algorithm="ebft_strided", output_dir=str(tmp / "strided"), algo=None,
        ebft=EBFTConfig(context_length=4, stride=4, generate_max_len=2, n_samples_per_prompt=2, ce_coef=0.1,
                        feature_layers=(0.5, 1.0)), rollout=RolloutConfig(temperature=0.9, top_p=0.9, top_k=5))
    return [grpo, structured, strided]


def _vllm_backend_reads(cfg: TrainConfig, tmp: Path) -> None:
    """The vLLM backend's code on the config (no server listens: every step that talks to one fails after
    reading its settings): the launch command, the engine's start, both weight transports' writes."""
    from jrl.models import from_pretrained
    from jrl.models.lora import apply_lora
    from jrl.rollout.vllm_engine import make_vllm_engine
    from jrl.rollout.vllm_http import VLLMClient, VLLMError
    from jrl.rollout.weight_sync import FilesystemTransport, LoRAAdapterTransport

    spec = importlib.util.spec_from_file_location("serve_vllm", ROOT / "scripts" / "serve_vllm.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    for device in ("gpu", "cpu"):
        serve.command_for(dataclasses.replace(cfg, rollout=dataclasses.replace(
            cfg.rollout, vllm=dataclasses.replace(cfg.rollout.vllm, device=device))))
    model = apply_lora(from_pretrained(cfg.model.path, dtype="float32"), cfg.lora)
    with pytest.raises(VLLMError):
        make_vllm_engine(model, pad_id=0, mesh=None, rules=None, rollout=cfg.rollout, output_dir=tmp)
    v = cfg.rollout.vllm
    client = VLLMClient(v.base_urls[0], max_retries=0, restart_timeout=0.1)
    for transport in (LoRAAdapterTransport, FilesystemTransport):
        with pytest.raises(VLLMError):
            transport(client, v, sync_dir=tmp / transport.__name__, base_name="m", tag="t", keep_versions=1).send(model, 1)
    served = cfg.rollout.vllm.served_model_name  # read by the engine once the server answers /v1/models
    assert served is None


def _split_run_reads(cfg: TrainConfig, tmp: Path) -> None:
    """A ``mode='train'`` run of ``cfg`` fed by one explorer (``mode='explore'``) in a thread of this process, every
    ``explore`` field set; its trainer uses the ``sapo`` objective."""
    from jrl.train.exploration import explore
    from jrl.explore.config import ExploreConfig
    from jrl.train.trainer import train

    section = ExploreConfig(queue=f"sqlite:///{tmp / 'split' / 'q.db'}", weights_dir=str(tmp / "split" / "weights"),
                            name="walker", max_queued=3, max_batches=50, timeout_s=120.0, keep_versions=2)
    trainer = dataclasses.replace(cfg, mode="train", explore=section, output_dir=str(tmp / "split"), rollout=
                                  RolloutConfig(max_new_tokens=6), eval_every=0, eval=EvalConfig(),
                                  reroll=RerollConfig(), wandb=WandbConfig(),
                                  algo=dataclasses.replace(cfg.algo, objective="sapo", sapo_temperature_pos=1.5,
                                                           sapo_temperature_neg=2.0))
    errors = []

    def explorer():
        try:
            explore(dataclasses.replace(trainer, mode="explore"))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test's thread
            errors.append(e)

    thread = threading.Thread(target=explorer)
    thread.start()
    try:
        train(trainer, progress=False)
    finally:
        thread.join(timeout=120)
    assert not thread.is_alive() and not errors, errors


#: A valid non-default value of the string fields an algorithm may ignore.
OTHER_STRINGS = {"backend": "vllm", "sync": "filesystem", "loss_head": "fused"}
#: A set value for fields whose default is None.
OTHER_NONES = {"docs_per_step": 2}


def _non_default(value, name: str = ""):
    if value is None:
        return OTHER_NONES.get(name)
    if isinstance(value, str):
        return OTHER_STRINGS.get(name)
    if isinstance(value, tuple) and all(isinstance(x, int) for x in value):
        return value + (1,)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 0.5 + 0.25
    return None


def _mutate(cfg: TrainConfig, path: str) -> TrainConfig | None:
    """``cfg`` with a non-default value at ``path`` (a leaf, or the first mutable leaf of a section)."""
    head, _, rest = path.partition(".")
    section = getattr(cfg, head)
    if not rest:
        if dataclasses.is_dataclass(section):
            for f in dataclasses.fields(section):
                changed = _mutate(section, f.name) if dataclasses.is_dataclass(getattr(section, f.name)) else None
                value = _non_default(getattr(section, f.name), f.name)
                if value is not None:
                    return dataclasses.replace(cfg, **{head: dataclasses.replace(section, **{f.name: value})})
                if changed is not None:
                    return dataclasses.replace(cfg, **{head: changed})
            return None
        if head == "rewards":
            return dataclasses.replace(cfg, rewards=(RewardSpec(path="jrl.data.tasks.arithmetic:exact_match"),))
        value = _non_default(section, head)
        return None if value is None else dataclasses.replace(cfg, **{head: value})
    changed = _mutate(section, rest)
    return None if changed is None else dataclasses.replace(cfg, **{head: changed})


def test_every_help_field_has_an_effect_or_is_rejected(tiny_model_dir, tmp_path):
    from jrl.train.trainer import train

    leaves = leaf_fields()
    help_text = "".join(  # the top level, and the LoRA subcommand's fields
        subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args, "--help"], capture_output=True,
                       text=True, timeout=120, env={"COLUMNS": "400", "PATH": ""}, cwd=ROOT).stdout
        for args in ([], ["lora:lora-config"]))
    undocumented = [p for p in leaves if "--" + p.replace("_", "-") not in help_text]
    assert not undocumented, f"fields missing from --help: {undocumented}"

    runs = _runs(tiny_model_dir, tmp_path)
    with traced_reads() as seen:
        for cfg in runs:
            train(cfg, progress=False)
        _vllm_backend_reads(dataclasses.replace(runs[0], rollout=RolloutConfig(
            backend="vllm", vllm=VLLMConfig(base_urls=("http://127.0.0.1:9",), startup_timeout=0.2, max_retries=0))),
            tmp_path)
        _split_run_reads(runs[0], tmp_path)
        train(dataclasses.replace(runs[0], max_steps=1, output_dir=str(tmp_path / "vespo"), eval_every=0,
                                  eval=EvalConfig(), wandb=WandbConfig(),
                                  algo=GRPOConfig(num_generations=2, objective="vespo", vespo_k_pos=1.5,
                                                  vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5)),
              progress=False)
        train(dataclasses.replace(runs[0], max_steps=1, output_dir=str(tmp_path / "multiturn"), eval_every=0,
                                  eval=EvalConfig(), wandb=WandbConfig(), replay=ReplayConfig(), scoring=ScoringConfig(),
                                  env=EnvConfig(name="tools", tools=("calculator",), max_turns=2, max_episode_tokens=12,
                                                step_timeout_s=30.0, reward_weight=0.5, observation_role="user")),
              progress=False)
        train(dataclasses.replace(runs[0], max_steps=1, output_dir=str(tmp_path / "paged"), eval_every=0,
                                  eval=EvalConfig(), wandb=WandbConfig(), rollout=dataclasses.replace(
                                      runs[0].rollout, kv=KVCacheConfig(layout="paged", page_size=8, slots=2,
                                                                        pages=64)),
                                  optim=dataclasses.replace(runs[0].optim, packing=True, share_prompts=True)),
              progress=False)
    unread = sorted(p for p, owner in leaves.items() if owner not in seen)
    # data.split and data.hub_config select a split / configuration of a saved DatasetDict directory or a hub
    # dataset (tests/data reads them); for these runs' built-in source they are refused.
    assert unread == ["data.hub_config", "data.split"], f"documented fields no run reads: {unread}"
    with pytest.raises(ValueError, match=r"DataConfig\.split='test'.*has none"):
        DataConfig(split="test")
    with pytest.raises(ValueError, match=r"DataConfig\.hub_config='main'.*is not one"):
        DataConfig(hub_config="main")

    # Each algorithm and backend refuses a set value in a field it ignores or an algorithm section it does not read
    # (an algo section where it has none), naming the field.
    base = {cfg.algorithm: cfg for cfg in runs}
    built_in = [n for n in ALGORITHMS.names() if ALGORITHMS.get(n).__module__.startswith("jrl.")]  # not tests' toys
    for name, cls in ((n, ALGORITHMS.get(n)) for n in built_in):
        unread = tuple(s for s in ALGORITHM_SECTIONS if s not in cls.sections)
        for path in cls.ignores + unread:
            cfg = dataclasses.replace(base[name], rollout=RolloutConfig(), algo=None, rewards=base["grpo"].rewards
                                      if name == "grpo" else TrainConfig().rewards, ebft=EBFTConfig()
                                      if name == "grpo" else base[name].ebft)
            with pytest.raises(ValueError, match=rf"TrainConfig\.{path}.*algorithm='{name}' does not use it"):
                _mutate(cfg, path)
    with pytest.raises(ValueError, match=r"TrainConfig\.algo=GRPOConfig.*algorithm='ebft_strided' does not use it"):
        dataclasses.replace(base["ebft_strided"], algo=GRPOConfig())
    with pytest.raises(ValueError, match=r"TrainConfig\.rollout\.sync=.*rollout\.backend='jax' does not use it"):
        dataclasses.replace(runs[0], rollout=RolloutConfig(sync="filesystem"))
    with pytest.raises(ValueError, match=r"TrainConfig\.rollout\.vllm=.*rollout\.backend='jax' does not use it"):
        dataclasses.replace(runs[0], rollout=RolloutConfig(vllm=VLLMConfig(max_retries=1)))
    with pytest.raises(ValueError, match=r"TrainConfig\.rollout\.devices=2.*rollout\.backend='vllm' does not use it"):
        dataclasses.replace(runs[0], rollout=RolloutConfig(backend="vllm", devices=2))
    for paged_only in (dict(slots=4), dict(slot_buckets=2)):
        field, value = next(iter(paged_only.items()))
        with pytest.raises(ValueError, match=rf"rollout\.kv\.{field}={value}.*layout='dense' does not use"):
            dataclasses.replace(runs[0], rollout=RolloutConfig(kv=KVCacheConfig(**paged_only)))
    with pytest.raises(ValueError, match=r"TrainConfig\.rollout\.kv=.*rollout\.backend='vllm' does not use it"):
        dataclasses.replace(runs[0], rollout=RolloutConfig(backend="vllm", kv=KVCacheConfig(layout="paged")))
