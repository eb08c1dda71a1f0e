"""Load the policy a :class:`~jrl.train.TrainConfig` names: tokenizer, device meshes, model (+ LoRA)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from jrl.models import from_pretrained, read_config
from jrl.models.lora import apply_lora
from jrl.rollout.config import sampler_mesh
from jrl.sharding import MeshConfig, learner_mesh, make_mesh, memory_limit, shard_model, split_devices
from jrl.train.fsdp_gathers import layers_per_gather, training_state_bytes

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Policy:
    """What a trainer starts from."""

    tokenizer: object
    """The Hugging Face tokenizer of the model directory."""
    pad_id: int
    """The tokenizer's pad id, else its EOS id."""
    mesh: object
    """The learner's device mesh (None on one device: no placement or sharding constraints at all)."""
    rules: dict
    """Logical-axis rules of ``cfg.mesh``."""
    model: object
    """The :class:`~jrl.models.Transformer`, with LoRA adapters when ``cfg.lora`` is set."""
    rollout_mesh: object = None
    """The mesh the sampler runs on (``cfg.rollout.mesh``): of its own devices with ``cfg.rollout.devices > 0``, else
    of the learner's (None on one device)."""
    rollout_rules: dict | None = None
    """Logical-axis rules of ``rollout_mesh``."""


def _memory(devices) -> int | None:
    """:func:`jrl.sharding.memory_limit` of this process's first device of ``devices`` (every process sees devices
    of one kind, so all make the same layout)."""
    local = [d for d in devices if d.process_index == jax.process_index()]
    return memory_limit(local[0]) if local else None


def _learner_layout(cfg, config, devices) -> MeshConfig:
    """``cfg.mesh``, or for a mixture-of-experts model (``config``, its :class:`ModelConfig`) left on the default
    sizes the expert-parallel layout of :func:`jrl.sharding.learner_mesh` where its training state fits."""
    if not config.is_moe:
        return cfg.mesh
    experts = config.routed_expert_params()
    local = [d for d in devices if d.process_index == jax.process_index()]
    return learner_mesh(cfg.mesh, num_experts=config.num_experts, devices=len(devices), local_devices=len(local),
                        dense_state_bytes=_state_bytes(cfg, config.num_params() - experts),
                        expert_state_bytes=_state_bytes(cfg, experts), device_bytes=_memory(devices))


def _state_bytes(cfg, params: int) -> int:
    """:func:`training_state_bytes` of ``params`` parameters under ``cfg`` (``TrainConfig``)."""
    return training_state_bytes(params, jnp.dtype(cfg.model.param_dtype or cfg.model.dtype).itemsize,
                                full=cfg.lora is None)


def load_policy(cfg) -> Policy:
    """Tokenizer, mesh and model of ``cfg`` (``TrainConfig``), with a clear error for a bad model path."""
    from transformers import AutoTokenizer

    learner_devices, rollout_devices = split_devices(cfg.rollout.devices)
    sampler_devices = rollout_devices or (learner_devices if len(learner_devices) > 1 else [])
    cfg.mesh.axis_sizes(len(learner_devices))  # clear errors for meshes that do not fit their devices
    if sampler_devices:
        cfg.rollout.mesh.axis_sizes(len(sampler_devices))
    model_dir = Path(cfg.model.path)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"ModelSpec.path={cfg.model.path!r} is not a Hugging Face model directory (no config.json); "
            "point --model.path at one (the default tiny model is made by scripts/make_default_model.py)")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = read_config(cfg.model.path)
    params = config.num_params()
    weight_bytes = params * jnp.dtype(cfg.model.dtype).itemsize  # the whole weights, compute dtype
    layout = _learner_layout(cfg, config, learner_devices) if len(learner_devices) > 1 else cfg.mesh
    if layout != cfg.mesh:
        logger.info("learner: %d devices laid out %s: expert parallel, the default for a mixture-of-experts model "
                    "(give --mesh sizes to choose another)", len(learner_devices),
                    {n: s for n, s in layout.axis_sizes(len(learner_devices)).items() if s > 1})
    mesh = make_mesh(layout, learner_devices) if len(learner_devices) > 1 else None
    rules = layout.logical_rules()
    model = from_pretrained(model_dir, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype, mesh=mesh,
                            rules=rules, attention=cfg.model.attention, remat=cfg.model.remat,
                            scan_layers=cfg.model.scan_layers, fsdp_prefetch=cfg.model.fsdp_prefetch,
                            grad_reduce_dtype=cfg.model.grad_reduce_dtype,
                            expert_capacity=cfg.model.expert_capacity, expert_chunks=cfg.model.expert_chunks,
                            fsdp_layers_per_gather=layers_per_gather(
                                cfg.model.fsdp_layers_per_gather, devices=len(learner_devices),
                                platform=learner_devices[0].platform, weight_bytes=weight_bytes,
                                state_bytes=_state_bytes(cfg, params),
                                device_bytes=_memory(learner_devices)))
    if cfg.lora is not None:
        apply_lora(model, cfg.lora, seed=cfg.seed)
        if mesh is not None:
            shard_model(model, mesh, rules)
    rollout_mesh = rollout_rules = None  # on one device: the model's own
    if sampler_devices:
        layout = sampler_mesh(cfg.rollout.mesh, weight_bytes=weight_bytes, device_bytes=_memory(sampler_devices),
                              devices=len(sampler_devices))
        rollout_mesh, rollout_rules = make_mesh(layout, sampler_devices), layout.logical_rules()
        if rollout_devices or layout != cfg.rollout.mesh:
            logger.info("sampler: %d device(s) laid out %s%s", len(sampler_devices), dict(rollout_mesh.shape),
                        f"; learner: the other {len(learner_devices)}" if rollout_devices else "")
    return Policy(tokenizer=tokenizer, pad_id=pad_id, mesh=mesh, rules=rules, model=model, rollout_mesh=rollout_mesh,
                  rollout_rules=rollout_rules)
