"""Declarative HF checkpoint key <-> jrl parameter path rules, in blocks that each family's table
(:attr:`jrl.models.family.Family.table`, in its file of :mod:`jrl.models.families`) is composed of.

A :class:`Rule` says: the HF tensor named ``hf`` (``{layer}`` / ``{expert}`` placeholders) becomes the jrl
parameter ``jrl`` (``{layer}`` placeholder) after ``transform``.

* ``{expert}`` in ``hf``: the tensor fills slice ``[expert]`` of a stacked jrl parameter ``[E, ...]``.
* ``chunk=(axis, index, count)``: the rule takes chunk ``index`` of ``count`` equal chunks of the HF tensor
  along ``axis`` (fused ``gate_up_proj`` = [gate; up] concatenated on axis 1).
* ``export=False``: an import-only alternative layout (fused experts as transformers' runtime names them).
  Export always writes the ``export=True`` rules: the per-expert keys transformers 5.23 writes on disk.
* A rule whose jrl parameter does not exist in the model (bias off, tied embeddings, dense layer of an MoE
  model) is inactive; an HF key that only matches inactive rules is an unexpected key.

What transformers 5.23 writes (checked by saving tiny random models): qwen3_moe
``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight`` and ``mlp.gate.weight``; mixtral
``model.layers.{l}.block_sparse_moe.experts.{e}.w1|w3|w2.weight`` and ``block_sparse_moe.gate.weight``. Its
in-memory (runtime) layout is fused ``mlp.experts.gate_up_proj`` [E, 2I, H] and ``mlp.experts.down_proj``
[E, H, I], which jrl also accepts on import. qwen2_moe and glm4_moe store experts as qwen3_moe does, plus
``mlp.shared_expert.*`` / ``mlp.shared_expert_gate.weight`` (qwen2_moe) and ``mlp.shared_experts.*`` /
``mlp.gate.e_score_correction_bias`` (glm4_moe); olmoe exactly as qwen3_moe, with ``self_attn.q_norm.weight``
``[heads * head_dim]`` and ``k_norm.weight`` ``[kv_heads * head_dim]`` (norms over whole projections).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

import numpy as np


# --------------------------------------------------------------------------- transforms
class Transform:
    """HF tensor <-> jrl tensor (numpy views where possible), plus the HF shape implied by a jrl shape."""

    def hf_shape(self, jrl_shape: Sequence[int]) -> tuple[int, ...]:
        raise NotImplementedError

    def to_jrl(self, a: np.ndarray, jrl_shape: Sequence[int]) -> np.ndarray:
        raise NotImplementedError

    def to_hf(self, a: np.ndarray) -> np.ndarray:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Identity(Transform):
    """Same layout on both sides (norm scales, embedding table)."""

    def hf_shape(self, jrl_shape):
        return tuple(jrl_shape)

    def to_jrl(self, a, jrl_shape):
        return a

    def to_hf(self, a):
        return a


@dataclasses.dataclass(frozen=True)
class Linear(Transform):
    """torch Linear weight ``[out, in]`` <-> jrl kernel ``in_dims + out_dims`` (transpose, split heads).

    ``in_ndim`` is how many leading jrl dims are inputs: 1 for ``[H, N, D]`` q/k/v and ``[H, I]`` MLP
    kernels, 2 for the ``[N, D, H]`` output projection. ``to_jrl`` returns a view (no copy) and also works
    on a stack of experts ``[E, out, in]`` given the stacked jrl shape.
    """

    in_ndim: int = 1

    def hf_shape(self, jrl_shape):
        return (math.prod(jrl_shape[self.in_ndim:]), math.prod(jrl_shape[:self.in_ndim]))

    def to_jrl(self, a, jrl_shape):
        return np.swapaxes(a, -1, -2).reshape(jrl_shape)

    def to_hf(self, a):
        n_in = math.prod(a.shape[:self.in_ndim])
        return a.reshape(n_in, -1).T


@dataclasses.dataclass(frozen=True)
class Flatten(Transform):
    """HF bias ``[N*D]`` <-> jrl ``[N, D]``."""

    def hf_shape(self, jrl_shape):
        return (math.prod(jrl_shape),)

    def to_jrl(self, a, jrl_shape):
        return a.reshape(jrl_shape)

    def to_hf(self, a):
        return a.reshape(-1)


@dataclasses.dataclass(frozen=True)
class ExpertsLinear(Transform):
    """Fused experts ``[E, out, in]`` <-> jrl ``[E, in, out]``."""

    def hf_shape(self, jrl_shape):
        return (jrl_shape[0], jrl_shape[2], jrl_shape[1])

    def to_jrl(self, a, jrl_shape):
        return a.transpose(0, 2, 1)

    def to_hf(self, a):
        return a.transpose(0, 2, 1)


IDENTITY, LINEAR, LINEAR_OUT, FLATTEN, EXPERTS = Identity(), Linear(1), Linear(2), Flatten(), ExpertsLinear()


# --------------------------------------------------------------------------- rules
@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF key pattern <-> one jrl parameter path pattern."""

    hf: str
    jrl: str
    transform: Transform
    chunk: tuple[int, int, int] | None = None
    export: bool = True

    @property
    def per_expert(self) -> bool:
        return "{expert}" in self.hf

    def regex(self) -> re.Pattern:
        pattern = re.escape(self.hf).replace(r"\{layer\}", r"(?P<layer>\d+)").replace(r"\{expert\}", r"(?P<expert>\d+)")
        return re.compile(pattern + r"\Z")


def dense_rules(prefix: str = "model.") -> tuple[Rule, ...]:
    L = f"{prefix}layers.{{layer}}."
    j = "layers.{layer}."
    return (
        Rule(f"{prefix}embed_tokens.weight", "embed.embedding", IDENTITY),
        Rule(f"{prefix}norm.weight", "final_norm.scale", IDENTITY),
        Rule("lm_head.weight", "lm_head.kernel", LINEAR),
        Rule(L + "input_layernorm.weight", j + "input_norm.scale", IDENTITY),
        Rule(L + "post_attention_layernorm.weight", j + "post_attn_norm.scale", IDENTITY),
        Rule(L + "self_attn.q_proj.weight", j + "attn.q_proj.kernel", LINEAR),
        Rule(L + "self_attn.k_proj.weight", j + "attn.k_proj.kernel", LINEAR),
        Rule(L + "self_attn.v_proj.weight", j + "attn.v_proj.kernel", LINEAR),
        Rule(L + "self_attn.o_proj.weight", j + "attn.o_proj.kernel", LINEAR_OUT),
        Rule(L + "self_attn.q_proj.bias", j + "attn.q_proj.bias", FLATTEN),
        Rule(L + "self_attn.k_proj.bias", j + "attn.k_proj.bias", FLATTEN),
        Rule(L + "self_attn.v_proj.bias", j + "attn.v_proj.bias", FLATTEN),
        Rule(L + "self_attn.o_proj.bias", j + "attn.o_proj.bias", IDENTITY),
        Rule(L + "self_attn.q_norm.weight", j + "attn.q_norm.scale", IDENTITY),
        Rule(L + "self_attn.k_norm.weight", j + "attn.k_norm.scale", IDENTITY),
        Rule(L + "mlp.gate_proj.weight", j + "mlp.gate_proj.kernel", LINEAR),
        Rule(L + "mlp.up_proj.weight", j + "mlp.up_proj.kernel", LINEAR),
        Rule(L + "mlp.down_proj.weight", j + "mlp.down_proj.kernel", LINEAR),
        Rule(L + "mlp.gate_proj.bias", j + "mlp.gate_proj.bias", IDENTITY),
        Rule(L + "mlp.up_proj.bias", j + "mlp.up_proj.bias", IDENTITY),
        Rule(L + "mlp.down_proj.bias", j + "mlp.down_proj.bias", IDENTITY),
    )


def _fused_expert_rules(moe: str) -> tuple[Rule, ...]:
    """transformers v5 runtime layout: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""
    L, j = f"model.layers.{{layer}}.{moe}.", "layers.{layer}.mlp."
    return (
        Rule(L + "experts.gate_up_proj", j + "experts.gate_proj", EXPERTS, chunk=(1, 0, 2), export=False),
        Rule(L + "experts.gate_up_proj", j + "experts.up_proj", EXPERTS, chunk=(1, 1, 2), export=False),
        Rule(L + "experts.down_proj", j + "experts.down_proj", EXPERTS, export=False),
    )


QWEN_MOE_RULES = (
    Rule("model.layers.{layer}.mlp.gate.weight", "layers.{layer}.mlp.router.kernel", LINEAR),
    Rule("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight", "layers.{layer}.mlp.experts.gate_proj", LINEAR),
    Rule("model.layers.{layer}.mlp.experts.{expert}.up_proj.weight", "layers.{layer}.mlp.experts.up_proj", LINEAR),
    Rule("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight", "layers.{layer}.mlp.experts.down_proj", LINEAR),
) + _fused_expert_rules("mlp")

MIXTRAL_MOE_RULES = (
    Rule("model.layers.{layer}.block_sparse_moe.gate.weight", "layers.{layer}.mlp.router.kernel", LINEAR),
    Rule("model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight", "layers.{layer}.mlp.experts.gate_proj",
         LINEAR),
    Rule("model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight", "layers.{layer}.mlp.experts.up_proj",
         LINEAR),
    Rule("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight", "layers.{layer}.mlp.experts.down_proj",
         LINEAR),
    # transformers v5 runtime names (renamed block_sparse_moe -> mlp, fused experts): import only.
    Rule("model.layers.{layer}.mlp.gate.weight", "layers.{layer}.mlp.router.kernel", LINEAR, export=False),
) + _fused_expert_rules("mlp") + _fused_expert_rules("block_sparse_moe")

def _shared_expert_rules(name: str) -> tuple[Rule, ...]:
    """A shared expert stored as ``mlp.{name}.{gate,up,down}_proj`` (qwen2_moe ``shared_expert``, glm4_moe
    ``shared_experts``)."""
    L, j = f"model.layers.{{layer}}.mlp.{name}.", "layers.{layer}.mlp.shared_expert."
    return tuple(Rule(f"{L}{p}.weight", f"{j}{p}.kernel", LINEAR) for p in ("gate_proj", "up_proj", "down_proj"))


QWEN2_MOE_RULES = QWEN_MOE_RULES + _shared_expert_rules("shared_expert") + (
    Rule("model.layers.{layer}.mlp.shared_expert_gate.weight", "layers.{layer}.mlp.shared_expert_gate.kernel", LINEAR),
)

GLM4_MOE_RULES = QWEN_MOE_RULES + _shared_expert_rules("shared_experts") + (
    Rule("model.layers.{layer}.mlp.gate.e_score_correction_bias", "layers.{layer}.mlp.router_bias", IDENTITY),
)

#: transformers' in-memory module names of an MoE layer's router and experts, the same in every MoE family jrl reads
#: (Mixtral's ``block_sparse_moe`` is ``mlp`` at run time): what PEFT adapters on them address.
RUNTIME_ROUTER = "model.layers.{layer}.mlp.gate"
RUNTIME_EXPERTS = "model.layers.{layer}.mlp.experts"

#: Keys some checkpoints carry that hold no weights jrl needs (old Llama exports saved RoPE caches).
IGNORED = (re.compile(r".*\.rotary_emb\.inv_freq\Z"),)
