"""Mixture of SwiGLU experts: routers, stacked expert weights, an optional shared expert, and the block that runs
them.

On one device (or with the experts whole on every device) a block sorts its (token, expert) rows by expert
and runs grouped matmuls (:mod:`jrl.kernels.moe`). When the mesh splits the experts (the ``expert``
logical axis on a mesh axis of size > 1) the block runs expert-parallel
(:func:`jrl.models.expert_parallel.moe_expert_parallel`): each device gathers its expert peers' tokens, runs
its own experts on them and hands the outputs back by reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jrl.kernels.moe import gmm, swiglu
from jrl.models.config import ModelConfig
from jrl.models.expert_parallel import expert_axis, moe_expert_parallel, moe_per_device, per_device_tokens, routed
from jrl.models import router_stats
from jrl.models.layers import MLP, FrozenParam, Linear, normal_init
from jrl.models.router_stats import RouterStats

_EXPERT_IN = ("expert", "embed", "expert_mlp")
_EXPERT_OUT = ("expert", "expert_mlp", "embed")


class Experts(nnx.Module):
    """Stacked expert weights: gate/up ``[E, H, I]``, down ``[E, I, H]``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        c = config
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        std, pd = c.initializer_range, c.param_dtype
        self.dtype = jnp.dtype(c.dtype)
        self.gate_proj = nnx.Param(normal_init(rngs, (e, h, i), std, pd), logical_axes=_EXPERT_IN)
        self.up_proj = nnx.Param(normal_init(rngs, (e, h, i), std, pd), logical_axes=_EXPERT_IN)
        self.down_proj = nnx.Param(normal_init(rngs, (e, i, h), std, pd), logical_axes=_EXPERT_OUT)

    def arrays(self) -> tuple[tuple[jax.Array, ...], tuple[tuple[str | None, ...], ...]]:
        """(the weights in the compute dtype, their logical axes), in :meth:`compute`'s argument order."""
        return ((self.gate_proj[...].astype(self.dtype), self.up_proj[...].astype(self.dtype),
                 self.down_proj[...].astype(self.dtype)), (_EXPERT_IN, _EXPERT_IN, _EXPERT_OUT))

    def compute(self, rows: jax.Array, group_sizes: jax.Array, gate: jax.Array, up: jax.Array,
                down: jax.Array, *, rows_in_use: jax.Array | None = None) -> jax.Array:
        """SwiGLU of ``rows`` [R, H] sorted by expert (``group_sizes`` [E] rows each) with :meth:`arrays` [E, ...];
        ``rows_in_use`` as :data:`jrl.models.expert_parallel.ExpertsFn` says."""
        # With rows_in_use nothing reads the rows past it (swiglu, routing.py's gathers): the matmuls skip them.
        fill = dict(fill_past_groups=rows_in_use is None)
        h = swiglu(gmm(rows, gate, group_sizes, **fill), gmm(rows, up, group_sizes, **fill), rows_in_use)
        return gmm(h, down, group_sizes, **fill)


#: ``router(logits [..., E] float32, score bias [E] or None, config) -> (weights [..., K] float32, ids [..., K] int32)``
Router = Callable[[jax.Array, jax.Array | None, ModelConfig], tuple[jax.Array, jax.Array]]


def softmax_topk(router_logits: jax.Array, bias: jax.Array | None, c: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """softmax → top-k (Qwen-MoE, Mixtral); with ``norm_topk_prob`` the weights are divided by their sum (no epsilon,
    as transformers)."""
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, c.num_experts_per_tok)
    if c.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, idx.astype(jnp.int32)


def sigmoid_grouped(router_logits: jax.Array, bias: jax.Array | None, c: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Group-limited sigmoid routing (GLM-4-MoE, DeepSeek-V3): experts are chosen by ``sigmoid(logits) + bias``
    among the ``topk_group`` groups (of ``n_group``) whose best two experts score highest, and weighted by their
    sigmoid scores alone, renormalised (``norm_topk_prob``, epsilon 1e-20) and times ``routed_scaling_factor``."""
    scores = jax.nn.sigmoid(router_logits.astype(jnp.float32))
    choice = scores if bias is None else scores + bias.astype(jnp.float32)
    lead, e = choice.shape[:-1], choice.shape[-1]
    per_group = choice.reshape(*lead, c.n_group, e // c.n_group)
    group_scores = jax.lax.top_k(per_group, 2)[0].sum(axis=-1)
    _, groups = jax.lax.top_k(group_scores, c.topk_group)
    keep = jnp.any(groups[..., :, None] == jnp.arange(c.n_group), axis=-2)  # [..., n_group]
    masked = jnp.where(keep[..., None], per_group, -jnp.inf).reshape(choice.shape)
    _, idx = jax.lax.top_k(masked, c.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    if c.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * c.routed_scaling_factor, idx.astype(jnp.int32)


#: ``ModelConfig.router`` -> its router.
ROUTERS: dict[str, Router] = {"softmax": softmax_topk, "sigmoid_grouped": sigmoid_grouped}


class MoE(nnx.Module):
    """Top-k mixture of SwiGLU experts (router in float32, :data:`ROUTERS` by ``config.router``; experts via
    ``jrl.kernels.moe``, expert-parallel when ``mesh`` splits them), plus the shared expert every token goes
    through when the family has one (its output scaled by ``sigmoid(shared_expert_gate(x))`` in Qwen2-MoE)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mesh=None, rules=None):
        c = config
        self.config, self.mesh, self.rules = c, mesh, rules
        self.dtype = jnp.dtype(c.dtype)
        self.router = Linear((c.hidden_size,), (c.num_experts,), in_axes=("embed",), out_axes=(None,),
                             dtype=jnp.float32, param_dtype=c.param_dtype, init_std=c.initializer_range, rngs=rngs)
        self.router_bias = (FrozenParam(jnp.zeros((c.num_experts,), jnp.float32), logical_axes=(None,))
                            if c.router == "sigmoid_grouped" else None)
        self.experts = Experts(c, rngs=rngs)
        shared = c.shared_expert_intermediate_size
        self.shared_expert = MLP(c, shared, rngs=rngs) if shared else None
        self.shared_expert_gate = Linear((c.hidden_size,), (1,), in_axes=("embed",), out_axes=(None,), dtype=c.dtype,
                                         param_dtype=c.param_dtype, init_std=c.initializer_range,
                                         rngs=rngs) if c.shared_expert_gate else None

    def router_logits(self, x: jax.Array) -> jax.Array:
        """Router logits [..., E] computed in float32."""
        return self.router(x.astype(jnp.float32))

    def __call__(self, x: jax.Array, token_mask: jax.Array | None = None) -> jax.Array:
        """The block's output for ``x`` [B, S, H]; ``token_mask`` [B, S] (True = a real token) only weights the
        recorded router statistics (padding computes as any token)."""
        x = x.astype(self.dtype)
        y = self._routed(x, token_mask)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * shared
            y = y + shared
        return y

    def _routed(self, x: jax.Array, token_mask: jax.Array | None) -> jax.Array:
        """The routed experts' weighted sum for ``x`` [B, S, H] (its routing over the tokens of ``token_mask``
        recorded when a :func:`jrl.models.router_stats.collecting` collector is open)."""
        c = self.config
        logits = self.router_logits(x)
        bias = None if self.router_bias is None else self.router_bias[...]
        weights, idx = ROUTERS[c.router](logits, bias, c)
        params, axes = self.experts.arrays()
        rules = dict(self.rules) if self.rules is not None else None
        axis = expert_axis(self.mesh, rules, params[0].shape, axes[0])
        token_spec = per_device_tokens(self.mesh, rules, x.shape)
        dropped = None
        if axis is not None:
            y, dropped = moe_expert_parallel(x, weights, idx, self.experts.compute, params, axes,
                                             num_experts=c.num_experts, mesh=self.mesh, rules=rules, axis=axis,
                                             capacity=c.expert_capacity, chunks=c.expert_chunks)
        elif token_spec is not None:
            y = moe_per_device(x, weights, idx, self.experts.compute, params, axes, num_experts=c.num_experts,
                               mesh=self.mesh, rules=rules, token_spec=token_spec)
        else:
            y = routed(x, weights, idx, c.num_experts, lambda rows, counts: self.experts.compute(rows, counts, *params))
        if router_stats.active():
            router_stats.record(RouterStats.of(logits.reshape(-1, c.num_experts),
                                               idx.reshape(-1, c.num_experts_per_tok),
                                               None if token_mask is None else token_mask.reshape(-1), dropped))
        return y
