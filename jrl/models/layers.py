"""NNX building blocks shared by every family: Linear, Embed, RMSNorm, RoPE, attention, SwiGLU MLP (the
mixture of experts is :mod:`jrl.models.moe`).

Every parameter is an ``nnx.Param`` carrying ``logical_axes`` metadata (one logical name or ``None`` per
dimension); :mod:`jrl.sharding.rules` maps those names to mesh axes.

Layouts (jrl side; the HF mapping tables translate at the checkpoint boundary):

=================  ==================  =======================================
parameter          shape               logical axes
=================  ==================  =======================================
q_proj.kernel      [H, N, D]           ("embed", "heads", "head_dim")
k/v_proj.kernel    [H, K, D]           ("embed", "kv_heads", "head_dim")
o_proj.kernel      [N, D, H]           ("heads", "head_dim", "embed")
gate/up.kernel     [H, I]              ("embed", "mlp")
down.kernel        [I, H]              ("mlp", "embed")
router.kernel      [H, E]              ("embed", None)
experts.gate/up    [E, H, I]           ("expert", "embed", "expert_mlp")
experts.down       [E, I, H]           ("expert", "expert_mlp", "embed")
embed.embedding    [V, H]              ("vocab", "embed")
lm_head.kernel     [H, V]              ("embed", "vocab")
norm scale         [H] or [D]          ("norm",)
=================  ==================  =======================================
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jrl.kernels.attention import (AttentionMask, attention, decode_attention, decode_attention_append,
                                  paged_decode_attention_append, stored_as)
from jrl.kernels.attention.mask import segment_starts
from jrl.kernels.attention.reference import attend_dense
from jrl.kernels.attention.rope import apply_rope
from jrl.kernels.decode_linear import matmul_add, matmul_concat, matmul_swiglu
from jrl.models.config import ModelConfig, rope_inv_freq
from jrl.sharding.rules import logical_to_spec, with_logical_constraint

Axes = tuple[str | None, ...]


class FrozenParam(nnx.Param):
    """A checkpoint weight that is loaded, sharded and exported like any parameter but never trained (GLM-4-MoE's
    router ``e_score_correction_bias``: it only shifts which experts are chosen, so it has no gradient, and weight
    decay must not shrink it)."""


#: The parameters a full fine-tune trains: every ``nnx.Param`` but the frozen ones.
TRAINED = nnx.All(nnx.Param, nnx.Not(FrozenParam))


def normal_init(rngs: nnx.Rngs, shape, std: float, dtype) -> jax.Array:
    return (jax.random.normal(rngs.params(), shape, jnp.float32) * std).astype(dtype)


def constrain(x: jax.Array, axes: Axes, mesh, rules) -> jax.Array:
    """Activation sharding constraint by logical names (no-op without a mesh)."""
    if mesh is None:
        return x
    return with_logical_constraint(x, axes, mesh, dict(rules) if rules is not None else None)


class Linear(nnx.Module):
    """``y = x · W (+ b)`` contracting the trailing ``len(in_shape)`` dims of x with W's leading dims.

    ``kernel`` has shape ``in_shape + out_shape`` (e.g. q_proj ``[H, N, D]``), ``bias`` ``out_shape``.
    """

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], *, in_axes: Axes, out_axes: Axes,
                 use_bias: bool = False, dtype=jnp.float32, param_dtype=jnp.float32, init_std: float = 0.02,
                 rngs: nnx.Rngs):
        self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
        self.dtype = jnp.dtype(dtype)
        self.kernel = nnx.Param(normal_init(rngs, self.in_shape + self.out_shape, init_std, param_dtype),
                                logical_axes=tuple(in_axes) + tuple(out_axes))
        self.bias = (nnx.Param(jnp.zeros(self.out_shape, param_dtype), logical_axes=tuple(out_axes))
                     if use_bias else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        n_in = len(self.in_shape)
        kernel = self.kernel[...].astype(self.dtype)
        y = jax.lax.dot_general(
            x.astype(self.dtype), kernel,
            ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ())),
        )
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def _plain(linear: nnx.Module) -> bool:
    """A Linear without bias or adapter (what the decode-step kernels take as a bare weight)."""
    return type(linear) is Linear and linear.bias is None


def linear_add(linear: Linear, x: jax.Array, residual: jax.Array, *, fused: bool) -> jax.Array:
    """``residual + linear(x)``. With ``fused`` (a decode step on one device) and a plain Linear without bias, the
    product and the sum are one :func:`jrl.kernels.decode_linear.matmul_add` over the flattened rows: one kernel
    on a GPU for a few rows (instead of a GEMM, a split-K reduction and an add), the same two ops elsewhere."""
    if not fused or not _plain(linear):
        return residual + linear(x)
    w = linear.kernel[...].astype(linear.dtype).reshape(math.prod(linear.in_shape), math.prod(linear.out_shape))
    y = matmul_add(x.astype(linear.dtype).reshape(-1, w.shape[0]), w, residual.reshape(-1, w.shape[1]))
    return y.reshape(residual.shape)


class Embed(nnx.Module):
    """Token embedding table ``[V, H]``."""

    def __init__(self, vocab_size: int, hidden_size: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 init_std: float = 0.02, rngs: nnx.Rngs):
        self.dtype = jnp.dtype(dtype)
        self.embedding = nnx.Param(normal_init(rngs, (vocab_size, hidden_size), init_std, param_dtype),
                                   logical_axes=("vocab", "embed"))

    def __call__(self, ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], ids, axis=0).astype(self.dtype)


class RMSNorm(nnx.Module):
    """``scale * x / sqrt(mean(x²) + eps)``, normalised in float32 and cast back (as transformers)."""

    def __init__(self, size: int, *, eps: float, dtype=jnp.float32, param_dtype=jnp.float32):
        self.eps = float(eps)
        self.dtype = jnp.dtype(dtype)
        self.scale = nnx.Param(jnp.ones((size,), param_dtype), logical_axes=("norm",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.scale[...].astype(self.dtype) * y.astype(self.dtype)


# --------------------------------------------------------------------------- positions / masks / rope
def positions_from_mask(attention_mask: jax.Array) -> jax.Array:
    """Positions [B, S] that start at 0 at each row's first real token (pads get 0): cumsum(mask) - 1."""
    m = attention_mask.astype(jnp.int32)
    return jnp.maximum(jnp.cumsum(m, axis=-1) - 1, 0)


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Positions [B, S] that restart at 0 wherever the segment id changes (packed rows)."""
    s = segment_ids.shape[-1]
    idx = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), segment_ids.shape)
    first = jax.lax.cummax(jnp.where(segment_starts(segment_ids), idx, 0), axis=segment_ids.ndim - 1)
    return idx - first


def cache_attention_mask(key_mask: jax.Array, query_slots: jax.Array, query_positions: jax.Array, *,
                         sliding_window: int | None = None) -> jax.Array:
    """Boolean mask [B, T, S] for queries at cache slots ``query_slots`` [T] over a KV cache of S slots:
    key slot <= query slot (causal), AND the slot holds a real token (``key_mask`` [B, S]), AND within
    ``sliding_window`` positions. A row's real slots are contiguous (left padding, then appended tokens), so
    the key positions are :func:`positions_from_mask` of ``key_mask``."""
    s = key_mask.shape[-1]
    mask = key_mask.astype(bool)[:, None, :] & (jnp.arange(s)[None, None, :] <= query_slots[None, :, None])
    if sliding_window is not None:
        key_positions = positions_from_mask(key_mask)
        mask = mask & ((query_positions[:, :, None] - key_positions[:, None, :]) < sliding_window)
    return mask


@functools.lru_cache(maxsize=64)
def _inv_freq(config: ModelConfig) -> np.ndarray:
    return rope_inv_freq(config)


def rope_cos_sin(positions: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, S, rotary_dim] (float32) for explicit integer ``positions`` [B, S]."""
    inv = jnp.asarray(_inv_freq(config))
    freqs = positions.astype(jnp.float32)[..., None] * inv
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


# --------------------------------------------------------------------------- blocks
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """One attention layer's keys and values for decoding: ``k``, ``v`` [B, S_max, K, D] (rope applied)."""

    k: jax.Array
    v: jax.Array

    def write(self, k: jax.Array, v: jax.Array, index: jax.Array | int) -> KVCache:
        """The cache with ``k``, ``v`` [B, T, K, D] stored at slots ``index .. index + T - 1``."""
        start = (0, index, 0, 0)
        return KVCache(jax.lax.dynamic_update_slice(self.k, k.astype(self.k.dtype), start),
                       jax.lax.dynamic_update_slice(self.v, v.astype(self.v.dtype), start))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    """One attention layer's keys and values as a pool of pages: ``k``, ``v`` [K, P, page_size, D] (rope applied).
    Which pages hold a row's slots is a :class:`PageSlots`' page table, shared by every layer."""

    k: jax.Array
    v: jax.Array

    def as_stored(self, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys and values as this pool stores them: in its dtype, a float8 pool's clipped to the type's range
        (:func:`jrl.kernels.attention.stored_as`)."""
        return stored_as(k, self.k.dtype), stored_as(v, self.v.dtype)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PageSlots:
    """Where a one-token decode step of B rows reads and writes a paged cache: ``page_table`` int32 [B, M] (row b's
    pages in order), ``lengths`` int32 [B] (its slots after this step's token is written), and the page and offset
    its token is written to (``page``, ``offset`` int32 [B]; a row with nothing to write points at a scratch page)."""

    page_table: jax.Array
    lengths: jax.Array
    page: jax.Array
    offset: jax.Array


class Attention(nnx.Module):
    """Multi-head attention with GQA, optional q/k/v (and o) bias, optional q/k RMSNorm, RoPE.

    Split into :meth:`qkv` (projections, norms, rope at explicit positions) and the attention itself so a KV
    cache can be inserted between them. A full forward runs :func:`jrl.kernels.attention.attention` (the
    implementation ``config.attention`` names) under a structured mask. A decode step (one query per row)
    runs :func:`jrl.kernels.attention.decode_attention_append` on one device (rope, cache write and attention
    in one call) and :func:`jrl.kernels.attention.decode_attention` on a mesh (``auto``; the dense reference
    when ``config.attention`` is ``reference``); a prefill at slot 0 runs the forward's attention over its own
    tokens, and several tokens appended after it attend densely over the cache.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mesh=None, rules=None):
        c = config
        h, n, k, d = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        kw = dict(dtype=c.dtype, param_dtype=c.param_dtype, init_std=c.initializer_range, rngs=rngs)
        self.config, self.mesh, self.rules = c, mesh, rules
        self.q_proj = Linear((h,), (n, d), in_axes=("embed",), out_axes=("heads", "head_dim"), use_bias=c.qkv_bias,
                             **kw)
        self.k_proj = Linear((h,), (k, d), in_axes=("embed",), out_axes=("kv_heads", "head_dim"), use_bias=c.qkv_bias,
                             **kw)
        self.v_proj = Linear((h,), (k, d), in_axes=("embed",), out_axes=("kv_heads", "head_dim"), use_bias=c.qkv_bias,
                             **kw)
        self.o_proj = Linear((n, d), (h,), in_axes=("heads", "head_dim"), out_axes=("embed",), use_bias=c.o_bias, **kw)
        if c.qk_norm:
            q_size, k_size = (n * d, k * d) if c.qk_norm_projection else (d, d)
            self.q_norm = RMSNorm(q_size, eps=c.rms_norm_eps, dtype=c.dtype, param_dtype=c.param_dtype)
            self.k_norm = RMSNorm(k_size, eps=c.rms_norm_eps, dtype=c.dtype, param_dtype=c.param_dtype)
        else:
            self.q_norm = self.k_norm = None

    def _project(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B,S,N,D], k, v [B,S,K,D] with q/k norm applied, before RoPE."""
        return (*self._qk_norm(self.q_proj(x), self.k_proj(x)), self.v_proj(x))

    def _qk_norm(self, q: jax.Array, k: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q [..., N, D] and k [..., K, D] after the q/k norm (as they are without one)."""
        if self.q_norm is not None and self.config.qk_norm_projection:  # over all heads of a token at once
            q = self.q_norm(q.reshape(*q.shape[:-2], -1)).reshape(q.shape)
            k = self.k_norm(k.reshape(*k.shape[:-2], -1)).reshape(k.shape)
        elif self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k

    def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B,S,N,D], k, v [B,S,K,D] with q/k norm and RoPE at ``positions`` applied."""
        q, k, v = self._project(x)
        cos, sin = rope_cos_sin(positions, self.config)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q = constrain(q, ("batch", "activation_length", "heads", "head_dim"), self.mesh, self.rules)
        k = constrain(k, ("batch", "activation_length", "kv_heads", "head_dim"), self.mesh, self.rules)
        v = constrain(v, ("batch", "activation_length", "kv_heads", "head_dim"), self.mesh, self.rules)
        return q, k, v

    def __call__(self, x: jax.Array, positions: jax.Array, mask: AttentionMask) -> jax.Array:
        q, k, v = self.qkv(x, positions)
        return self.o_proj(attention(q, k, v, mask, impl=self.config.attention))

    def decode(self, x: jax.Array, positions: jax.Array, mask: jax.Array | AttentionMask, cache: KVCache,
               index: jax.Array | int, residual: jax.Array, *, fused: bool) -> tuple[jax.Array, KVCache]:
        """Attention of x [B, T, H] (cache slots ``index ..``) over the cache after writing x's keys and values
        there; ``mask`` [B, T, S_max] (see :func:`cache_attention_mask`), or a structured mask over x's own T tokens
        for a prefill at slot 0 (then the forward's attention kernel runs over them, flash on a GPU, where dense
        scores over the cache would take memory quadratic in a long prompt). Returns (``residual`` + output, updated
        cache); ``fused`` (one device): the output projection and the sum as one call (:func:`linear_add`), and a
        one-token step's rope, cache write and attention as one call
        (:func:`jrl.kernels.attention.decode_attention_append`)."""
        scale = self.config.head_dim ** -0.5
        if isinstance(cache, PagedKV):
            return self._decode_paged(x, positions, cache, index, residual, fused=fused, scale=scale)
        if fused and x.shape[1] == 1:
            qkv, cos, sin = self._step_qkv(x, positions)
            out, k_cache, v_cache = decode_attention_append(qkv, cos, sin, cache.k, cache.v, mask[:, 0], index,
                                                            impl=self._decode_impl(), scale=scale)
            return linear_add(self.o_proj, out[:, None], residual, fused=True), KVCache(k_cache, v_cache)
        q, k, v = self.qkv(x, positions)
        cache = cache.write(k, v, index)
        if isinstance(mask, AttentionMask):
            out = attention(q, k, v, mask, impl=self.config.attention, scale=scale)
        elif x.shape[1] == 1:
            out = self._attend_one(q[:, 0], cache, mask[:, 0], scale)[:, None]
        else:
            out = attend_dense(q, cache.k, cache.v, mask, scale=scale)
        return linear_add(self.o_proj, out, residual, fused=fused), cache

    def _decode_paged(self, x: jax.Array, positions: jax.Array, cache: PagedKV, slots: PageSlots,
                      residual: jax.Array, *, fused: bool, scale: float) -> tuple[jax.Array, PagedKV]:
        """A one-token step over a paged cache (``x`` [B, 1, H]): the token's keys and values written at
        ``slots``, then attention over each row's first ``slots.lengths`` slots through its page table (one kernel
        on a GPU: :func:`jrl.kernels.attention.paged_decode_attention_append`)."""
        if x.shape[1] != 1:
            raise ValueError(f"a paged KV cache decodes one token per row per step; got {x.shape[1]}")
        qkv, cos, sin = self._step_qkv(x, positions)
        out, k_pages, v_pages = paged_decode_attention_append(
            qkv, cos, sin, cache.k, cache.v, slots.page_table, slots.lengths, slots.page, slots.offset,
            impl=self._decode_impl(), scale=scale, window=self.config.sliding_window)
        return linear_add(self.o_proj, out[:, None], residual, fused=fused), PagedKV(k_pages, v_pages)

    def _step_qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """A one-token step's projections before rope, qkv [B, N + 2K, D] (queries, keys, values), and its rope's
        cos, sin [B, R]. Plain projections (no bias, adapters merged) run as one call that writes their products
        side by side (:func:`jrl.kernels.decode_linear.matmul_concat`: one kernel on a GPU for a few rows)."""
        cos, sin = rope_cos_sin(positions, self.config)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if not all(map(_plain, projections)):
            return jnp.concatenate(self._project(x), axis=-2)[:, 0], cos[:, 0], sin[:, 0]
        c = self.config
        n, kv = c.num_attention_heads, c.num_key_value_heads
        weights = [p.kernel[...].reshape(c.hidden_size, -1) for p in projections]  # cast to x's dtype in the call
        qkv = matmul_concat(x[:, 0].astype(self.q_proj.dtype), weights).reshape(x.shape[0], n + 2 * kv, c.head_dim)
        if self.q_norm is not None:
            q, k = self._qk_norm(qkv[:, :n], qkv[:, n:n + kv])
            qkv = jnp.concatenate([q, k, qkv[:, n + kv:]], axis=-2)
        return qkv, cos[:, 0], sin[:, 0]

    def _decode_impl(self) -> str:
        return "reference" if self.config.attention == "reference" else "auto"

    def _attend_one(self, q: jax.Array, cache: KVCache, allowed: jax.Array, scale: float) -> jax.Array:
        """A decode step's attention; on a multi-device mesh per shard of rows and heads (``shard_map``: a
        kernel call is opaque to XLA's partitioner, which would otherwise gather the whole cache)."""
        attend = functools.partial(decode_attention, impl=self._decode_impl(), scale=scale)
        if self.mesh is None or self.mesh.size == 1:
            return attend(q, cache.k, cache.v, allowed)
        rules = dict(self.rules) if self.rules is not None else None
        rows, heads = logical_to_spec(("batch", "heads"), self.mesh, rules, q.shape[:2])
        if heads != logical_to_spec(("batch", None, "kv_heads"), self.mesh, rules, cache.k.shape[:3])[2]:
            heads = None  # query and KV heads split differently: keep heads whole on every device
        q_spec, kv_spec = P(rows, heads, None), P(rows, None, heads, None)
        return jax.shard_map(attend, mesh=self.mesh, in_specs=(q_spec, kv_spec, kv_spec, P(rows, None)),
                             out_specs=q_spec, check_vma=False)(q, cache.k, cache.v, allowed)


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig, intermediate_size: int, *, rngs: nnx.Rngs):
        c = config
        kw = dict(dtype=c.dtype, param_dtype=c.param_dtype, init_std=c.initializer_range, rngs=rngs,
                  use_bias=c.mlp_bias)
        h, i = c.hidden_size, intermediate_size
        self.gate_proj = Linear((h,), (i,), in_axes=("embed",), out_axes=("mlp",), **kw)
        self.up_proj = Linear((h,), (i,), in_axes=("embed",), out_axes=("mlp",), **kw)
        self.down_proj = Linear((i,), (h,), in_axes=("mlp",), out_axes=("embed",), **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(self._hidden(x))

    def add_to(self, x: jax.Array, residual: jax.Array, *, fused: bool) -> jax.Array:
        """``residual + self(x)``; ``fused`` (a decode step on one device): the gate and up projections with
        SwiGLU as one call (:func:`jrl.kernels.decode_linear.matmul_swiglu`), the down projection and the sum as
        another (:func:`linear_add`)."""
        if fused and _plain(self.gate_proj) and _plain(self.up_proj):
            w_gate, w_up = (p.kernel[...].astype(p.dtype) for p in (self.gate_proj, self.up_proj))
            hidden = matmul_swiglu(x.astype(w_gate.dtype).reshape(-1, w_gate.shape[0]), w_gate, w_up)
            hidden = hidden.reshape(*x.shape[:-1], w_gate.shape[1])
        else:
            hidden = self._hidden(x)
        return linear_add(self.down_proj, hidden, residual, fused=fused)

    def _hidden(self, x: jax.Array) -> jax.Array:
        return jax.nn.silu(self.gate_proj(x)) * self.up_proj(x)
