"""The decoder-only ``Transformer`` used for every supported family."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.kernels.attention import AttentionMask
from jrl.kernels.attention.mask import roll_rows, run_starts
from jrl.models.config import ModelConfig
from jrl.models.layers import (
    MLP,
    Attention,
    Embed,
    KVCache,
    Linear,
    PagedKV,
    PageSlots,
    RMSNorm,
    cache_attention_mask,
    constrain,
    positions_from_mask,
    positions_from_segments,
)
from jrl.kernels.logprobs import fused_head_loss, token_logprobs
from jrl.models import fsdp, router_stats
from jrl.models.moe import MoE
from jrl.models.remat import remat
from jrl.sharding.placement import check_placement, from_host
from jrl.sharding.rules import DEFAULT_RULES, logical_sharding

_RESIDUAL = ("batch", "activation_length", "embed")
_KV_CACHE = ("batch", None, "kv_heads", "head_dim")
#: Logical name of the leading axis of stacked layer parameters.
LAYER_AXIS = "layers"


def freeze_rules(rules: Mapping | None) -> tuple | None:
    """``rules`` as a sorted tuple of items (hashable, comparable: a jit cache key), None for None."""
    return None if rules is None else tuple(sorted(dict(rules).items()))


class DecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``h + mlp(norm(h))`` (mlp is dense SwiGLU or MoE)."""

    def __init__(self, config: ModelConfig, layer: int, *, rngs: nnx.Rngs, mesh=None, rules=None):
        c = config
        self.mesh, self.rules = mesh, rules
        self.input_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=c.dtype, param_dtype=c.param_dtype)
        self.attn = Attention(c, rngs=rngs, mesh=mesh, rules=rules)
        self.post_attn_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=c.dtype, param_dtype=c.param_dtype)
        self.mlp = (MoE(c, rngs=rngs, mesh=mesh, rules=rules) if c.layer_is_moe(layer)
                    else MLP(c, c.intermediate_size, rngs=rngs))

    def __call__(self, x: jax.Array, positions: jax.Array, mask: AttentionMask | jax.Array,
                 cache: KVCache | None = None, cache_index: jax.Array | int = 0):
        """The block's output; with ``cache`` the attention reads and extends it (:meth:`Attention.decode`,
        ``mask`` then a dense [B, T, S_max] cache mask) and ``(output, updated cache)`` is returned."""
        # A decode step on one device runs each output projection and its residual add as one call (a kernel
        # on a GPU, :func:`jrl.models.layers.linear_add`); a kernel is opaque to XLA's partitioner, so not on a mesh.
        fused = cache is not None and (self.mesh is None or self.mesh.size == 1)
        if cache is None:
            h = x + self.attn(self.input_norm(x), positions, mask)
        else:
            h, cache = self.attn.decode(self.input_norm(x), positions, mask, cache, cache_index, x, fused=fused)
        h = constrain(h, _RESIDUAL, self.mesh, self.rules)
        if isinstance(self.mlp, MLP):
            out = self.mlp.add_to(self.post_attn_norm(h), h, fused=fused)
        else:
            real = mask.row_segments() > 0 if isinstance(mask, AttentionMask) else None  # router stats: real tokens
            out = h + self.mlp(self.post_attn_norm(h), token_mask=real)
        out = constrain(out, _RESIDUAL, self.mesh, self.rules)
        return out if cache is None else (out, cache)


def _layer_step(graphdef: nnx.GraphDef) -> Callable:
    """``step(state, x, positions, mask)``: the layer ``graphdef`` with parameters ``state`` applied to x (a pure
    function, for ``jax.checkpoint`` and ``jax.lax.scan``). While router statistics are collected
    (:mod:`jrl.models.router_stats`) it returns ``(output, the layer's stacked RouterStats or None)``: values
    traced inside the step leave it as outputs."""
    if not router_stats.active():
        return lambda state, x, positions, mask: nnx.merge(graphdef, state)(x, positions, mask)

    def step(state, x, positions, mask):
        with router_stats.collecting() as inner:
            out = nnx.merge(graphdef, state)(x, positions, mask)
        return out, router_stats.stack(inner)

    return step


def stack_layers(layers: Sequence[DecoderLayer]) -> DecoderLayer:
    """One :class:`DecoderLayer` holding ``layers`` (all of one structure): every parameter gets a leading
    layer axis with the logical name ``"layers"`` (replicated by the default sharding rules)."""
    graphdef, first = nnx.split(layers[0])
    states = [first] + [nnx.split(layer)[1] for layer in layers[1:]]
    return _relabel(nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states)),
                    lambda axes: (LAYER_AXIS, *axes))


def unstack_layers(stacked: DecoderLayer, num_layers: int) -> list[DecoderLayer]:
    """The separate layers of a :func:`stack_layers` module (slices of its parameters: one copy of them)."""
    graphdef, state = nnx.split(stacked)
    return [_relabel(nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state)), lambda axes: axes[1:])
            for i in range(num_layers)]


def _relabel(module: nnx.Module, fn: Callable) -> nnx.Module:
    """``module`` with every parameter's ``logical_axes`` replaced by ``fn(logical_axes)``."""
    for _, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Param):
            var.set_metadata(logical_axes=fn(tuple(var.get_metadata()["logical_axes"])))
    return module


def on_mesh(model: nnx.Module, mesh, rules: Mapping | None = None) -> nnx.Module:
    """``model`` (in place) with its activation sharding constraints on ``mesh`` / ``rules``: what a copy of the
    weights placed on another mesh (a rollout mesh, :func:`jrl.sharding.split_devices`) runs with."""
    frozen = freeze_rules(rules)
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module) and hasattr(node, "mesh"):
            node.mesh, node.rules = mesh, frozen
    return model


class Transformer(nnx.Module):
    """Decoder-only LM: embed → layers → final RMSNorm → logits (tied or separate ``lm_head``).

    Inputs everywhere: ``input_ids`` [B, S] int, and optionally ``positions`` [B, S] int,
    ``attention_mask`` [B, S] (1 = token, 0 = pad; left padding is exact) and/or ``segment_ids`` [B, S]
    (packed rows: tokens attend only within their segment). Without ``positions`` they are derived:
    cumsum of the mask minus one, restarting per segment with ``segment_ids``, else ``arange(S)``. A row's
    real tokens are one run (left and/or right padding; the GPU attention kernel relies on it) and each
    packed document is one run; the sliding window counts indices, which within a run are the positions.
    Layers run under ``config.remat`` (:mod:`jrl.models.remat`) in a differentiated forward. With
    ``config.stacked_layers`` ``layers`` is one :class:`DecoderLayer` whose parameters carry a leading layer
    axis (:func:`stack_layers`) and the forward is a ``jax.lax.scan`` over it (one compiled layer body
    whatever the depth); otherwise ``layers`` is a list run in a Python loop. Decoding always runs the layers
    one by one (:meth:`decode`, :meth:`unstacked`).

    ``mesh`` (optional) turns on activation sharding constraints at block boundaries with ``rules``
    (defaults to :data:`jrl.sharding.rules.DEFAULT_RULES`). ``source_dir`` remembers the HF directory the
    weights came from (tokenizer files are copied from it on export).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, mesh=None, rules: Mapping | None = None,
                 source_dir: str | None = None):
        c = config
        self.config = c
        self.mesh = mesh
        self.rules = freeze_rules(rules)
        self.source_dir = source_dir
        self.embed = Embed(c.vocab_size, c.hidden_size, dtype=c.dtype, param_dtype=c.param_dtype,
                           init_std=c.initializer_range, rngs=rngs)
        layers = [DecoderLayer(c, i, rngs=rngs, mesh=mesh, rules=self.rules) for i in range(c.num_hidden_layers)]
        self.layers = stack_layers(layers) if c.stacked_layers else nnx.List(layers)
        self.final_norm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, dtype=c.dtype, param_dtype=c.param_dtype)
        self.lm_head = None if c.tie_word_embeddings else Linear(
            (c.hidden_size,), (c.vocab_size,), in_axes=("embed",), out_axes=("vocab",), dtype=c.dtype,
            param_dtype=c.param_dtype, init_std=c.initializer_range, rngs=rngs)

    # ------------------------------------------------------------------ inputs
    def prepare_inputs(self, input_ids: jax.Array, positions=None, attention_mask=None, segment_ids=None,
                       mask=None, *, starts_at_zero: bool = False, max_segments: int | None = None,
                       expand: tuple[jax.Array, jax.Array] | None = None) -> tuple[jax.Array, AttentionMask]:
        """(positions [B, S], structured attention mask) for a forward pass.

        An explicit ``mask`` [B, S, S] (query, key) replaces the causal, padding, segment and
        sliding-window rules, and ``positions`` must then be given too. ``starts_at_zero``: the caller promises
        that every row of ``attention_mask`` is right-padded only (:attr:`AttentionMask.starts_at_zero`).
        ``max_segments``: the caller's bound on the segments of a ``segment_ids`` row, padding included
        (:attr:`AttentionMask.max_segments`). ``expand`` = (expand [B, E], copies [B, S, C]): the attention runs over
        the tokens gathered by ``expand`` (:attr:`AttentionMask.expand`; packed rows with shared prompts), and
        ``segment_ids`` [B, E] and the explicit ``positions`` are of that layout and of the row."""
        b, s = input_ids.shape
        window = self.config.sliding_window
        if mask is not None:
            if positions is None:
                raise ValueError("an explicit attention mask needs explicit positions: pass positions=[B, S] too")
            if attention_mask is not None or segment_ids is not None:
                raise ValueError("pass either mask= or attention_mask=/segment_ids=, not both (mask replaces them)")
            if mask.shape != (b, s, s):
                raise ValueError(f"mask has shape {tuple(mask.shape)}, expected (batch, seq, seq) = {(b, s, s)}")
            return positions.astype(jnp.int32), AttentionMask.from_dense(mask)
        if expand is not None:
            if positions is None or segment_ids is None or attention_mask is not None:
                raise ValueError("expand= needs segment_ids= (of the gathered layout) and positions= (of the row), "
                                 "and no attention_mask=")
            structured = dataclasses.replace(
                AttentionMask.packed(segment_ids, sliding_window=window, max_segments=max_segments),
                expand=expand[0].astype(jnp.int32), copies=expand[1].astype(jnp.int32))
        elif segment_ids is not None:
            structured = AttentionMask.packed(segment_ids, attention_mask, sliding_window=window,
                                              max_segments=max_segments)
            positions = positions_from_segments(segment_ids) if positions is None else positions
        elif attention_mask is not None:
            structured = AttentionMask.padded(attention_mask, sliding_window=window, starts_at_zero=starts_at_zero)
            positions = positions_from_mask(attention_mask) if positions is None else positions
        else:
            structured = AttentionMask.full_causal(b, s, sliding_window=window)
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        return positions.astype(jnp.int32), structured

    # ------------------------------------------------------------------ forward
    def hidden_states(self, input_ids: jax.Array, *, positions=None, attention_mask=None, segment_ids=None,
                      mask=None, max_segments: int | None = None, expand: tuple[jax.Array, jax.Array] | None = None,
                      return_layers: bool | Sequence[int] = False):
        """Final hidden states [B, S, H] (after the final norm, compute dtype).

        ``mask``: an explicit boolean attention mask [B, S, S] (query, key) used instead of the model's own
        (causal / padding / segments / sliding window); needs ``positions`` (see :meth:`prepare_inputs`).
        ``max_segments``: with ``segment_ids``, at most this many segments per row, padding included (packed rows
        then take cuDNN's packed attention on a GPU). ``expand``: packed rows with shared prompts (see
        :meth:`prepare_inputs`).

        ``return_layers``: ``True`` also returns the tuple of all L + 1 hidden states in transformers'
        ``output_hidden_states`` convention (entry 0 = embedding output, entry i = output of layer i - 1,
        entry L = the final *normed* output), as ``(final, layers)``. A sequence of indices into that tuple
        (negative ones count from the end) returns ``(last, selected)`` with only those entries; layers past
        the deepest index asked for are not run, and then ``last`` is that deepest (un-normed) entry instead
        of the final hidden states. EBFT's feature depth f maps to index ``int(f * L)``.
        """
        num_layers = self.config.num_hidden_layers
        wanted = None
        if return_layers is not False and return_layers is not True:
            wanted = [int(i) % (num_layers + 1) if int(i) < 0 else int(i) for i in return_layers]
            if any(not 0 <= i <= num_layers for i in wanted):
                raise ValueError(f"return_layers={list(return_layers)} has indices outside [0, {num_layers}]")
        depth = num_layers if wanted is None else max(wanted, default=0)
        # Padded rows run with their real tokens moved to index 0 (one rotation of the inputs here and of the
        # outputs in ``restore``), so attention kernels that handle only trailing padding need no per-layer
        # shift; a row's causal order, positions and results are unchanged.
        aligned = attention_mask is not None and segment_ids is None and mask is None
        shift = run_starts(jnp.asarray(attention_mask) != 0) if aligned else None
        if aligned:
            input_ids, attention_mask = roll_rows(input_ids, shift), roll_rows(attention_mask, shift)
            positions = None if positions is None else roll_rows(positions, shift)

        def restore(h: jax.Array) -> jax.Array:
            return h if shift is None else roll_rows(h, (h.shape[1] - shift) % h.shape[1])

        positions, mask = self.prepare_inputs(input_ids, positions, attention_mask, segment_ids, mask,
                                              starts_at_zero=aligned, max_segments=max_segments, expand=expand)
        embedded = self._embedded(input_ids)
        x, outputs = self._run_layers(embedded, positions, mask, depth, collect=return_layers is not False)
        collected = [embedded, *outputs]
        if depth < num_layers:  # only intermediate layers were asked for
            return restore(x), tuple(restore(collected[i]) for i in wanted)
        final = self.final_norm(x)
        if return_layers is False:
            return restore(final)
        collected[-1] = final
        picked = range(num_layers + 1) if wanted is None else wanted
        return restore(final), tuple(restore(collected[i]) for i in picked)

    def _embedded(self, input_ids: jax.Array) -> jax.Array:
        """The token embedding [B, S, H] laid out as the residual stream; on a ``data``/``fsdp`` mesh each device
        looks up its own rows in its own columns of the table (:func:`jrl.models.fsdp.embed_lookup`)."""
        axes = fsdp.explicit_axes(self.config, self.mesh, self._rules(), input_ids.shape[0], layers=False)
        local = None if axes is None else fsdp.embed_lookup(self.embed.embedding, input_ids, mesh=self.mesh,
                                                            rules=self._rules(), axes=axes, dtype=self.embed.dtype)
        return constrain(self.embed(input_ids) if local is None else local, _RESIDUAL, self.mesh, self.rules)

    def _run_layers(self, x: jax.Array, positions: jax.Array, mask: AttentionMask, depth: int, *,
                    collect: bool) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        """The first ``depth`` layers applied to ``x``: (output, every layer's output when ``collect``)."""
        if depth == 0:
            return x, ()
        remat_name = self.config.remat
        with_stats = router_stats.active()

        def run(step, state, h, positions=positions, mask=mask):
            """The layer's output, its router statistics recorded (or handed out of a scan body)."""
            out = step(state, h, positions, mask)
            return out if with_stats else (out, None)

        if not self.config.stacked_layers:
            outputs = []
            for layer in self.layers[:depth]:
                graphdef, state = nnx.split(layer)
                x, stats = run(remat(_layer_step(graphdef), remat_name), state, x)
                if stats is not None:
                    router_stats.record(stats)
                outputs.append(x)
            return x, tuple(outputs) if collect else ()
        graphdef, state = nnx.split(self.layers)
        if depth < self.config.num_hidden_layers:
            state = jax.tree.map(lambda a: a[:depth], state)
        axes = fsdp.explicit_axes(self.config, self.mesh, self._rules(), x.shape[0])
        if axes is not None:  # per device, FSDP collectives placed by hand (jrl.models.fsdp)
            local = nnx.split(on_mesh(nnx.merge(graphdef, state), None))[0]
            step = functools.partial(run, _layer_step(local))  # a dense model's: no router statistics
            x, stacked = fsdp.scan_layers(lambda *a: step(*a)[0], state, x, positions, mask, mesh=self.mesh,
                                          rules=self._rules(), axes=axes, collect=collect, dtype=self.config.dtype,
                                          reduce_dtype=self.config.grad_reduce_dtype, remat_name=remat_name,
                                          layers_per_gather=self.config.fsdp_layers_per_gather)
            return x, tuple(stacked[i] for i in range(depth)) if collect else ()
        step = remat(_layer_step(graphdef), remat_name, prevent_cse=False)  # scan already keeps CSE away

        def body(h, layer_state):
            h, stats = run(step, layer_state, h)
            return h, (h if collect else None, stats)

        x, (stacked, stats) = jax.lax.scan(body, x, state)
        if stats is not None:
            router_stats.record(stats)
        return x, tuple(stacked[i] for i in range(depth)) if collect else ()

    # ------------------------------------------------------------------ decoding with a KV cache
    def unstacked(self) -> Transformer:
        """This model with its layers as separate modules (a new module sharing every other parameter; the
        layer parameters are sliced, one copy of them), or the model itself when its layers are not stacked.

        The samplers decode on it (through :func:`jrl.models.lora.decoding_view`): a decode step over stacked
        layers slices every layer's weights out of the stack on every token (3x slower on an H100 when
        scanned, ``benchmarks/RESULTS.md``); this copies them once per generation."""
        if not self.config.stacked_layers:
            return self
        view = nnx.merge(*nnx.split(self))
        view.layers = nnx.List(unstack_layers(self.layers, self.config.num_hidden_layers))
        view.config = dataclasses.replace(self.config, scan_layers=False)
        return view

    def init_cache(self, batch: int, max_len: int) -> tuple[KVCache, ...]:
        """An empty (zero) KV cache of ``max_len`` slots per layer, in the compute dtype, batch-sharded."""
        c = self.config
        shape = (batch, max_len, c.num_key_value_heads, c.head_dim)

        def zeros():
            return constrain(jnp.zeros(shape, c.dtype), _KV_CACHE, self.mesh, self.rules)

        return tuple(KVCache(zeros(), zeros()) for _ in range(c.num_hidden_layers))

    def cache_rows(self, cache: tuple[KVCache, ...], source: jax.Array) -> tuple[KVCache, ...]:
        """The cache whose row r is row ``source[r]`` of ``cache`` (a prefilled prompt copied to the rows that
        continue it), sharded as :meth:`init_cache`'s."""
        def take(x):
            return constrain(x[source], _KV_CACHE, self.mesh, self.rules)

        return tuple(KVCache(take(c.k), take(c.v)) for c in cache)

    def extend_cache(self, cache: tuple[KVCache, ...], source: jax.Array, slots: int) -> tuple[KVCache, ...]:
        """The cache whose row r is row ``source[r]`` of ``cache``, with ``slots`` empty slots after its own (a
        conversation continued), sharded as :meth:`init_cache`'s."""
        def grow(x):
            return constrain(jnp.pad(x[source], ((0, 0), (0, slots), (0, 0), (0, 0))), _KV_CACHE, self.mesh,
                             self.rules)

        return tuple(KVCache(grow(c.k), grow(c.v)) for c in cache)

    def decode(self, input_ids: jax.Array, positions: jax.Array, key_mask: jax.Array | None,
               cache: tuple[KVCache, ...], cache_index: jax.Array | int, *,
               mask: jax.Array | None = None) -> tuple[jax.Array, tuple[KVCache, ...]]:
        """Final hidden states [B, T, H] of ``input_ids`` [B, T] (at ``positions`` [B, T]) written to cache
        slots ``cache_index .. cache_index + T - 1``, attending causally to every cache slot marked real in
        ``key_mask`` [B, S_max] (which must already mark these T slots). Returns (hidden, updated cache).

        Prefill is one call over the whole left-padded prompt at slot 0 (it runs the forward's attention kernel over
        the prompt alone, each row's real tokens one run); decoding is one call per token.
        An explicit ``mask`` [B, T, S_max] (query, cache slot) replaces the mask built from ``key_mask``
        (which may then be None), sliding window included.

        The layers run one by one (stacked layers are sliced per call: a decoding loop runs on
        :meth:`unstacked`, which slices them once)."""
        t, slots = input_ids.shape[1], cache[0].k.shape[1]
        prefill = isinstance(cache_index, int) and cache_index == 0 and t > 1
        if mask is None and key_mask is not None and prefill:
            # Nothing before slot 0: the prompt attends to itself alone (each row's real tokens one run), through the
            # forward's attention kernel.
            mask = AttentionMask.padded(key_mask[:, :t], sliding_window=self.config.sliding_window)
        elif mask is None:
            query_slots = cache_index + jnp.arange(t, dtype=jnp.int32)
            mask = cache_attention_mask(key_mask, query_slots, positions, sliding_window=self.config.sliding_window)
        elif mask.shape != (input_ids.shape[0], t, slots):
            raise ValueError(f"mask has shape {tuple(mask.shape)}, expected (batch, tokens, cache slots) = "
                             f"{(input_ids.shape[0], t, slots)}")
        return self._decode_layers(input_ids, positions, mask, cache, cache_index)

    def _decode_layers(self, input_ids, positions, mask, cache: tuple, index) -> tuple[jax.Array, tuple]:
        x = constrain(self.embed(input_ids), _RESIDUAL, self.mesh, self.rules)
        new_cache = []
        for layer, layer_cache in zip(self.unstacked().layers, cache, strict=True):
            x, layer_cache = layer(x, positions, mask, layer_cache, index)
            new_cache.append(layer_cache)
        return self.final_norm(x), tuple(new_cache)

    def init_pages(self, num_pages: int, page_size: int, dtype=None) -> tuple[PagedKV, ...]:
        """An empty (zero) paged KV cache: a pool of ``num_pages`` pages of ``page_size`` slots per layer, in
        ``dtype`` (default: the compute dtype)."""
        c = self.config
        shape = (c.num_key_value_heads, num_pages, page_size, c.head_dim)
        dtype = c.dtype if dtype is None else dtype
        return tuple(PagedKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))
                     for _ in range(c.num_hidden_layers))

    def decode_paged(self, input_ids: jax.Array, positions: jax.Array, cache: tuple[PagedKV, ...],
                     slots: PageSlots) -> tuple[jax.Array, tuple[PagedKV, ...]]:
        """Final hidden states [B, 1, H] of one token per row, ``input_ids`` [B, 1] at ``positions`` [B, 1], written
        to a paged cache at ``slots`` and attending to each row's first ``slots.lengths`` slots (the last
        ``sliding_window`` of them for a model with one; one device). Returns (hidden, updated cache)."""
        return self._decode_layers(input_ids, positions, None, cache, slots)

    def lm_head_weight(self) -> jax.Array:
        """The output projection ``[H, V]`` (the transposed embedding when tied)."""
        if self.lm_head is None:
            return self.embed.embedding[...].T
        return self.lm_head.kernel[...]

    def _head_param(self) -> tuple[nnx.Variable, bool]:
        """The LM head's variable and whether it is the (tied) embedding [V, H], to be transposed."""
        tied = self.lm_head is None
        return (self.embed.embedding if tied else self.lm_head.kernel), tied

    def _rules(self) -> dict:
        return DEFAULT_RULES if self.rules is None else dict(self.rules)

    def head_loss(self, hidden: jax.Array, targets: jax.Array, row_loss: Callable, rows, aux=None, *,
                  temperature: float = 1.0, with_entropy: bool = False):
        """:func:`jrl.kernels.logprobs.fused_head_loss` of ``hidden`` [R, T, H] predicting ``targets`` [R, T] under
        this model's LM head: (loss, logp [R, T], entropy or None). On a ``data``/``fsdp`` mesh each device computes
        its own rows against the gathered head (:func:`jrl.models.fsdp.head_loss`)."""
        axes = fsdp.explicit_axes(self.config, self.mesh, self._rules(), hidden.shape[0], layers=False)
        if axes is None:
            return fused_head_loss(hidden, self.lm_head_weight(), targets, row_loss, rows, aux,
                                   temperature=temperature, with_entropy=with_entropy)
        return fsdp.head_loss(*self._head_param(), hidden, targets, row_loss, rows, aux, mesh=self.mesh,
                              rules=self._rules(), axes=axes, dtype=self.config.dtype,
                              reduce_dtype=self.config.grad_reduce_dtype, temperature=temperature,
                              with_entropy=with_entropy)

    def token_logprobs(self, hidden: jax.Array, targets: jax.Array, *, temperature: float = 1.0,
                       with_entropy: bool = False, impl: str = "auto"):
        """(log-probs [R, T], entropies [R, T] or None) of ``targets`` [R, T] from final hidden states ``hidden``
        [R, T, H] through the ``impl`` log-prob kernel (:func:`jrl.kernels.logprobs.token_logprobs`). On a
        ``data``/``fsdp`` mesh each device computes its own rows against the gathered head
        (:func:`jrl.models.fsdp.token_logprobs`)."""
        r, t = targets.shape
        axes = fsdp.explicit_axes(self.config, self.mesh, self._rules(), r, layers=False)
        if axes is None:
            lp, ent = token_logprobs(hidden.reshape(r * t, -1), self.lm_head_weight(), targets.reshape(r * t),
                                     temperature=temperature, with_entropy=with_entropy, impl=impl)
            return lp.reshape(r, t), None if ent is None else ent.reshape(r, t)
        return fsdp.token_logprobs(*self._head_param(), hidden, targets, mesh=self.mesh, rules=self._rules(), axes=axes,
                                   reduce_dtype=self.config.grad_reduce_dtype, temperature=temperature,
                                   with_entropy=with_entropy, impl=impl)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """float32 logits [..., V] from final hidden states [..., H]."""
        w = self.lm_head_weight().astype(hidden.dtype)
        out = jnp.einsum("...h,hv->...v", hidden, w, preferred_element_type=jnp.float32)
        if out.ndim == 3:
            out = constrain(out, ("batch", "activation_length", "vocab"), self.mesh, self.rules)
        return out

    def __call__(self, input_ids: jax.Array, *, positions=None, attention_mask=None, segment_ids=None,
                 mask=None) -> jax.Array:
        """float32 logits [B, S, V] (``mask``: see :meth:`hidden_states`)."""
        return self.logits(self.hidden_states(input_ids, positions=positions, attention_mask=attention_mask,
                                              segment_ids=segment_ids, mask=mask))


def named_params(model: nnx.Module) -> dict[str, nnx.Variable]:
    """``{"layers.0.attn.q_proj.kernel": Param, ...}`` for every ``nnx.Param`` of ``model``."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            out[".".join(str(p) for p in path)] = node
    return out


def param_shardings(model: nnx.Module, mesh, rules: Mapping | None = None) -> dict[str, jax.sharding.NamedSharding]:
    """``{param path: NamedSharding}`` for every ``nnx.Param`` of ``model`` from its ``logical_axes``."""
    return {k: logical_sharding(v.logical_axes, mesh, rules, v.shape) for k, v in named_params(model).items()}


def place(host: np.ndarray, logical_axes, mesh=None, rules: Mapping | None = None) -> jax.Array:
    """Put a host array on the default device, or with a mesh sharded by ``logical_axes`` so that each
    device only receives its own shard (``jax.make_array_from_callback``)."""
    if mesh is None:
        return jax.device_put(host)
    sharding = logical_sharding(logical_axes, mesh, rules, host.shape)
    return from_host(host, sharding)


def _stack_on_devices(layers: Sequence[jax.Array], logical_axes, mesh, rules) -> jax.Array:
    """Stack per-layer arrays (each placed by :func:`place` with ``logical_axes[1:]``) on a new leading axis,
    on the devices that hold them (the layer axis is replicated, so no data moves between devices)."""
    if mesh is None:
        return jnp.stack(layers)
    sharding = logical_sharding(logical_axes, mesh, rules, (len(layers), *layers[0].shape))
    return jax.jit(lambda *xs: jnp.stack(xs), out_shardings=sharding)(*layers)


def unit_placer(params: Mapping[str, nnx.Variable], mesh=None, rules: Mapping | None = None) -> Callable:
    """``put((path, layer), host)``: places one unit of :func:`param_units` from a host array. A whole
    parameter is set at once; a stacked-layer parameter is placed layer by layer and set, stacked on the
    devices, when its last layer arrives (the host never holds more than one layer of it)."""
    pending: dict[str, list[jax.Array | None]] = {}

    def put(unit: tuple[str, int | None], host: np.ndarray) -> None:
        (path, layer), var = unit, params[unit[0]]
        if layer is None:
            var.set_value(place(host, var.logical_axes, mesh, rules))
            return
        placed = pending.setdefault(path, [None] * var.shape[0])
        placed[layer] = place(host, var.logical_axes[1:], mesh, rules)
        if all(p is not None for p in placed):
            var.set_value(_stack_on_devices(pending.pop(path), var.logical_axes, mesh, rules))

    return put


def create_model(config: ModelConfig, *, seed: int = 0, mesh=None, rules: Mapping | None = None) -> Transformer:
    """A randomly initialised :class:`Transformer`: normal(0, ``initializer_range``) weights, unit norm
    scales, zero biases. Parameters are drawn one at a time (one layer at a time) on the host (numpy, seeded by
    ``(seed, index)``, so the values depend neither on the mesh nor on ``scan_layers``) and placed sharded by
    their logical axes when ``mesh`` is given."""
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(seed), mesh=mesh, rules=rules))
    if mesh is not None:
        check_placement(model, mesh, rules)
    params = named_params(model)
    units = param_units(config, params)
    by_name = sorted(units, key=lambda unit: unit_name(*unit))  # the same values stacked or not
    put = unit_placer(params, mesh, rules)
    for i, (path, layer) in enumerate(by_name):
        shape = units[path, layer]
        dtype = np.dtype(jnp.dtype(params[path].dtype))
        if path.endswith(".scale"):
            host = np.ones(shape, dtype)
        elif path.endswith(".bias"):
            host = np.zeros(shape, dtype)
        else:
            rng = np.random.default_rng([seed, i])
            host = (rng.standard_normal(shape, dtype=np.float32) * config.initializer_range).astype(dtype)
        put((path, layer), host)
    return model


def param_units(config: ModelConfig, params: Mapping[str, nnx.Variable]) -> dict[tuple[str, int | None], tuple]:
    """{(parameter path, layer): shape} of the per-layer parts of a model's parameters: each layer of a
    stacked-layer parameter, every other parameter whole (layer ``None``)."""
    out = {}
    for path, var in params.items():
        if config.stacked_layers and path.startswith("layers."):
            out.update({(path, i): tuple(var.shape[1:]) for i in range(var.shape[0])})
        else:
            out[path, None] = tuple(var.shape)
    return out


def unit_name(path: str, layer: int | None) -> str:
    """The parameter path a unit of :func:`param_units` has in an unstacked model (``layers.3.attn...``)."""
    return path if layer is None else path.replace("layers.", f"layers.{layer}.", 1)


def unit_layer(path: str) -> int:
    """The layer number in a parameter path of an unstacked model (``layers.3.attn.q_proj`` -> 3): what
    :func:`unit_name` puts there."""
    parts = path.split(".", 2)
    if len(parts) < 3 or parts[0] != "layers" or not parts[1].isdigit():
        raise ValueError(f"{path!r} is not a parameter path of one layer of an unstacked model (layers.N....)")
    return int(parts[1])
