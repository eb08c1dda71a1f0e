"""The ``lora`` config section (:class:`LoraConfig`) and the names LoRA can target."""

from __future__ import annotations

import dataclasses
import math


#: HF module names of the projections LoRA can target in every supported family.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: MoE parameters LoRA can target (PEFT ``target_parameters``, transformers' names within a decoder layer): the
#: experts' fused gate/up and down weights, and the router.
MOE_LORA_TARGETS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the attention and MLP projections (PEFT ``LoraConfig`` names)."""

    rank: int = 8
    """r, the adapter rank."""
    alpha: float = 16.0
    """lora_alpha; the update is scaled by alpha / r (or alpha / sqrt(r) with rsLoRA)."""
    use_rslora: bool = False
    """Rank-stabilised scaling alpha / sqrt(r) instead of alpha / r."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """HF module names to adapt, any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (on MoE
    models these are the attention, dense-layer and shared-expert projections)."""
    target_parameters: tuple[str, ...] = ()
    """MoE parameters to adapt (PEFT's ``target_parameters``): ``mlp.experts.gate_up_proj`` (every expert's gate and
    up projections, one A shared by both as in transformers' fused weight), ``mlp.experts.down_proj`` and
    ``mlp.gate.weight`` (the router)."""

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraConfig.rank={self.rank!r} is invalid: use an int >= 1 (e.g. 8)")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha) \
                or self.alpha <= 0:
            raise ValueError(f"LoraConfig.alpha={self.alpha!r} is invalid: use a finite number > 0 (e.g. 2 * rank)")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        object.__setattr__(self, "target_parameters", tuple(self.target_parameters))
        unknown = [t for t in self.target_modules if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(f"LoraConfig.target_modules={self.target_modules!r} is invalid (unknown: {unknown}): "
                             f"use a subset of {LORA_TARGETS}")
        unknown = [t for t in self.target_parameters if t not in MOE_LORA_TARGETS]
        if unknown:
            raise ValueError(f"LoraConfig.target_parameters={self.target_parameters!r} is invalid (unknown: "
                             f"{unknown}): use a subset of {MOE_LORA_TARGETS}")
        if not self.target_modules and not self.target_parameters:
            raise ValueError(f"LoraConfig targets nothing: set target_modules (a subset of {LORA_TARGETS}) and/or, "
                             f"on MoE models, target_parameters (a subset of {MOE_LORA_TARGETS})")

    @property
    def scale(self) -> float:
        """s = alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)
