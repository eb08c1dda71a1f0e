"""``ModelConfig``: one typed description of every supported decoder family.

Families differ only by fields of this dataclass (biases, q/k norm, MoE routing, rope scaling), never by
separate model code. :meth:`ModelConfig.from_hf` reads a Hugging Face ``config.json`` dict (transformers
4.x ``rope_theta``/``rope_scaling`` style or 5.x ``rope_parameters`` style) and :meth:`ModelConfig.to_hf`
writes one that transformers loads as the same architecture: the keys every family shares here, the rest by
the family's own file (:mod:`jrl.models.families`, registered in :data:`jrl.models.family.FAMILIES`), which
also holds its defaults, invariants and weight mapping.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from jrl.kernels.attention import available_impls
from jrl.models import families  # noqa: F401  (registers the built-in families)
from jrl.models.errors import UnsupportedModelError
from jrl.models.family import FAMILIES, Family
from jrl.models.remat import REMAT_NAMES

#: The built-in families' ``model_type`` names (a family registered later is in :data:`FAMILIES` only).
SUPPORTED_MODEL_TYPES: tuple[str, ...] = FAMILIES.in_order()
#: MoE routers (:data:`jrl.models.moe.ROUTERS` implements them).
ROUTER_NAMES: tuple[str, ...] = ("softmax", "sigmoid_grouped")
SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")
_DTYPES = ("float32", "bfloat16", "float16")


def _unsupported(model_type) -> UnsupportedModelError:
    return UnsupportedModelError(f"model_type={model_type!r} is not supported; supported model types: "
                                 f"{', '.join(FAMILIES.in_order())} (more register in jrl/models/families/)")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (HF ``rope_parameters`` minus ``rope_theta``)."""

    rope_type: str = "default"
    """``default`` (none), ``linear`` (positions / factor) or ``llama3`` (Llama 3.1 band-wise scaling)."""
    factor: float = 1.0
    """Scaling factor (``linear``, ``llama3``)."""
    low_freq_factor: float = 1.0
    """``llama3``: wavelengths above ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``."""
    high_freq_factor: float = 4.0
    """``llama3``: wavelengths below ``original_max_position_embeddings / high_freq_factor`` are kept."""
    original_max_position_embeddings: int | None = None
    """``llama3``: pre-training context length (defaults to ``max_position_embeddings``)."""

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_type={self.rope_type!r} is not supported; supported rope types: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only transformer (Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral, Qwen2-MoE,
    GLM-4-MoE)."""

    model_type: str
    """HF family: a registered one (:data:`jrl.models.family.FAMILIES`; built in: ``llama``, ``qwen2``, ``qwen3``,
    ``qwen3_moe``, ``mixtral``, ``qwen2_moe``, ``glm4_moe``, ``olmoe``)."""
    vocab_size: int
    """Number of token embeddings / logits."""
    hidden_size: int
    """Residual stream width H."""
    intermediate_size: int
    """Dense SwiGLU MLP width (unused by layers that are MoE)."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads N."""
    num_key_value_heads: int | None = None
    """Key/value heads K (GQA; N % K == 0). Defaults to ``num_attention_heads``."""
    head_dim: int | None = None
    """Per-head width D. Defaults to ``hidden_size // num_attention_heads``."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """RoPE base wavelength."""
    rope_scaling: RopeScaling | None = None
    """RoPE frequency scaling; ``None`` for plain RoPE."""
    partial_rotary_factor: float = 1.0
    """Fraction of ``head_dim`` that RoPE rotates (the leading dims); the rest passes unrotated (GLM-4-MoE: 0.5)."""
    max_position_embeddings: int = 4096
    """Context length the checkpoint declares (exported; also the llama3 default original length)."""
    tie_word_embeddings: bool = False
    """Logits use the transposed token embedding instead of a separate ``lm_head``."""
    qkv_bias: bool = False
    """Bias on q/k/v projections (Qwen2 always; Llama/Qwen3 ``attention_bias``)."""
    o_bias: bool = False
    """Bias on the output projection (Llama/Qwen3 ``attention_bias``; never Qwen2)."""
    mlp_bias: bool = False
    """Bias on the dense MLP projections (Llama ``mlp_bias``)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on q and k before RoPE (Qwen3, Qwen3-MoE; GLM-4-MoE's ``use_qk_norm``)."""
    qk_norm_projection: bool = False
    """With ``qk_norm``: normalise each token's whole q and k projections (all heads at once, one scale of
    ``heads * head_dim``; OLMoE) instead of each head."""
    sliding_window: int | None = None
    """Sliding attention window applied to every layer (Mixtral); ``None`` for full attention."""
    hidden_act: str = "silu"
    """MLP activation; only ``silu`` (SwiGLU) is implemented."""
    num_experts: int = 0
    """Routed experts E per MoE layer; 0 for a dense model."""
    num_experts_per_tok: int = 0
    """Top-k experts per token."""
    moe_intermediate_size: int | None = None
    """Expert MLP width I."""
    norm_topk_prob: bool = True
    """Renormalise the top-k softmax probabilities to sum to 1 (no epsilon). Mixtral always does."""
    decoder_sparse_step: int = 1
    """Qwen3-MoE: layer i is MoE iff ``(i + 1) % decoder_sparse_step == 0`` and i not in ``mlp_only_layers``."""
    mlp_only_layers: tuple[int, ...] = ()
    """Qwen3-MoE / Qwen2-MoE: layers that use the dense MLP."""
    first_k_dense_replace: int = 0
    """GLM-4-MoE: the first k layers use the dense MLP."""
    router: str = "softmax"
    """MoE routing (:data:`ROUTER_NAMES`): ``softmax`` (softmax, then top-k; Qwen-MoE, Mixtral) or
    ``sigmoid_grouped`` (sigmoid scores plus ``e_score_correction_bias`` pick the top-k experts within the best
    ``topk_group`` of ``n_group`` expert groups, weighted by their sigmoid scores; GLM-4-MoE, DeepSeek-V3)."""
    n_group: int = 1
    """``sigmoid_grouped``: groups the experts are split into."""
    topk_group: int = 1
    """``sigmoid_grouped``: groups a token's experts may come from."""
    routed_scaling_factor: float = 1.0
    """``sigmoid_grouped``: factor on the routing weights (after ``norm_topk_prob``)."""
    shared_expert_intermediate_size: int | None = None
    """Width of the shared expert (a SwiGLU MLP every token of an MoE layer also goes through; Qwen2-MoE, and
    GLM-4-MoE's ``n_shared_experts * moe_intermediate_size``); ``None`` for none."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(x · w)`` with a learned ``w`` [H] (Qwen2-MoE)."""
    bos_token_id: int | None = None
    """Begin-of-sequence token id (exported to config.json)."""
    eos_token_id: int | tuple[int, ...] | None = None
    """End-of-sequence token id(s)."""
    pad_token_id: int | None = None
    """Padding token id."""
    initializer_range: float = 0.02
    """Standard deviation of the normal init of a freshly created (random) model."""
    dtype: str = "float32"
    """Compute (activation) dtype: ``float32``, ``bfloat16`` or ``float16``. Logits are always float32."""
    param_dtype: str = "float32"
    """Parameter storage dtype."""
    attention: str = "auto"
    """Attention implementation (:func:`jrl.kernels.attention.available_impls`); ``auto`` picks by backend.
    A decode step's attention picks its own (:func:`jrl.kernels.attention.decode_attention`) unless this is
    ``reference``, which makes it dense too. Runtime only: not part of the HF config."""
    remat: str = "auto"
    """Rematerialisation of each decoder layer in the backward (:data:`jrl.models.remat.REMAT_NAMES`; ``auto``
    saves the weight matmuls' outputs on a GPU/TPU, on a GPU also the cuDNN attention's, and everything on CPU).
    Runtime only: not part of the HF config."""
    scan_layers: bool = True
    """Store the decoder layers as one stacked module (every parameter gets a leading layer axis) and run
    them with ``jax.lax.scan``, so compile time does not grow with depth. Applies when every layer has the
    same structure (see :attr:`stacked_layers`). Runtime only: not part of the HF config."""
    fsdp_prefetch: bool = True
    """On a mesh of ``data`` and ``fsdp`` axes (``fsdp`` > 1), a dense model with stacked layers runs its layers and
    loss-fused head per device (:mod:`jrl.models.fsdp`): each layer's weight shards are gathered inside its
    rematerialisation checkpoint (two layers per scan iteration, so one layer's gather overlaps the other's compute;
    gathered again in the backward), its gradient reduce-scattered as its backward ends, and the head's gradient
    reduced once per step. ``False`` leaves the collectives to XLA's partitioner (slower).
    Runtime only: not part of the HF config."""
    fsdp_layers_per_gather: int = 0
    """On that per-device path: 0 gathers each layer's weights inside its rematerialisation checkpoint (and again in
    the backward); ``P`` >= 1 runs the layers in groups of ``P`` (the last group holds what remains), each group's
    weights gathered at once before its first layer and kept for the backward (no gather in the backward; the whole
    weights on every device), each group's gradient reduce-scattered when its backward ends: fewer, larger
    collectives. Runtime only: not part of the HF config."""
    expert_capacity: float = 0.0
    """With expert parallelism (an ``expert`` mesh axis): the rows a device's experts run, as a multiple of its even
    share of the routed (token, expert) rows, in one static buffer; routed rows past it (the device's
    highest-numbered experts' last rows) are dropped: they add nothing to their token's output, as with a capacity
    factor. 0 = dropless: every row runs (a buffer of ``expert`` x tokens x top-k row slots, exact). Runtime only:
    not part of the HF config."""
    expert_chunks: int = 1
    """With expert parallelism: split a device's tokens into this many chunks, each gathered over the expert axis,
    run and handed back on its own, so that one chunk's collectives can run beside another's experts (dropless
    output unchanged; a capacity applies per chunk). The device's tokens must divide evenly. Runtime only: not part
    of the HF config."""
    grad_reduce_dtype: str | None = None
    """Dtype in which the per-device path (:attr:`fsdp_prefetch`) and an update accumulated per device
    (``OptimConfig.grad_sync``) reduce-scatter weight gradients: ``None`` = ``param_dtype``, ``float32`` to sum bf16
    weights' gradients in float32 (twice the bytes). Weights are always gathered in the compute ``dtype``. Runtime
    only: not part of the HF config."""

    def __post_init__(self):
        def fix(name, value):
            object.__setattr__(self, name, value)

        if self.model_type not in FAMILIES:
            raise _unsupported(self.model_type)
        if self.num_key_value_heads is None:
            fix("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            fix("head_dim", self.hidden_size // self.num_attention_heads)
        if isinstance(self.rope_scaling, Mapping):
            fix("rope_scaling", RopeScaling(**dict(self.rope_scaling)))
        if self.rope_scaling is not None and self.rope_scaling.rope_type == "default":
            fix("rope_scaling", None)
        fix("mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if isinstance(self.eos_token_id, list):
            fix("eos_token_id", tuple(self.eos_token_id))
        for name in ("dtype", "param_dtype", "grad_reduce_dtype"):
            value = getattr(self, name)
            if value is None and name == "grad_reduce_dtype":
                continue
            if not isinstance(value, str):
                value = np.dtype(value).name
                fix(name, value)
            if value not in _DTYPES:
                raise ValueError(f"ModelConfig.{name}={value!r} is not a float dtype; use one of {', '.join(_DTYPES)}")
        if self.attention not in available_impls():
            raise ValueError(f"ModelConfig.attention={self.attention!r} is not an attention implementation; use one "
                             f"of {', '.join(available_impls())}")
        if self.remat not in REMAT_NAMES:
            raise ValueError(f"ModelConfig.remat={self.remat!r} is not a remat policy; use one of "
                             f"{', '.join(REMAT_NAMES)}")
        if self.expert_chunks < 1:
            raise ValueError(f"ModelConfig.expert_chunks={self.expert_chunks} must be >= 1 (1: no chunks)")
        if self.fsdp_layers_per_gather < 0:
            raise ValueError(f"ModelConfig.fsdp_layers_per_gather={self.fsdp_layers_per_gather} must be >= 0 (0: each "
                             "layer gathered inside its checkpoint, P: layers gathered P at a time)")
        if not (self.expert_capacity == 0 or self.expert_capacity >= 1):
            raise ValueError(f"ModelConfig.expert_capacity={self.expert_capacity} must be 0 (dropless) or >= 1 "
                             "(a multiple of a device's even share of the routed rows)")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)} must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"ModelConfig.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; GQA needs N % K == 0"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
        if self.hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act={self.hidden_act!r} is not supported; only 'silu' (SwiGLU) is")
        family = self.family
        if family.moe:
            if self.num_experts <= 0 or not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ValueError(
                    f"{self.model_type} needs num_experts > 0 and 0 < num_experts_per_tok <= num_experts; got "
                    f"num_experts={self.num_experts}, num_experts_per_tok={self.num_experts_per_tok}"
                )
            if self.moe_intermediate_size is None:
                raise ValueError(f"{self.model_type} needs ModelConfig.moe_intermediate_size (the expert MLP width)")
            if self.decoder_sparse_step < 1:
                raise ValueError(f"ModelConfig.decoder_sparse_step={self.decoder_sparse_step} must be >= 1")
        elif self.num_experts:
            raise ValueError(
                f"model_type={self.model_type!r} is dense but num_experts={self.num_experts}; "
                f"use one of {', '.join(n for n in FAMILIES.in_order() if FAMILIES.get(n).moe)} for MoE"
            )
        self._check_routing()
        # Family invariants: only combinations that the family's HF config can express.
        mt = self.model_type
        if self.mlp_bias and not family.mlp_bias:
            raise ValueError(f"mlp_bias is not an option of {mt}: it has no MLP bias")
        if family.qk_norm is not None and self.qk_norm != family.qk_norm:
            raise ValueError(f"qk_norm must be {family.qk_norm} for {mt}")
        if self.qk_norm_projection != family.qk_norm_projection:
            raise ValueError(f"qk_norm_projection must be {family.qk_norm_projection} for {mt} (OLMoE normalises whole "
                             f"q/k projections, the other families each head)")
        rotary = self.rotary_dim
        if not 0 < rotary <= self.head_dim or rotary % 2:
            raise ValueError(f"ModelConfig.partial_rotary_factor={self.partial_rotary_factor} gives a rotary width of "
                             f"{rotary} of head_dim={self.head_dim}; it must be even and in (0, head_dim]")
        if self.sliding_window is not None and not family.sliding_window:
            raise UnsupportedModelError(
                f"sliding-window attention is not implemented for {mt} (mixtral's, on all layers, is); "
                f"{mt} with use_sliding_window=True is not supported"
            )
        family.check(self)

    def _check_routing(self) -> None:
        """The router and shared-expert fields agree with the family (what its HF config can express)."""
        if self.router not in ROUTER_NAMES:
            raise ValueError(f"ModelConfig.router={self.router!r} is not a router; use one of "
                             f"{', '.join(ROUTER_NAMES)}")
        if not self.is_moe:
            return
        want = self.family.router
        if self.router != want:
            raise ValueError(f"{self.model_type} routes with router={want!r}; got router={self.router!r}")
        if self.router == "sigmoid_grouped":
            if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"sigmoid_grouped routing needs num_experts % n_group == 0 and 1 <= topk_group <= "
                                 f"n_group; got num_experts={self.num_experts}, n_group={self.n_group}, "
                                 f"topk_group={self.topk_group}")
            if self.num_experts // self.n_group < 2:
                raise ValueError(f"sigmoid_grouped routing scores a group by its best 2 experts: n_group="
                                 f"{self.n_group} leaves fewer than 2 of num_experts={self.num_experts} per group")
            if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
                raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts of topk_group="
                                 f"{self.topk_group} groups")
        shared = self.shared_expert_intermediate_size
        if shared is not None and shared <= 0:
            raise ValueError(f"ModelConfig.shared_expert_intermediate_size={shared} must be positive (or None)")

    # ------------------------------------------------------------------ derived
    @property
    def family(self) -> Family:
        """The :class:`~jrl.models.family.Family` of ``model_type``."""
        return FAMILIES.get(self.model_type)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates: ``int(head_dim * partial_rotary_factor)``."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        """Whether any layer is a mixture of experts."""
        return self.num_experts > 0

    @property
    def stacked_layers(self) -> bool:
        """Whether the layers are stacked and scanned: ``scan_layers`` and all layers alike (a Qwen3-MoE model
        with dense layers among its MoE layers runs unrolled)."""
        return self.scan_layers and len({self.layer_is_moe(i) for i in range(self.num_hidden_layers)}) == 1

    def layer_is_moe(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` uses the MoE block (the family's rule)."""
        return self.is_moe and self.family.moe_layer(self, layer)

    def kv_bytes_per_token(self, dtype=None) -> int:
        """Bytes of one token's keys and values over all layers, in ``dtype`` (default: the compute dtype, what a
        dense KV cache holds)."""
        itemsize = np.dtype(self.dtype if dtype is None else dtype).itemsize
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * itemsize

    def num_params(self) -> int:
        """Parameter count (the exported tensors; tied embeddings counted once)."""
        h, d, n, k = self.hidden_size, self.head_dim, self.num_attention_heads, self.num_key_value_heads
        attn = h * d * (n + 2 * k) + n * d * h
        attn += (n + 2 * k) * d * self.qkv_bias + h * self.o_bias
        attn += ((n + k) * d if self.qk_norm_projection else 2 * d) * self.qk_norm
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        for i in range(self.num_hidden_layers):
            total += attn + 2 * h
            if self.layer_is_moe(i):
                total += h * self.num_experts + 3 * self.num_experts * h * self.moe_intermediate_size
                total += 3 * h * (self.shared_expert_intermediate_size or 0) + h * self.shared_expert_gate
                total += self.num_experts * (self.router == "sigmoid_grouped")
            else:
                total += 3 * h * self.intermediate_size + self.mlp_bias * (2 * self.intermediate_size + h)
        return total

    def routed_expert_params(self) -> int:
        """Parameter count of the routed experts' weights (what expert parallelism splits over devices)."""
        per_layer = 3 * self.num_experts * self.hidden_size * (self.moe_intermediate_size or 0)
        return per_layer * sum(self.layer_is_moe(i) for i in range(self.num_hidden_layers))

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF <-> jrl
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], **overrides) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict; ``overrides`` (e.g. ``dtype``) win."""
        mt = hf.get("model_type")
        if mt not in FAMILIES:
            raise _unsupported(mt)
        family = FAMILIES.get(mt)
        defaults = family.hf_defaults

        def get(key, default=None):
            value = hf.get(key)
            return defaults.get(key, default) if value is None else value

        theta, scaling, partial = _rope_from_hf(hf, defaults["rope_theta"], defaults.get("partial_rotary_factor", 1.0))
        n_heads = hf["num_attention_heads"]
        kw: dict[str, Any] = dict(
            model_type=mt,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size", 0),
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_key_value_heads=get("num_key_value_heads", n_heads),
            head_dim=get("head_dim"),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=float(theta),
            rope_scaling=scaling,
            partial_rotary_factor=partial,
            max_position_embeddings=get("max_position_embeddings"),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            hidden_act=hf.get("hidden_act", "silu"),
            bos_token_id=get("bos_token_id"),
            eos_token_id=get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            initializer_range=float(hf.get("initializer_range") or 0.02),
        )
        kw.update(family.read(hf, get))
        kw.update(overrides)
        return cls(**kw)

    def to_hf(self, *, dtype: str | None = None) -> dict[str, Any]:
        """A ``config.json`` dict that transformers loads as this architecture.

        RoPE is written both as 5.x ``rope_parameters`` and as 4.x ``rope_theta``/``rope_scaling`` so older
        readers (e.g. a vLLM venv pinned to transformers 4) see the same frequencies.
        """
        mt = self.model_type
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.partial_rotary_factor != 1.0:
            rope["partial_rotary_factor"] = self.partial_rotary_factor
        legacy_scaling = None
        if self.rope_scaling is not None:
            s = self.rope_scaling
            legacy_scaling = {"rope_type": s.rope_type, "factor": s.factor}
            if s.rope_type == "llama3":
                legacy_scaling.update(
                    low_freq_factor=s.low_freq_factor,
                    high_freq_factor=s.high_freq_factor,
                    original_max_position_embeddings=s.original_max_position_embeddings
                    or self.max_position_embeddings,
                )
            rope = {**rope, **legacy_scaling}
        out: dict[str, Any] = {
            "architectures": [self.family.architecture],
            "model_type": mt,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": legacy_scaling,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "initializer_range": self.initializer_range,
            "dtype": dtype or self.param_dtype,
            "use_cache": True,
        }
        if self.family.derives_head_dim and self.head_dim == self.hidden_size // self.num_attention_heads:
            del out["head_dim"]  # the family's config class derives it (and has no / a None head_dim field)
        out.update(self.family.write(self))
        return out


def _rope_from_hf(hf: Mapping[str, Any], default_theta: float,
                  default_partial: float = 1.0) -> tuple[float, RopeScaling | None, float]:
    """(rope_theta, scaling, partial_rotary_factor) from either ``rope_parameters`` (transformers 5) or
    ``rope_theta``/``rope_scaling``."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise UnsupportedModelError(f"cannot read rope parameters {params!r}")
    if any(isinstance(v, Mapping) for v in params.values()):
        raise UnsupportedModelError("per-layer-type rope parameters are not supported")
    theta = params.get("rope_theta") or hf.get("rope_theta") or default_theta
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_type={rope_type!r} is not supported; supported rope types: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", default_partial)))
    if rope_type == "default":
        return float(theta), None, partial
    scaling = RopeScaling(
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=params.get(
            "original_max_position_embeddings", hf.get("max_position_embeddings")
        ) if rope_type == "llama3" else None,
    )
    return float(theta), scaling, partial


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """RoPE inverse frequencies [rotary_dim // 2] (float32), with the config's scaling applied (as transformers)."""
    d = config.rotary_dim
    inv = (1.0 / (np.float32(config.rope_theta) ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d)))
    inv = inv.astype(np.float32)
    s = config.rope_scaling
    if s is None:
        return inv
    if s.rope_type == "linear":
        return (inv / np.float32(s.factor)).astype(np.float32)
    # llama3
    old_len = s.original_max_position_embeddings or config.max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = (2 * math.pi / inv).astype(np.float32)
    scaled = np.where(wavelen > low_wavelen, inv / np.float32(s.factor), inv).astype(np.float32)
    smooth = ((old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / np.float32(s.factor) + smooth * scaled).astype(np.float32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)
