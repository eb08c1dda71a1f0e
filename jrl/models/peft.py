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

LoRA on MoE layers uses PEFT's ``target_parameters`` (its ``ParamWrapper`` on transformers' in-memory
parameters; checked against peft 0.21 and transformers 5.24): ``mlp.gate.weight`` (the router) is stored as a
Linear pair ``…mlp.gate.lora_A.weight`` ``[r, H]`` / ``lora_B.weight`` ``[E, r]``; the experts' fused
``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` each get ``lora_A`` ``[r·E, in]`` (expert-major
rows: expert ``e`` owns rows ``e·r … e·r+r-1``) and ``lora_B`` ``[out, r·E]`` (rank-major columns: column
``k·E + e``), so ``Δ_e = s · B_e A_e`` has the parameter's ``[out, in]`` layout. PEFT nests the two expert
wrappers: with both targeted, gate_up's pair sits at ``…mlp.experts.base_layer.lora_*`` and down's at
``…mlp.experts.lora_*``; a single one sits at ``…mlp.experts.lora_*`` (vLLM reads the same convention).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jrl.models import hf_mapping
from jrl.models.checkpoint import export_entries, save_dtype_name
from jrl.models.checkpoint_writer import atomic_replace, write_safetensors
from jrl.models.lora import MOE_LORA_TARGETS, ExpertsLoRA, LoraConfig, LoRALinear, lora_layers
from jrl.models.transformer import Transformer, named_params, unit_layer, unit_name
from jrl.sharding.placement import to_host

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Prefix PEFT puts in front of the HF module path (``PeftModelForCausalLM.base_model.model``).
PEFT_PREFIX = "base_model.model."


#: (name in the adapter file, shape, the tensor on the host in the save dtype), in file order.
_Tensor = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]


def _layer_slices(path: str, stack: tuple[int, ...]) -> list[tuple[int, int | None]]:
    """(HF layer number, index on the stacked-layer axis or None) of every layer an adapted module at ``path``
    covers."""
    if stack:
        return [(i, i) for i in range(stack[0])]
    return [(unit_layer(path), None)]


def _value(var, index: int | None) -> jax.Array:
    return var.get_value() if index is None else var.get_value()[index]


def _linear_pair(module: str, layer: LoRALinear, index: int | None, dtype: np.dtype) -> list[_Tensor]:
    """``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` of a LoRA Linear (heads flattened as the HF mapping)."""
    r, n_in, n_out = layer.rank, math.prod(layer.in_shape), math.prod(layer.out_shape)
    return [(f"{PEFT_PREFIX}{module}.lora_A.weight", (r, n_in),
             lambda: to_host(_value(layer.lora_a, index)).reshape(n_in, r).T.astype(dtype)),
            (f"{PEFT_PREFIX}{module}.lora_B.weight", (n_out, r),
             lambda: to_host(_value(layer.lora_b, index)).reshape(r, n_out).T.astype(dtype))]


def _expert_pair(prefix: str, a_var, b_vars, index: int | None, dtype: np.dtype) -> list[_Tensor]:
    """PEFT's ``ParamWrapper`` pair of one expert weight from jrl's ``A [E, in, r]`` and ``B [E, r, out]`` (the
    Bs of a fused weight concatenated on ``out``): ``lora_A [r·E, in]`` expert-major, ``lora_B [out, r·E]``
    rank-major."""
    e, n_in, r = a_var.shape[-3:]
    n_out = sum(b.shape[-1] for b in b_vars)

    def a():
        return to_host(_value(a_var, index)).transpose(0, 2, 1).reshape(e * r, n_in).astype(dtype)

    def b():
        full = np.concatenate([to_host(_value(v, index)) for v in b_vars], axis=-1)  # [E, r, out]
        return full.transpose(2, 1, 0).reshape(n_out, r * e).astype(dtype)

    return [(f"{PEFT_PREFIX}{prefix}lora_A.weight", (e * r, n_in), a),
            (f"{PEFT_PREFIX}{prefix}lora_B.weight", (n_out, r * e), b)]


def _adapter_tensors(model: Transformer, layers: dict, dtype: np.dtype) -> tuple[list[_Tensor], list[str], list[str]]:
    """(tensors, target_modules, target_parameters) of the adapter of ``model``'s adapted ``layers``."""
    by_unit = {e.unit: e for e in export_entries(model.config, named_params(model))}
    tensors: list[_Tensor] = []
    modules, parameters = set(), set()
    for path, layer in layers.items():
        if isinstance(layer, ExpertsLoRA):
            gate_up, down = layer.lora_gate_up_a is not None, layer.lora_down_a is not None
            parameters.update(t for t, on in zip(MOE_LORA_TARGETS[:2], (gate_up, down), strict=True) if on)
            for number, index in _layer_slices(path, layer.gate_proj.shape[:-3]):
                module = hf_mapping.RUNTIME_EXPERTS.format(layer=number) + "."
                if gate_up:
                    tensors += _expert_pair(module + ("base_layer." if down else ""), layer.lora_gate_up_a,
                                            (layer.lora_gate_b, layer.lora_up_b), index, dtype)
                if down:
                    tensors += _expert_pair(module, layer.lora_down_a, (layer.lora_down_b,), index, dtype)
            continue
        router = path.rsplit(".", 1)[-1] == "router"
        (parameters if router else modules).add(MOE_LORA_TARGETS[2] if router else path.rsplit(".", 1)[-1])
        for number, index in _layer_slices(path, layer.stack):
            if router:
                module = hf_mapping.RUNTIME_ROUTER.format(layer=number)
            else:
                entry = by_unit.get((f"{path}.kernel", index))
                if (entry is None or entry.expert is not None or entry.rule.chunk is not None
                        or not isinstance(entry.rule.transform, hf_mapping.Linear)
                        or not entry.hf_key.endswith(".weight")):
                    raise ValueError(f"save_peft_adapter: the LoRA layer {unit_name(path, index)} has no HF Linear "
                                     f"module in the {model.config.model_type} weight mapping, so it cannot be "
                                     f"named in a PEFT adapter")
                module = entry.hf_key[: -len(".weight")]
            tensors += _linear_pair(module, layer, index, dtype)
    return tensors, sorted(modules), [t for t in MOE_LORA_TARGETS if t in parameters]


def _adapter_hparams(layers: dict, config: LoraConfig | None) -> tuple[int, float, bool]:
    """(r, lora_alpha, use_rslora) shared by every layer; ``config`` (when given) must agree with the layers."""
    found = {(layer.rank, layer.scale) for layer in layers.values()}
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
                        target_parameters: list[str], base_model_name_or_path: str | None) -> dict:
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
        "target_parameters": target_parameters or None,
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

    Raises ``ValueError`` when the model has no LoRA adapters or its adapters do not share one rank and scale.
    """
    save_dtype = save_dtype_name(dtype, "save_peft_adapter")
    layers = lora_layers(model)
    if not layers:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters (apply jrl.models.apply_lora first, or "
                         "export the full model with save_pretrained)")
    rank, alpha, use_rslora = _adapter_hparams(layers, config)
    tensors, target_modules, target_parameters = _adapter_tensors(model, layers, np.dtype(jnp.dtype(save_dtype)))
    specs = [(name, shape, save_dtype) for name, shape, _ in tensors]

    def arrays():
        for _, _, value in tensors:
            yield np.ascontiguousarray(value())

    base = base_model_name_or_path if base_model_name_or_path is not None else getattr(model, "source_dir", None)
    adapter_config = peft_adapter_config(rank=rank, alpha=alpha, use_rslora=use_rslora, target_modules=target_modules,
                                         target_parameters=target_parameters,
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
        write_safetensors(tmp / ADAPTER_WEIGHTS, specs, arrays())
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")
        atomic_replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
