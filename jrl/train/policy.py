"""Load the policy a :class:`~jrl.train.TrainConfig` names: tokenizer, device meshes, model (+ LoRA)."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from jrl.models import from_pretrained
from jrl.models.lora import apply_lora
from jrl.sharding import make_mesh, shard_model, split_devices

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


def load_policy(cfg) -> Policy:
    """Tokenizer, mesh and model of ``cfg`` (``TrainConfig``), with a clear error for a bad model path."""
    from transformers import AutoTokenizer

    learner_devices, rollout_devices = split_devices(cfg.rollout.devices)
    cfg.mesh.axis_sizes(len(learner_devices))  # a clear error for a mesh that does not fit the devices
    if rollout_devices:
        rollout_mesh = make_mesh(cfg.rollout.mesh, rollout_devices)
        logger.info("rollout mesh: %d device(s) %s; learner: the other %d", len(rollout_devices),
                    dict(rollout_mesh.shape), len(learner_devices))
    model_dir = Path(cfg.model.path)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"ModelSpec.path={cfg.model.path!r} is not a Hugging Face model directory (no config.json); "
            "point --model.path at one (the default tiny model is made by scripts/make_default_model.py)")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    mesh = make_mesh(cfg.mesh, learner_devices) if len(learner_devices) > 1 else None
    rules = cfg.mesh.logical_rules()
    model = from_pretrained(model_dir, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype, mesh=mesh,
                            rules=rules, attention=cfg.model.attention, remat=cfg.model.remat,
                            scan_layers=cfg.model.scan_layers, fsdp_prefetch=cfg.model.fsdp_prefetch,
                            grad_reduce_dtype=cfg.model.grad_reduce_dtype)
    if cfg.lora is not None:
        apply_lora(model, cfg.lora, seed=cfg.seed)
        if mesh is not None:
            shard_model(model, mesh, rules)
    if not rollout_devices:  # the sampler's layout of the learner's devices (None on one device)
        rollout_mesh = None if mesh is None else make_mesh(cfg.rollout.mesh, learner_devices)
    rollout_rules = cfg.rollout.mesh.logical_rules() if rollout_mesh is not None else None
    return Policy(tokenizer=tokenizer, pad_id=pad_id, mesh=mesh, rules=rules, model=model, rollout_mesh=rollout_mesh,
                  rollout_rules=rollout_rules)
