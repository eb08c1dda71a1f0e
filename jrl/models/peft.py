"""Export a model's LoRA adapters as a PEFT adapter directory (the PEFT adapter format: adapter_config.json + adapter_model.safetensors).

The directory holds ``adapter_config.json`` and ``adapter_model.safetensors`` exactly as ``peft``'s
``PeftModel.save_pretrained`` writes them for a transformers model (checked against peft 0.21): one pair
of tensors per adapted module, named by the HF module path with the adapter name stripped,

- ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``: ``[r, in]``
- ``base_model.model.model.layers.{i}.self_attn.q_proj.lora_B.weight``: ``[out, r]``

so ``peft.PeftModel.from_pretrained(hf_model, out_dir)`` and vLLM's ``/v1/load_lora_adapter`` both
load it. jrl's ``lora_a`` is ``in_shape + (r,)`` and ``lora_b`` is ``(r,) + out_shape`` (heads split; one
pair per layer of stacked layers),
so ``lora_A = A.reshape(in, r).T`` and ``lora_B = B.reshape(r, out).T``, where ``in`` / ``out`` flatten
the head dims in the order the HF weight mapping (:mod:`jrl.models.hf_mapping`) uses.

Only LoRA on the ``Linear`` projections is exported; LoRA on stacked MoE expert parameters (PEFT's
``target_parameters``) is refused with an error.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.models import hf_mapping
from jrl.models.checkpoint import atomic_replace, export_entries, save_dtype_name, write_safetensors
from jrl.models.lora import LoraConfig, LoRALinear, LoRAParam, lora_layers
from jrl.models.transformer import Transformer, named_params
from jrl.sharding.placement import to_host

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Prefix PEFT puts in front of the HF module path (``PeftModelForCausalLM.base_model.model``).
PEFT_PREFIX = "base_model.model."


def _hf_modules(model: Transformer, layers: dict[str, LoRALinear]) -> list[tuple[str, LoRALinear, int | None]]:
    """(HF module path, adapted layer, index on its stacked-layer axis or None) of every adapted HF module:
    ``layers.0.attn.q_proj`` (or layer 0 of the stacked ``layers.attn.q_proj``) is
    ``model.layers.0.self_attn.q_proj``."""
    by_unit = {e.unit: e for e in export_entries(model.config, named_params(model))}
    out = []
    for path, layer in layers.items():
        for index in range(layer.stack[0]) if layer.stack else (None,):
            entry = by_unit.get((f"{path}.kernel", index))
            if (entry is None or entry.expert is not None or entry.rule.chunk is not None
                    or not isinstance(entry.rule.transform, hf_mapping.Linear)
                    or not entry.hf_key.endswith(".weight")):
                raise ValueError(f"save_peft_adapter: the LoRA layer {path} has no HF Linear module in the "
                                 f"{model.config.model_type} weight mapping, so it cannot be named in a PEFT adapter")
            out.append((entry.hf_key[: -len(".weight")], layer, index))
    return out


def _stray_lora_params(model: nnx.Module, layers: dict[str, LoRALinear]) -> list[str]:
    """Paths of LoRA variables that do not belong to an adapted Linear (e.g. LoRA on MoE experts)."""
    owned = {f"{p}.{name}" for p in layers for name in ("lora_a", "lora_b")}
    return sorted(path for path in (".".join(str(p) for p in k) for k, node in nnx.iter_graph(model)
                                    if isinstance(node, LoRAParam)) if path not in owned)


def _adapter_hparams(layers: dict[str, LoRALinear], config: LoraConfig | None) -> tuple[int, float, bool]:
    """(r, lora_alpha, use_rslora) shared by every layer; ``config`` (when given) must agree with the layers."""
    found = {(layer.lora_a[...].shape[-1], layer.scale) for layer in layers.values()}
    if len(found) != 1:
        raise ValueError(f"save_peft_adapter: the LoRA layers have different (rank, scale) pairs {sorted(found)}; "
                         f"a PEFT adapter needs one rank and one alpha for all modules")
    ((rank, scale),) = found
    if config is None:  # alpha / r == scale reproduces the update exactly without knowing about rsLoRA
        return rank, scale * rank, False
    if config.rank != rank or not math.isclose(config.scale, scale, rel_tol=1e-6):
        raise ValueError(f"save_peft_adapter: config (rank={config.rank}, scale={config.scale}) does not match the "
                         f"model's adapters (rank={rank}, scale={scale}); pass the LoraConfig the adapters were "
                         f"made with, or config=None")
    return rank, config.alpha, config.use_rslora


def _json_number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def peft_adapter_config(*, rank: int, alpha: float, use_rslora: bool, target_modules: list[str],
                        base_model_name_or_path: str | None) -> dict:
    """The ``adapter_config.json`` content, with the fields and defaults peft's ``LoraConfig`` writes."""
    return {
        "alpha_pattern": {},
        "base_model_name_or_path": base_model_name_or_path,
        "bias": "none",
        "exclude_modules": None,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": _json_number(alpha),
        "lora_bias": False,
        "lora_dropout": 0.0,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": rank,
        "rank_pattern": {},
        "revision": None,
        "target_modules": target_modules,
        "target_parameters": None,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": use_rslora,
    }


def save_peft_adapter(model: Transformer, out_dir: str | os.PathLike, *, dtype: str = "bfloat16",
                      base_model_name_or_path: str | None = None, config: LoraConfig | None = None) -> Path:
    """Write the LoRA adapters of ``model`` as a PEFT adapter directory; returns ``out_dir``.

    ``dtype``: ``"bfloat16"`` (default, what vLLM is sent) or ``"float32"`` / ``"float16"``.
    ``base_model_name_or_path`` goes into ``adapter_config.json`` (default: the directory the model was
    loaded from). ``config``: the :class:`~jrl.models.lora.LoraConfig` the adapters were made with, so
    ``lora_alpha`` and ``use_rslora`` are written as configured; without it ``lora_alpha = scale * r``
    with ``use_rslora=false`` (the same update). Files are written to a temp directory beside ``out_dir``
    and renamed into place; only process 0 writes in a multi-host run.

    Raises ``ValueError`` when the model has no LoRA adapters, has LoRA on MoE expert parameters, or its
    adapters do not share one rank and scale.
    """
    save_dtype = save_dtype_name(dtype, "save_peft_adapter")
    layers = lora_layers(model)
    stray = _stray_lora_params(model, layers)
    if stray:
        raise ValueError(f"save_peft_adapter: LoRA on MoE expert parameters ({', '.join(stray[:4])}"
                         f"{' ...' if len(stray) > 4 else ''}) cannot be exported as a PEFT adapter; export a merged "
                         f"checkpoint instead (jrl.models.merge_lora, or scripts/export.py --merge-lora)")
    if not layers:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters (apply jrl.models.apply_lora first, or "
                         "export the full model with save_pretrained)")
    rank, alpha, use_rslora = _adapter_hparams(layers, config)
    modules = _hf_modules(model, layers)
    tensors: list[tuple[str, tuple[int, ...], str]] = []
    for module, layer, _ in modules:
        n_in, n_out = math.prod(layer.in_shape), math.prod(layer.out_shape)
        tensors.append((f"{PEFT_PREFIX}{module}.lora_A.weight", (rank, n_in), save_dtype))
        tensors.append((f"{PEFT_PREFIX}{module}.lora_B.weight", (n_out, rank), save_dtype))

    target = np.dtype(jnp.dtype(save_dtype))

    def arrays():
        for _, layer, index in modules:
            n_in = math.prod(layer.in_shape)
            a, b = (v.get_value() if index is None else v.get_value()[index] for v in (layer.lora_a, layer.lora_b))
            yield np.ascontiguousarray(to_host(a).reshape(n_in, rank).T.astype(target))
            yield np.ascontiguousarray(to_host(b).reshape(rank, -1).T.astype(target))

    targets = sorted({path.rsplit(".", 1)[-1] for path in layers})
    base = base_model_name_or_path if base_model_name_or_path is not None else getattr(model, "source_dir", None)
    adapter_config = peft_adapter_config(rank=rank, alpha=alpha, use_rslora=use_rslora, target_modules=targets,
                                         base_model_name_or_path=None if base is None else str(base))
    out_dir = Path(out_dir)
    writer = jax.process_index() == 0
    if not writer:
        for _ in arrays():  # still take part in the gathers of sharded adapters
            pass
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write_safetensors(tmp / ADAPTER_WEIGHTS, tensors, arrays())
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
        atomic_replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
