"""Flax NNX decoder models (Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral, Qwen2-MoE, GLM-4-MoE, OLMoE) and HF
checkpoint conversion."""

from jrl.models.checkpoint import (
    CheckpointError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    from_pretrained,
    read_config,
)
from jrl.models.checkpoint_writer import save_pretrained
from jrl.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling, UnsupportedModelError
from jrl.models.features import feature_layer_indices, feature_layers
from jrl.models.layers import positions_from_mask, positions_from_segments
from jrl.models.lora import (
    LORA_TARGETS,
    LoraConfig,
    LoRALinear,
    LoRAParam,
    apply_lora,
    has_lora,
    lora_disabled,
    lora_layers,
    merge_lora,
)
from jrl.models.peft import save_peft_adapter
from jrl.models.transformer import Transformer, create_model, named_params, param_shardings

__all__ = [
    "LORA_TARGETS",
    "LoRALinear",
    "LoRAParam",
    "LoraConfig",
    "SUPPORTED_MODEL_TYPES",
    "CheckpointError",
    "MissingTensorError",
    "ModelConfig",
    "RopeScaling",
    "ShapeMismatchError",
    "Transformer",
    "UnexpectedTensorError",
    "UnsupportedModelError",
    "apply_lora",
    "create_model",
    "feature_layer_indices",
    "feature_layers",
    "from_pretrained",
    "read_config",
    "has_lora",
    "lora_disabled",
    "lora_layers",
    "merge_lora",
    "named_params",
    "param_shardings",
    "positions_from_mask",
    "positions_from_segments",
    "save_peft_adapter",
    "save_pretrained",
]
