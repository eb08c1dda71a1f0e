"""Flax NNX decoder models (Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral) and HF checkpoint conversion."""

from jrl.models.checkpoint import (
    CheckpointError,
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    from_pretrained,
    save_pretrained,
)
from jrl.models.config import SUPPORTED_MODEL_TYPES, ModelConfig, RopeScaling, UnsupportedModelError
from jrl.models.layers import attend, make_attention_mask, positions_from_mask, positions_from_segments
from jrl.models.transformer import Transformer, create_model, named_params, param_shardings

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "CheckpointError",
    "MissingTensorError",
    "ModelConfig",
    "RopeScaling",
    "ShapeMismatchError",
    "Transformer",
    "UnexpectedTensorError",
    "UnsupportedModelError",
    "attend",
    "create_model",
    "from_pretrained",
    "make_attention_mask",
    "named_params",
    "param_shardings",
    "positions_from_mask",
    "positions_from_segments",
    "save_pretrained",
]
