"""The embedded JAX sampler (rollout backend ``jax``): batched generation with a KV cache in one jit.

A call to :meth:`JaxRolloutEngine.generate` repeats each prompt ``num_generations`` times (rows
``p*G .. p*G+G-1``), left-pads the prompts to a multiple of ``prompt_bucket`` tokens, pads the rows to a
:func:`row_bucket`, and runs one jitted program: a prefill of each prompt once into a fixed-size KV cache of
``prompt_len + max_new_tokens`` slots per layer (:meth:`jrl.models.Transformer.decode`; the prompt count
padded to a :func:`row_bucket` too), copied to the ``G`` rows that continue it, then a ``lax.while_loop`` that
samples a token, writes it to the cache and decodes the next logits, until ``max_new_tokens`` tokens or every
row has stopped. The program depends only on the shapes (row bucket, prompt-count bucket, prompt bucket,
``max_new_tokens``), ``top_k``, whether top-p is on and the stop ids (temperature and top-p mass are runtime
inputs), so a training run compiles once per such bucket combination.

The decode step runs on :func:`jrl.models.lora.decoding_view` (layers sliced, LoRA adapters merged); on one
device its query, key and value projections through :func:`jrl.kernels.decode_linear.matmul_concat`, its rope,
cache write and attention through :func:`jrl.kernels.attention.decode_attention_append` (on a GPU one kernel that
reads only each row's filled cache slots, none of a stopped row's), its MLP's gate and
up projections with SwiGLU through :func:`jrl.kernels.decode_linear.matmul_swiglu` and its output projections
with their residual adds through :func:`jrl.kernels.decode_linear.matmul_add`.

Sampling semantics and the reported logprob are those of :mod:`jrl.rollout.sampling`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.data.pipeline import left_pad
from jrl.models.layers import constrain, positions_from_mask
from jrl.models.lora import decoding_view
from jrl.models.transformer import freeze_rules, on_mesh, place
from jrl.rollout.config import SAMPLER_COPY_FRACTION
from jrl.rollout.base import ROLLOUT_ENGINES, RolloutBatch, SamplingParams, check_generate_args
from jrl.rollout.kv_config import KVCacheConfig
from jrl.rollout.paged import RowGroup, generate_paged, new_groups, power_of_two_at_least, rollout_of
from jrl.rollout.sampling import Decoding
from jrl.rollout.strided_sampler import StridedSamples, generate_blocks
from jrl.sharding.memory import device_bytes, memory_limit
from jrl.sharding.placement import gather_to_host, reshard, state_shardings
from jrl.sharding.rules import logical_to_spec, mesh_axes

_ROWS = ("batch", None)

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Program:
    """Everything static about one compiled generation program (its jit cache key): the decoding, the layout."""

    decoding: Decoding
    mesh: object
    rules: tuple | None


def _rows_constraint(p: _Program):
    rules = dict(p.rules) if p.rules is not None else None
    return lambda x: constrain(x, ("batch",) + (None,) * (x.ndim - 1), p.mesh, rules)


def _sample_loop(model, p: _Program, *, cache, logits, key_mask, position, stopped, key, temperature, top_p,
                 start: int) -> dict:
    """Sample up to ``p.decoding.max_new_tokens`` tokens per row from ``logits`` on, each decoded into cache slot
    ``start + i``: the loop's final carry (``tokens``, ``mask``, ``logprobs`` [N, max_new], ``stopped`` [N],
    ``cache``).

    The loop body samples token i from the current logits, then decodes it to get the logits of token i + 1
    (the last iteration's decode is unused: one extra decode step instead of a branch in the loop)."""
    rows, d = _rows_constraint(p), p.decoding
    n = logits.shape[0]
    carry = dict(
        step=jnp.zeros((), jnp.int32), cache=cache, logits=logits, key_mask=key_mask, position=position,
        stopped=stopped, tokens=rows(jnp.full((n, d.max_new_tokens), d.pad_id, jnp.int32)),
        mask=rows(jnp.zeros((n, d.max_new_tokens), jnp.int32)),
        logprobs=rows(jnp.zeros((n, d.max_new_tokens), jnp.float32)),
    )

    def cond(c):
        return (c["step"] < d.max_new_tokens) & ~jnp.all(c["stopped"])

    def body(c):
        i = c["step"]
        token, logprob = d.draw(jax.random.fold_in(key, i), c["logits"], temperature=temperature, top_p=top_p)
        active = ~c["stopped"]
        token = jnp.where(active, token, d.pad_id)
        stopped = c["stopped"] | (active & d.is_stop(token))
        slot = start + i
        # A stopped row attends to no slot: the decode attention reads none of its cache (its output is unused).
        key_mask = c["key_mask"].at[:, slot].set(active) & active[:, None]
        hidden, cache = model.decode(token[:, None], c["position"][:, None], key_mask, c["cache"], slot)
        return dict(
            step=i + 1, cache=cache, logits=model.logits(hidden[:, 0]), key_mask=key_mask,
            position=c["position"] + 1, stopped=stopped,
            tokens=c["tokens"].at[:, i].set(token),
            mask=c["mask"].at[:, i].set(active.astype(jnp.int32)),
            logprobs=c["logprobs"].at[:, i].set(jnp.where(active, logprob, 0.0)),
        )

    return jax.lax.while_loop(cond, body, carry)


def _session_state(out: dict, key_mask, position, start: int):
    """What a continuation needs of a finished loop (:class:`DecodeSession`): the cache, the slots each row fills
    without its last token (which the next turn feeds again: its logits were not kept), and that token's
    position. The loop's own key mask cannot serve: it clears a row's slots once the row stops."""
    mask = out["mask"].astype(bool)
    written = key_mask.at[:, start:start + mask.shape[1]].set(mask)
    count = jnp.sum(out["mask"], axis=-1)
    last = start + count - 1
    kept = written & (jnp.arange(written.shape[1])[None, :] != last[:, None])
    return out["cache"], kept, position + count - 1


@functools.partial(jax.jit, static_argnames=("graphdef", "program", "keep"))
def _generate(graphdef, state, prompt_ids: jax.Array, prompt_mask: jax.Array, source: jax.Array, used_rows: jax.Array,
              key: jax.Array, temperature: jax.Array, top_p: jax.Array, program: _Program, keep: bool = False):
    """(tokens, mask, logprobs [N, max_new] and stopped [N]) for N rows, row r continuing the left-padded prompt
    ``source[r]`` of ``prompt_ids`` [P, Lp]: each prompt is prefilled once and its cache and last logits copied to
    the rows that continue it (the ``num_generations`` copies of a prompt). Rows from ``used_rows`` on fill a row
    bucket and start stopped (they never keep the loop running). With ``keep``, also the state a continuation
    starts from (:func:`_session_state`)."""
    p = program
    model = decoding_view(nnx.merge(graphdef, state))  # layers sliced (adapters merged) once per call
    rows = _rows_constraint(p)
    (n,), (prompts, prompt_len) = source.shape, prompt_ids.shape
    max_len = prompt_len + p.decoding.max_new_tokens

    def to_rows(x):
        """Per-prompt values [P, ...] -> per-row values [N, ...] (the identity when the prompts are the rows)."""
        return rows(x if prompts == n else x[source])

    key_mask = rows(jnp.zeros((prompts, max_len), bool).at[:, :prompt_len].set(prompt_mask.astype(bool)))
    hidden, cache = model.decode(prompt_ids, positions_from_mask(prompt_mask), key_mask,
                                 model.init_cache(prompts, max_len), 0)
    logits = model.logits(hidden[:, -1])  # left padding: the last slot is every row's last prompt token
    cache = cache if prompts == n else model.cache_rows(cache, source)
    key_mask, position = to_rows(key_mask), to_rows(jnp.sum(prompt_mask.astype(jnp.int32), axis=-1))
    out = _sample_loop(model, p, cache=cache, logits=to_rows(logits), key_mask=key_mask, position=position,
                       stopped=rows(jnp.arange(n) >= used_rows), key=key, temperature=temperature, top_p=top_p,
                       start=prompt_len)
    result = out["tokens"], out["mask"], out["logprobs"], out["stopped"]
    return (*result, _session_state(out, key_mask, position, prompt_len)) if keep else result


@functools.partial(jax.jit, static_argnames=("graphdef", "program"))
def _continue(graphdef, state, cache, key_mask: jax.Array, position: jax.Array, source: jax.Array,
              added_ids: jax.Array, added_mask: jax.Array, used_rows: jax.Array, key: jax.Array,
              temperature: jax.Array, top_p: jax.Array, program: _Program):
    """A conversation's next turn for N rows, row r continuing row ``source[r]`` of a session (its ``cache``,
    ``key_mask`` and next ``position``): the tokens ``added_ids`` [N, La] (right-padded, ``added_mask``; the
    previous turn's last token first) are written after the session's slots in one prefill, then sampling goes on as
    in :func:`_generate`. Returns the same outputs and the session state after this turn."""
    p = program
    model = decoding_view(nnx.merge(graphdef, state))
    rows = _rows_constraint(p)
    (n, added), width = added_ids.shape, key_mask.shape[1]
    extra = added + p.decoding.max_new_tokens
    cache = model.extend_cache(cache, source, extra)
    added_mask = added_mask.astype(bool)
    key_mask = rows(jnp.zeros((n, width + extra), bool).at[:, :width].set(key_mask[source])
                    .at[:, width:width + added].set(added_mask))
    position = rows(position[source])
    hidden, cache = model.decode(added_ids, position[:, None] + jnp.arange(added, dtype=jnp.int32)[None, :],
                                 key_mask, cache, width)
    count = jnp.sum(added_mask.astype(jnp.int32), axis=-1)
    logits = model.logits(hidden[jnp.arange(n), count - 1])  # each row's last added token
    position = position + count
    out = _sample_loop(model, p, cache=cache, logits=logits, key_mask=key_mask, position=position,
                       stopped=rows(jnp.arange(n) >= used_rows), key=key, temperature=temperature, top_p=top_p,
                       start=width + added)
    return (out["tokens"], out["mask"], out["logprobs"], out["stopped"],
            _session_state(out, key_mask, position, width + added))


@dataclasses.dataclass
class DecodeSession:
    """Conversations a :class:`JaxRolloutEngine` can continue without prefilling them again: their KV cache,
    filled slots and next positions on the devices (rows padded to a bucket), each row's last token (fed again with
    the next turn's tokens), and the weights and version they were sampled with."""

    cache: tuple
    key_mask: jax.Array
    position: jax.Array
    last_tokens: np.ndarray
    rows: int
    graphdef: object
    state: object
    version: int


def row_bucket(rows: int, shards: int = 1) -> int:
    """The row count a generation of ``rows`` rows runs with: the next power of two, and a multiple of the
    batch ``shards``, so a run whose row count varies compiles O(log rows) programs. Decoding is bound by
    reading the weights, so the extra rows cost little (they start stopped)."""
    return -(-power_of_two_at_least(rows) // shards) * shards


def _batch_shards(mesh, rules) -> int:
    """How many ways the batch dimension is split on ``mesh`` (1 without a mesh)."""
    if mesh is None:
        return 1
    return math.prod(mesh.shape[a] for a in mesh_axes(logical_to_spec(("batch",), mesh, rules)[0]))


def _device_ids(mesh) -> frozenset | None:
    """The ids of ``mesh``'s devices (None without a mesh: one device)."""
    return None if mesh is None else frozenset(d.id for d in mesh.devices.flat)


def _report_copy(state, mesh) -> None:
    """Log the per-device bytes of the sampler's copy of the weights; warn when they take more than
    :data:`jrl.rollout.config.SAMPLER_COPY_FRACTION` of a device's memory (where the device reports it)."""
    device = mesh.local_devices[0]
    per_device, limit = device_bytes(state).get(device, 0), memory_limit(device)
    logger.debug("sampler weights: a copy of %.2f GiB per device, laid out %s", per_device / 2**30, dict(mesh.shape))
    if limit and per_device > SAMPLER_COPY_FRACTION * limit:
        logger.warning(
            "the sampler's copy of the weights takes %.1f GiB of each device's %.1f GiB; if generation runs out of "
            "memory, shard it: --rollout.mesh.tensor N (tensor parallel, within a host) or --rollout.mesh.fsdp -1 "
            "--rollout.mesh.data 1 (decode from FSDP shards: no copy on the learner's devices, slower)",
            per_device / 2**30, limit / 2**30)


def _wider(x, dtype) -> bool:
    return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > dtype.itemsize


@functools.partial(jax.jit, static_argnames="dtype")
def _narrow(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if _wider(x, dtype) else x, tree)


def narrowed(state, dtype) -> object:
    """``state`` with its floating arrays wider than ``dtype`` cast to it (on their devices); ``state`` itself when
    none is. A sampler computing in ``dtype`` reads half the bytes per token from float32 master weights."""
    dtype = jnp.dtype(dtype)
    return _narrow(state, dtype) if any(_wider(x, dtype) for x in jax.tree.leaves(state)) else state


class JaxRolloutEngine:
    """The embedded sampler: :class:`~jrl.rollout.base.RolloutEngine` over a jrl ``Transformer``.

    ``model``: the policy (any ``Transformer``, including one whose projections are LoRA layers).
    ``mesh`` / ``rules``: the layout the engine decodes with (default: the model's own mesh and rules); rows are
    sharded over the mesh's batch axes, the row count padded to a multiple of the batch shards with throw-away rows.
    In the model's own layout the engine keeps a reference to the model's current arrays, never a copy, and
    :meth:`sync_weights` re-points it at a model's arrays (call it after every update: a train step that donates
    its buffers invalidates the old ones). In any other layout it decodes from a copy (weights wider than the
    model's compute dtype narrowed to it). On the model's own devices that is a layout for decoding (weights
    replicated per data-parallel group, or tensor-parallel), resharded once per generation instead of gathered at
    every token as FSDP shards would be; the copy is made from the synced arrays when a generation starts and freed
    when it ends, so it takes no memory while the learner trains. On other devices (a rollout mesh,
    :func:`jrl.sharding.split_devices`) the copy is made at each :meth:`sync_weights`, device to device
    (:func:`jrl.sharding.reshard`), so generation and training can run at the same time.
    ``pad_id``: the id filling prompt padding and completion slots after a stop (the policy's, see
    :func:`jrl.train.policy_loading.load_policy`). ``prompt_bucket``: prompts are left-padded to
    a multiple of this many tokens, so the program compiles once per bucket. ``kv``: the KV cache's layout; a
    ``paged`` one (:mod:`jrl.rollout.paged`; one part of the prompts per device of a data-parallel layout) generates,
    but keeps no sessions.

    Concurrent use (a producer thread calls :meth:`generate` while the trainer calls :meth:`sync_weights`):
    a ``generate`` call takes the arrays and version of the latest sync once, under a lock, and samples
    from them to the end, so the batch is generated by, and tagged with, exactly one synced version. The
    caller must keep the arrays it synced alive and unchanged while they may be in use; a trainer that
    updates (and donates) its weights during generation syncs a copy (:class:`jrl.sources.rollout.RolloutSource` does
    when prefetching).
    """

    #: Block-parallel sampling for strided EBFT (:meth:`generate_blocks`); conversations continued on their KV
    #: cache (:meth:`start_session`, :meth:`continue_session`).
    capabilities = frozenset({"blocks", "sessions"})

    def __init__(self, model, *, pad_id: int, mesh=None, rules=None, prompt_bucket: int = 32,
                 kv: KVCacheConfig = KVCacheConfig()):
        if prompt_bucket < 1:
            raise ValueError(f"JaxRolloutEngine prompt_bucket={prompt_bucket} must be >= 1")
        model_mesh, model_rules = getattr(model, "mesh", None), getattr(model, "rules", None)
        self.mesh = mesh if mesh is not None else model_mesh
        rules = rules if rules is not None else model_rules
        #: Generation runs on the trainer's own devices (a prefetching trainer on a multi-device mesh takes turns
        #: with it, see :mod:`jrl.sources.rollout`); False on devices of its own.
        self.shares_trainer_devices = _device_ids(self.mesh) == _device_ids(model_mesh)
        self.rules = freeze_rules(rules)
        #: The engine decodes from a copy of the weights in its own layout (else from the model's arrays).
        self.copies_weights = self.mesh is not None and (self.mesh, self.rules) != (model_mesh, freeze_rules(model_rules))
        self.pad_id = int(pad_id)
        self.prompt_bucket = int(prompt_bucket)
        self.kv = kv
        if kv.layout == "paged":  # conversations are not kept (episodes prefill each turn)
            self.capabilities = type(self).capabilities - {"sessions"}
        self._compute_dtype = jnp.dtype(model.config.dtype)
        self._lock = threading.Lock()
        self._own_layouts: dict = {}  # the model's graphdef -> (it constrained to this layout, shardings)
        self.sync_weights(model, 0)

    def _own_copy(self, graphdef, state):
        """(graphdef, state) of a copy of the weights in this engine's layout and the model's compute dtype."""
        if graphdef not in self._own_layouts:  # the model constrained to this layout, and its weights' shardings
            rules = dict(self.rules) if self.rules is not None else None
            own = nnx.split(on_mesh(nnx.merge(graphdef, state), self.mesh, rules))[0]
            self._own_layouts = {graphdef: (own, state_shardings(state, self.mesh, rules))}
            placed = reshard(narrowed(state, self._compute_dtype), self._own_layouts[graphdef][1])
            _report_copy(placed, self.mesh)
            return own, placed
        own, shardings = self._own_layouts[graphdef]
        return own, reshard(narrowed(state, self._compute_dtype), shardings)

    def _weights(self):
        """(graphdef, state, version) of the latest sync, in this engine's layout."""
        with self._lock:
            graphdef, state, version = self._graphdef, self._state, self.version
        if self.copies_weights and self.shares_trainer_devices:
            graphdef, state = self._own_copy(graphdef, state)
        return graphdef, state, version

    def sync_weights(self, model, version: int) -> None:
        """Sample from ``model``'s current arrays from now on (no copy; on devices of its own a copy in this
        engine's layout), tagged ``version``; a ``generate`` call already running keeps the weights it started with."""
        graphdef, state = nnx.split(model)
        if self.copies_weights and not self.shares_trainer_devices:
            graphdef, state = self._own_copy(graphdef, state)
        with self._lock:
            self._graphdef, self._state, self.version = graphdef, state, int(version)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, num_generations: int,
                 seed: int) -> RolloutBatch:
        """``num_generations`` completions per prompt, rows ``p*G .. p*G+G-1``; reproducible for a ``seed``
        (on a given device setup)."""
        return self._generate(prompt_ids, params, num_generations=num_generations, seed=seed, keep=False)[0]

    def start_session(self, prompt_ids: list[list[int]], params: SamplingParams, *, num_generations: int,
                      seed: int) -> tuple[RolloutBatch, DecodeSession]:
        """:meth:`generate`, and a session that continues each row's conversation (:meth:`continue_session`)."""
        return self._generate(prompt_ids, params, num_generations=num_generations, seed=seed, keep=True)

    def continue_session(self, session: DecodeSession, rows: list[int], added: list[list[int]],
                         params: SamplingParams, *, seed: int) -> tuple[RolloutBatch, DecodeSession]:
        """The next turn of rows ``rows`` of ``session``, each after its tokens ``added`` (an observation; may be
        empty): the same tokens and log-probs as :meth:`generate` on the whole conversation so far, without
        prefilling it again (tested with greedy decoding). Sampled with the session's weights; its batch rows are
        ``rows`` in order (its ``prompt_ids`` are the added tokens), and the new session holds only them."""
        if not rows or len(rows) != len(added):
            raise ValueError(f"continue_session: {len(rows)} rows and {len(added)} additions; give one addition per "
                             "row, at least one row")
        if any(not 0 <= r < session.rows for r in rows):
            raise ValueError(f"continue_session: rows {rows} outside the session's {session.rows}")
        rules = dict(self.rules) if self.rules is not None else None
        padded = row_bucket(len(rows), _batch_shards(self.mesh, rules))
        feed = [[int(session.last_tokens[r])] + [int(t) for t in extra] for r, extra in zip(rows, added)]
        width = max(8, row_bucket(max(map(len, feed))))  # bucketed like rows: few programs
        ids = np.full((padded, width), self.pad_id, np.int32)
        mask = np.zeros((padded, width), np.int32)
        for i, tokens in enumerate(feed):
            ids[i, :len(tokens)], mask[i, :len(tokens)] = tokens, 1
        mask[len(feed):, 0] = 1  # bucket rows (stopped) read one token
        source = np.array(list(rows) + [rows[0]] * (padded - len(rows)), np.int32)
        out = _continue(session.graphdef, session.state, session.cache, session.key_mask, session.position, source,
                        place(ids, _ROWS, self.mesh, rules), place(mask, _ROWS, self.mesh, rules),
                        np.int32(len(rows)), jax.random.key(int(seed)), np.float32(params.temperature),
                        np.float32(params.top_p), program=self._program(params))
        batch, state = self._batch(out, len(rows), ids[:len(rows)], mask[:len(rows)], session.version)
        return batch, DecodeSession(*state, last_tokens=self._last_tokens(batch), rows=len(rows),
                                    graphdef=session.graphdef, state=session.state, version=session.version)

    def _program(self, params: SamplingParams) -> _Program:
        return _Program(decoding=Decoding.of(params, self.pad_id), mesh=self.mesh, rules=self.rules)

    def _generate(self, prompt_ids, params: SamplingParams, *, num_generations: int, seed: int, keep: bool):
        check_generate_args(prompt_ids, num_generations)
        if self.kv.layout == "paged":
            if keep:
                raise ValueError("rollout.kv.layout='paged' keeps no decode sessions (multi-turn episodes); use "
                                 "rollout.kv.layout='dense' with an environment")
            return self._generate_paged(prompt_ids, params, num_generations=num_generations, seed=seed), None
        rows = len(prompt_ids) * num_generations
        rules = dict(self.rules) if self.rules is not None else None
        shards = _batch_shards(self.mesh, rules)
        padded_rows = row_bucket(rows, shards)
        # Row r continues prompt r // G; rows past ``rows`` continue the first one, start stopped and are dropped
        # after. Each prompt is prefilled once (prompts bucketed like rows) unless that bucket is the rows' own.
        source = np.array([r // num_generations if r < rows else 0 for r in range(padded_rows)], np.int32)
        padded_prompts = row_bucket(len(prompt_ids), shards)
        if padded_prompts >= padded_rows:  # no fewer prompts than rows to prefill: prefill the rows
            prefill, source = source, np.arange(padded_rows, dtype=np.int32)
        else:
            prefill = [i if i < len(prompt_ids) else 0 for i in range(padded_prompts)]
        ids, mask = left_pad([prompt_ids[i] for i in prefill], self.pad_id, multiple_of=self.prompt_bucket)
        graphdef, state, version = self._weights()
        out = _generate(graphdef, state, place(ids, _ROWS, self.mesh, rules),
                        place(mask, _ROWS, self.mesh, rules), source, np.int32(rows), jax.random.key(int(seed)),
                        np.float32(params.temperature), np.float32(params.top_p), program=self._program(params),
                        keep=keep)
        own = source[:rows]
        batch, kept = self._batch(out, rows, ids[own], mask[own], version)
        if not keep:
            return batch, None
        return batch, DecodeSession(*kept, last_tokens=self._last_tokens(batch), rows=rows, graphdef=graphdef,
                                    state=state, version=version)

    def _device_states(self, state) -> tuple[list, list[int], int]:
        """The weights on each of this process's devices of the mesh (a paged generation runs one part per device),
        those devices' positions among the mesh's, and the mesh's device count: the arrays' own single-device
        shards, which needs every weight whole on every device."""
        if self.mesh is None or self.mesh.size == 1:
            return [state], [0], 1
        leaves = jax.tree.leaves(state)
        split = [x for x in leaves if isinstance(x, jax.Array) and not x.sharding.is_fully_replicated]
        if split:
            raise ValueError(f"rollout.kv.layout='paged' needs the whole model on every device of the sampler's mesh "
                             f"({len(split)} weights are split over it); use a data-parallel rollout.mesh (the "
                             "default, data=-1 fsdp=1 tensor=1) or rollout.kv.layout='dense'")

        def on(device):
            def shard(x):
                if not isinstance(x, jax.Array):
                    return x
                return next(s.data for s in x.addressable_shards if s.device == device)
            return jax.tree.map(shard, state)

        devices = list(self.mesh.devices.flat)
        mine = [i for i, d in enumerate(devices) if d.process_index == jax.process_index()]
        return [on(devices[i]) for i in mine], mine, len(devices)

    def paged_generation(self, prompt_ids, params: SamplingParams, *, num_generations: int, seed: int) -> dict:
        """What :meth:`generate` computes with ``kv.layout='paged'``, as :func:`jrl.rollout.paged.generate_paged`
        returns it (the rows' arrays and the pool's counts: pages, preemptions, rounds), and the weights' version."""
        return self.paged_groups(new_groups(prompt_ids, num_generations), params, seed=seed)

    def paged_groups(self, groups: list[RowGroup], params: SamplingParams, *, seed: int,
                     groups_needed: int | None = None, slots: int = 0, keep: bool = False) -> dict:
        """Rows of ``groups`` (new ones, or ones that continue tokens sampled earlier) decoded with the paged cache,
        until ``groups_needed`` groups are finished (all: None), as :func:`jrl.rollout.paged.generate_paged` returns
        them (``slots``: its slot count where ``rollout.kv.slots`` is 0; ``keep``: with the unfinished rows' keys
        and values), and the weights' version."""
        if self.kv.layout != "paged":
            raise ValueError("paged_groups needs rollout.kv.layout='paged'")
        graphdef, state, version = self._weights()
        states, positions, device_count = self._device_states(state)
        return generate_paged(graphdef, states, groups, params, seed=seed, kv=self.kv, pad_id=self.pad_id,
                              prompt_bucket=self.prompt_bucket, slot_bucket=row_bucket, groups_needed=groups_needed,
                              slots=slots, keep=keep, positions=positions,
                              device_count=device_count) | dict(version=version)

    def _generate_paged(self, prompt_ids, params: SamplingParams, *, num_generations: int, seed: int) -> RolloutBatch:
        out = self.paged_generation(prompt_ids, params, num_generations=num_generations, seed=seed)
        if out["preempted"]:
            logger.warning("paged sampler: %d rows gave their pages back and started again (a pool of %d pages per "
                           "device; the rows held at most %d pages, all devices together): their tokens are decoded "
                           "twice; set rollout.kv.slots lower (fewer rows at once) or rollout.kv.pages higher where "
                           "memory allows",
                           out["preempted"], out["pool"], out["peak_pages"])
        return rollout_of(out, [prompt_ids[r // num_generations] for r in range(len(out["tokens"]))],
                          pad_id=self.pad_id, prompt_bucket=self.prompt_bucket, version=out["version"])

    @staticmethod
    def _batch(out, rows: int, prompt_ids, prompt_mask, version: int) -> tuple[RolloutBatch, tuple]:
        """The host batch of a program's first ``rows`` rows, and its session state (when it returned one)."""
        tokens, completion_mask, logprobs, stopped = (x[:rows] for x in gather_to_host(out[:4]))
        batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=tokens,
                             completion_mask=completion_mask, sampling_logprobs=logprobs.astype(np.float32),
                             truncated=~stopped.astype(bool), policy_version=version)
        return batch, out[4] if len(out) > 4 else ()

    @staticmethod
    def _last_tokens(batch: RolloutBatch) -> np.ndarray:
        count = np.asarray(batch.completion_mask).sum(-1)
        return np.asarray(batch.completion_ids)[np.arange(len(count)), np.maximum(count - 1, 0)]

    def close(self) -> None:
        """Nothing to release: the engine holds the trainer's arrays, or a copy that goes with the engine."""

    def generate_blocks(self, doc_ids, anchors, *, context_length: int, generate_len: int, num_samples: int,
                        params: SamplingParams, seed: int) -> tuple[StridedSamples, int]:
        """Strided EBFT's block-parallel samples (:func:`jrl.rollout.strided_sampler.generate_blocks`) from the
        weights of the latest sync, and that sync's version."""
        graphdef, state, version = self._weights()
        samples = generate_blocks(nnx.merge(graphdef, state), doc_ids, anchors, context_length=context_length,
                                  generate_len=generate_len, num_samples=num_samples, params=params, seed=seed)
        return samples, version


@ROLLOUT_ENGINES.register("jax")
def make_jax_engine(model, *, pad_id: int, mesh, rules, rollout, output_dir) -> JaxRolloutEngine:
    """The ``jax`` backend: the embedded sampler on the trained model (weights shared in memory)."""
    del output_dir  # nothing written
    return JaxRolloutEngine(model, pad_id=pad_id, mesh=mesh, rules=rules, kv=rollout.kv)


#: Config fields the embedded engine does not read (it shares the trainer's arrays: no transport, no server).
make_jax_engine.ignores = ("rollout.sync", "rollout.vllm")
make_jax_engine.capabilities = JaxRolloutEngine.capabilities
