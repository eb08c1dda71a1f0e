"""Model families: what one Hugging Face ``model_type`` is to jrl, in one :class:`Family` per file of
:mod:`jrl.models.families`, registered in :data:`FAMILIES` by its ``model_type``.

A family says how its ``config.json`` reads into :class:`~jrl.models.ModelConfig` fields and back (``read`` /
``write``, over the keys every family shares, which :mod:`jrl.models.config` handles), the class defaults of keys a
``config.json`` may omit, the combinations of fields its HF config can express (``check``), which layers are
mixtures of experts, and its weight-mapping table (:mod:`jrl.models.hf_mapping` rules). Model code never asks for a
family: families differ only by ModelConfig fields. Adding one is one file here::

    MY_LLAMA = FAMILIES.register("my_llama")(Family(name="my_llama", architecture="MyLlamaForCausalLM", ...))

and an import of that file (the built-in ones are imported by :mod:`jrl.models.families`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jrl.registry import Registry


def _nothing(cfg) -> None:
    """No family-specific invariant."""


@dataclasses.dataclass(frozen=True)
class Family:
    """One HF model family."""

    name: str
    """The HF ``model_type``."""
    architecture: str
    """The HF architecture class written to ``config.json`` (``architectures``)."""
    hf_defaults: Mapping[str, Any]
    """transformers' class defaults of keys a ``config.json`` may omit (``rope_theta`` is required here)."""
    table: tuple
    """The weight-mapping rules (:class:`jrl.models.hf_mapping.Rule`)."""
    read: Callable[[Mapping[str, Any], Callable[..., Any]], dict[str, Any]]
    """``(hf, get) -> ModelConfig fields`` beyond the shared ones; ``get(key, default)`` reads ``hf`` with the
    family's defaults. Raises :class:`~jrl.models.UnsupportedModelError` for a feature jrl does not implement."""
    write: Callable[[Any], dict[str, Any]]
    """``cfg -> config.json keys`` beyond the shared ones (they may replace shared ones)."""
    check: Callable[[Any], None] = _nothing
    """Raises ``ValueError`` for field combinations the family's HF config cannot express."""
    moe_layer: Callable[[Any, int], bool] | None = None
    """``(cfg, layer) -> whether the layer is a mixture of experts``; None: a dense family."""
    router: str = "softmax"
    """The MoE router (:data:`jrl.models.moe.ROUTERS`) of an MoE family."""
    qk_norm: bool | None = False
    """Whether the family normalises q and k (None: the config says)."""
    qk_norm_projection: bool = False
    """Whether q/k norms cover whole projections (OLMoE) rather than each head."""
    mlp_bias: bool = False
    """Whether the family's config can turn on MLP biases (``mlp_bias``)."""
    sliding_window: bool = False
    """Whether jrl implements the family's sliding-window attention (all layers)."""
    derives_head_dim: bool = False
    """The HF config class derives ``head_dim`` from ``hidden_size / num_attention_heads`` (written only when it
    differs)."""

    @property
    def moe(self) -> bool:
        return self.moe_layer is not None


#: ``model_type`` -> its :class:`Family`.
FAMILIES = Registry("model family", "model_type (config.json)",
                    how_to_register="@FAMILIES.register(model_type) in a file of jrl/models/families/")


def family(model_type: str) -> Family:
    """The :class:`Family` of ``model_type`` (``KeyError`` naming the registered ones)."""
    return FAMILIES.get(model_type)
