"""The embedded sampler with a paged KV cache and continuous batching (``rollout.kv.layout = "paged"``).

A generation of N rows (``num_generations`` per prompt) runs in three parts:

1. **Prefill**: every prompt once, right-aligned at slot 0, into pages of the pool (``page_size`` slots each). Its
   full pages are shared, read-only, by the prompt's rows; a row whose prompt ends inside a page starts with a copy
   of that page (its own, so its tokens continue in it). The prompts' last logits are kept for the rows to start
   from.
2. **Decode in slots**: ``slots`` rows decode at once, each writing and reading its cache through a page table
   (:func:`jrl.kernels.attention.paged_decode_attention_append`). The device runs ``kv.round_steps`` steps at a time
   (one jitted program, a loop of fixed trip count: a GPU runs its steps back to back); between two such rounds
   the host scheduler (:class:`PageScheduler`) frees the pages of rows that stopped, gives each waiting row a free
   slot (continuous batching), and gives each running row the pages its next round's tokens need. When the pool
   has no page left, the row admitted last gives its pages back and waits to start again (preemption, as vLLM's
   scheduler does); the oldest row always goes on, so every generation ends. Once no row waits and at most half
   the slots run, the running rows move into fewer slots (``kv.tail_slots``), so a long tail decodes in a smaller
   program; once the slots are as few as they get, the host launches the next round before it reads the last one
   back (two at a time), so that the device does not wait for the host's work between them (a whole generation
   only: one that stops at enough groups reads every round before it decides to go on).
3. Rows come back in their order, padded to ``max_new_tokens`` like the dense sampler's.

Sampling: token i of row r is drawn with the key ``fold_in(fold_in(key(seed), r), i)``, so a row's tokens do not
depend on the slots, the pool or when the row ran (a preempted row samples the same tokens again). The dense
sampler draws one key per step for all rows instead; the two agree in distribution, not token for token (they
agree token for token when sampling is near greedy, which the tests use).

Memory: the pool holds the prompts once and ``slots`` rows' completions as they grow, against the dense layout's
``rows x (prompt + max_new_tokens)`` slots.

Rows continued later (partial rollouts): with ``keep`` a generation that ends before every row is done copies the
unfinished rows' pages and next-token logits out of its pool (:class:`KeptPages`, a compact array per device); a
later generation given those rows (:attr:`RowGroup.kept`) copies their pages into its own pool, instead of
prefilling each row's prompt and tokens. A group given the device that kept its rows (:attr:`RowGroup.home`, which
every process learns from the generation's ``home``) decodes on that device again, so its pages never leave it:
that is what lets a process continue its own carried rows when a generation spans several; a group kept without
one is moved to the device its part is on (one process only).

Several devices (a data-parallel sampler mesh, every device holding the whole model): each device takes a part of
the prompts with all their rows (:func:`device_parts`: as many rows each as the groups sent home allow), and runs
its own pool, slots and scheduler. Each device's
parts (its prefill, then each round: schedule, decode, read back) run in a thread of their own, the rounds in step
(the stop test after every device's round, so a partial generation stops at the same groups whatever the timing):
each thread waits for its own device's round and does its host work while the other devices' rounds run, where one
thread would read the devices' rounds back one after another. ``slots`` and ``pages`` are per
device. Several processes (hosts) split the groups the same way over all the mesh's devices; each decodes its own
devices' parts and the rows are gathered to every process when the generation ends (:func:`generate_paged`), in the
groups' order.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.models.layers import PageSlots, PagedKV
from jrl.models.lora import decoding_view
from jrl.models.static_graph import split_static
from jrl.models.transformer import on_mesh
from jrl.data.pipeline import left_pad
from jrl.rollout.base import RolloutBatch, SamplingParams
from jrl.rollout.kv_config import KVCacheConfig
from jrl.rollout.sampling import Decoding, Draw
from jrl.sharding.distributed import host_allgather
from jrl.sharding.memory import memory_limit

SCRATCH_PAGE = 0
"""The pool's page 0 holds no row's slots: a decode step's writes of rows with nothing to write go there."""


def unwritten(count: int, pool: int) -> np.ndarray:
    """``count`` distinct page ids past the end of a pool of ``pool`` pages: the targets of page writes that are to
    be dropped (:func:`_set_pages`)."""
    return pool + np.arange(count, dtype=np.int32)


def _set_pages(pages: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """``pages`` [K, P, page, D] with page ``ids[i]`` set to ``values[:, i]``; ids past the pool are dropped.

    The ids must be distinct (a write with nothing to write goes to an id of :func:`unwritten`, not to a shared
    scratch page), and the scatter is told so: with repeated ids (the padding past every sequence's end sent to one
    scratch page) XLA's GPU scatter took ~13 ms per layer and prefill call of 32 MB of keys on an H200, most of a
    partial rollout's prefill (benchmarks/RESULTS.md, "Where a partial step's time goes")."""
    return pages.at[:, ids].set(values, mode="drop", unique_indices=True)


def slot_occupancy(counts: dict) -> float:
    """The share of the decode rounds' slot steps that decoded a token, from :func:`generate_paged`'s counts (or
    their sums over several generations)."""
    return counts["decoded_tokens"] / max(counts["slot_steps"], 1)


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def power_of_two_at_least(count: int) -> int:
    """``count`` rounded up to a power of two (1 for 0): a bucketed size, so that few shapes compile."""
    return 1 << max(count - 1, 0).bit_length()


#: Up to this many slots a decode round's slot count is a power of two whatever ``kv.slot_buckets`` says: so few rows
#: are bound by reading the weights, so empty slots cost little, and the decode kernels' row limits are powers of two.
FINE_SLOTS_FROM = 128


def decode_slots(rows: int, slot_buckets: int) -> int:
    """The slots a decode round of ``rows`` rows runs with: the next power of two, or above
    :data:`FINE_SLOTS_FROM` the next of ``slot_buckets`` even steps between the powers of two around it
    (``rollout.kv.slot_buckets``)."""
    top = power_of_two_at_least(rows)
    if slot_buckets == 1 or top <= FINE_SLOTS_FROM:
        return top
    step = top // 2 // slot_buckets
    return -(-rows // step) * step


@dataclasses.dataclass(frozen=True)
class PagedProgram:
    """Everything static about one compiled decode round (its jit cache key besides the array shapes)."""

    decoding: Decoding
    page_size: int


#: Tokens one prefill call takes at most (sequences x padded width): its dense keys and values are temporaries beside
#: the pool, so long prompts or a partial rollout's long carried rows are prefilled in several calls.
PREFILL_TOKENS = 32768


@functools.partial(jax.jit, static_argnames=("graph", "pool", "page_size", "dtype"), keep_unused=True)
def _empty_pool(graph, weights, *, pool: int, page_size: int, dtype) -> tuple[PagedKV, ...]:
    """A zeroed pool on the device of ``weights`` (they are unused, and kept as arguments so that they place the
    program: without them it runs on the default device, and one process's generations on other devices would each
    allocate their pool on the first device before moving it)."""
    return graph.merge(weights).init_pages(pool, page_size, dtype)


@functools.partial(jax.jit, static_argnames=("graph", "page_size"), donate_argnames=("cache",))
def _prefill(graph, weights, cache, ids: jax.Array, mask: jax.Array, page_ids: jax.Array, *, page_size: int):
    """The pool ``cache`` with the right-padded sequences ``ids`` [P, L] (``mask``) written to pages ``page_ids``
    [P, L / page_size] (distinct, those past a sequence's end past the pool: :func:`unwritten`), and each sequence's
    last logits [P, V]."""
    model = graph.merge(weights)
    (p, length), lengths = ids.shape, jnp.sum(mask, axis=-1)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (p, length))
    hidden, dense = model.decode(ids, positions, mask.astype(bool), model.init_cache(p, length), 0)
    logits = model.logits(hidden[jnp.arange(p), lengths - 1])
    flat = page_ids.reshape(-1)

    def paged(x):  # [P, L, K, D] -> the sequences' pages [K, P * L / page, page, D]
        k, d = x.shape[2:]
        return x.reshape(p, length // page_size, page_size, k, d).transpose(3, 0, 1, 2, 4).reshape(
            k, -1, page_size, d)

    stored = [c.as_stored(paged(d.k), paged(d.v)) for c, d in zip(cache, dense, strict=True)]
    pages = tuple(PagedKV(_set_pages(c.k, flat, k), _set_pages(c.v, flat, v)) for c, (k, v) in zip(cache, stored))
    return pages, logits


def _draw(key, rows, generated, logits, temperature, top_p, draw: Draw):
    """One token per slot, slot s's from the key of (row ``rows[s]``, its token ``generated[s]``)."""
    def one(row, index, row_logits):
        k = jax.random.fold_in(jax.random.fold_in(key, row), index)
        token, logprob = draw(k, row_logits[None], temperature=temperature, top_p=top_p)
        return token[0], logprob[0]

    return jax.vmap(one)(rows, generated, logits)


@functools.partial(jax.jit, donate_argnames=("logits",))
def _admit(logits, prompt_logits, admit_prompt):
    """The slots' next-token logits [S, V] with those of slots admitting a row (``admit_prompt`` >= 0) replaced by
    their prompt's. A program of its own: its shape follows the generation's prompt count, the decode round's not."""
    return jnp.where((admit_prompt >= 0)[:, None], prompt_logits[jnp.maximum(admit_prompt, 0)], logits)


@jax.jit
def _take_rows(logits, keep):
    return logits[keep]


def _round(graph, weights, cache, logits, page_table, lengths, generated, rows, active, copy_src, copy_dst,
           key, temperature, top_p, *, program: PagedProgram, steps: int):
    """``steps`` decode steps of S slots (a slot that stopped decodes nothing more: its steps read and write no page,
    and its tokens are not real). The trip count is fixed, not cut short once no slot is active: a GPU then runs
    the steps back to back, where a loop whose condition reads the device would stop the host on every step to read
    it before launching the next one. First the round's admissions
    (their logits are in place already, :func:`_admit`): page ``copy_src[s]`` is copied to ``copy_dst[s]`` (a
    prompt's partial last page to a new row's own; where nothing is copied, to a distinct id past the pool).
    Slot s holds row ``rows[s]`` with ``lengths[s]`` cache slots filled and ``generated[s]`` tokens sampled.
    Returns the cache, logits, lengths, generated counts and still-active slots after the round, and its tokens,
    log-probs and which of them are real ([S, steps])."""
    p, d = program, program.decoding
    model = graph.merge(weights)
    n = rows.shape[0]
    cache = tuple(PagedKV(_set_pages(c.k, copy_dst, c.k[:, copy_src]), _set_pages(c.v, copy_dst, c.v[:, copy_src]))
                  for c in cache)
    slot_ids = jnp.arange(n)
    carry = dict(cache=cache, logits=logits, lengths=lengths, generated=generated, active=active,
                 tokens=jnp.full((n, steps), d.pad_id, jnp.int32), logprobs=jnp.zeros((n, steps), jnp.float32),
                 real=jnp.zeros((n, steps), bool))

    def body(i, c):
        on = c["active"]
        token, logprob = _draw(key, rows, c["generated"], c["logits"], temperature, top_p, d.draw)
        token = jnp.where(on, token, d.pad_id)
        generated = c["generated"] + on
        done = d.is_stop(token) | (generated >= d.max_new_tokens)
        go_on = on & ~done  # rows whose token is decoded: its keys and values are the next step's context
        at = c["lengths"]
        page = jnp.where(go_on, page_table[slot_ids, at // p.page_size], SCRATCH_PAGE)
        # A row that writes nothing reads nothing either (length 0): its output is not used.
        slots = PageSlots(page_table=page_table, lengths=jnp.where(go_on, at + 1, 0), page=page,
                          offset=jnp.where(go_on, at % p.page_size, 0))
        hidden, cache = model.decode_paged(token[:, None], at[:, None], c["cache"], slots)
        return dict(cache=cache, logits=model.logits(hidden[:, 0]), lengths=at + go_on, generated=generated,
                    active=go_on, tokens=c["tokens"].at[:, i].set(token),
                    logprobs=c["logprobs"].at[:, i].set(jnp.where(on, logprob, 0.0)), real=c["real"].at[:, i].set(on))

    out = jax.lax.fori_loop(0, steps, body, carry)
    return (out["cache"], out["logits"], out["lengths"], out["generated"], out["active"], out["tokens"],
            out["logprobs"], out["real"])


#: XLA options of a decode round on a GPU: the dot merger off. It joins the products that share an input (the gate and
#: up projections; q, k and v) into one against their weights concatenated, and where the rows are many enough for
#: cuBLAS to run that product the concatenation is a copy of both weights on every decode step (the 1B shape's gate
#: and up: 64 MiB, 33 us per layer, ~0.5 ms a step). Without it a long-tailed partial generation's decode step took
#: 4.8% less on an H200, 3.8% more tokens/s (benchmarks/RESULTS.md).
GPU_ROUND_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


@functools.cache
def _round_program(backend: str):
    return jax.jit(_round, static_argnames=("graph", "program", "steps"), donate_argnames=("cache", "logits"),
                   compiler_options=GPU_ROUND_OPTIONS if backend == "gpu" else None)


def _decode_round(*args, **kwargs):
    """:func:`_round` compiled for the default backend (on a GPU with :data:`GPU_ROUND_OPTIONS`)."""
    return _round_program(jax.default_backend())(*args, **kwargs)


@dataclasses.dataclass
class _Slot:
    row: int
    own: list[int]  # the row's own pages (the prompt's shared ones are not freed with it)
    admitted: int  # admission order: the latest admitted is preempted first


class PageScheduler:
    """The host side of paged decoding: the free pages, which row each slot holds and each row's pages.

    ``prompt_pages[i]``: the pages of prefilled sequence i (a prompt, or a prompt and the tokens a row already has;
    its last page partial when ``prompt_lengths[i] % page_size``); row r continues sequence ``row_prompt[r]`` and
    fills at most ``row_slots[r]`` cache slots (its sequence and the tokens it may still sample): a round's pages are
    taken for its steps but never past that."""

    def __init__(self, *, slots: int, free: list[int], prompt_pages: list[list[int]], prompt_lengths: list[int],
                 row_prompt: list[int], row_slots: list[int], page_size: int, table_width: int):
        self.page_size, self.row_prompt, self.row_slots = page_size, row_prompt, row_slots
        self.free = list(reversed(free))  # a stack: the lowest page ids are taken first
        self.prompt_pages, self.prompt_lengths = prompt_pages, prompt_lengths
        self.slots: list[_Slot | None] = [None] * slots
        self.waiting = collections.deque(range(len(row_prompt)))
        self.page_table = np.zeros((slots, table_width), np.int32)
        self.lengths = np.zeros(slots, np.int32)
        self.preempted = 0
        self.peak_pages = 0  # the most pages rows owned at once (the prompts' pages not counted)
        self._admissions = 0

    def _shared_count(self, prompt: int) -> int:
        """How many of the prompt's pages a row reads without owning them: its full ones."""
        return self.prompt_lengths[prompt] // self.page_size

    def _shared(self, prompt: int) -> list[int]:
        """The prompt's pages a row reads without owning them (:meth:`_shared_count`)."""
        return self.prompt_pages[prompt][:self._shared_count(prompt)]

    def _lacking(self, row: int, length: int, own: int, steps: int) -> int:
        """Pages row ``row`` (``length`` slots filled, ``own`` pages of its own) lacks for its next ``steps`` tokens,
        never past its last slot."""
        have = self._shared_count(self.row_prompt[row]) + own
        return max(pages_for(min(length + steps, self.row_slots[row]), self.page_size) - have, 0)

    def _need(self, slot: int, steps: int) -> int:
        """Pages slot ``slot``'s row lacks for its next ``steps`` tokens."""
        s = self.slots[slot]
        return self._lacking(s.row, int(self.lengths[slot]), len(s.own), steps)

    def _take(self, slot: int, count: int) -> None:
        """``count`` free pages for slot ``slot``'s row, after its pages in the table (only these are written: a
        round's host work is the same for a long row as for a short one)."""
        if not count:
            return
        s = self.slots[slot]
        start = self._shared_count(self.row_prompt[s.row]) + len(s.own)
        pages = [self.free.pop() for _ in range(count)]
        s.own += pages
        self.page_table[slot, start:start + count] = pages

    def release(self, slot: int) -> int:
        """Free slot ``slot`` and its row's own pages; returns the row."""
        s = self.slots[slot]
        self.free.extend(reversed(s.own))
        self.slots[slot] = None
        self.page_table[slot] = SCRATCH_PAGE
        return s.row

    def shrink(self, size: int) -> np.ndarray:
        """Keep ``size`` slots (at least the running rows'), the running rows in the first ones in slot order;
        returns the old slot of each slot kept."""
        running = [i for i, s in enumerate(self.slots) if s is not None]
        if size < len(running):
            raise ValueError(f"cannot keep {len(running)} running rows in {size} slots")
        keep = np.array((running + [i for i, s in enumerate(self.slots) if s is None])[:size])
        self.slots = [self.slots[i] for i in keep]
        self.page_table, self.lengths = self.page_table[keep], self.lengths[keep]
        return keep

    def running(self) -> np.ndarray:
        """[slots] bool: the slots that hold a row."""
        return np.array([s is not None for s in self.slots])

    def pages_needed(self, steps: int) -> int:
        """Pages the running rows lack for their next ``steps`` tokens."""
        return sum(self._need(slot, steps) for slot, s in enumerate(self.slots) if s is not None)

    def schedule(self, steps: int) -> tuple[dict[int, int], list[int]]:
        """Make room for every running row's next ``steps`` tokens, oldest first, preempting the rows admitted last
        when the pool runs out; then fill free slots with waiting rows while pages allow. Returns the admissions
        (slot -> row) and the rows preempted (back at the front of the waiting queue, to start again)."""
        preempted: list[int] = []
        for slot in sorted((i for i, s in enumerate(self.slots) if s is not None),
                           key=lambda i: self.slots[i].admitted):
            if self.slots[slot] is None:  # preempted for an older row
                continue
            need = self._need(slot, steps)
            while need > len(self.free) and self.slots[slot] is not None:
                youngest = max((i for i, s in enumerate(self.slots) if s is not None),
                               key=lambda i: self.slots[i].admitted)
                row = self.release(youngest)
                preempted.append(row)
                self.waiting.appendleft(row)
                self.preempted += 1
            if self.slots[slot] is not None:
                self._take(slot, need)
        admitted: dict[int, int] = {}
        for slot in range(len(self.slots)):
            if self.slots[slot] is not None or not self.waiting:
                continue
            row = self.waiting[0]
            prompt = self.row_prompt[row]
            if self._lacking(row, self.prompt_lengths[prompt], 0, steps) > len(self.free):
                break
            self.waiting.popleft()
            self.slots[slot] = _Slot(row=row, own=[], admitted=self._admissions)
            self._admissions += 1
            self.lengths[slot] = self.prompt_lengths[prompt]
            self.page_table[slot] = SCRATCH_PAGE
            shared = self._shared(prompt)
            self.page_table[slot, :len(shared)] = shared
            self._take(slot, self._need(slot, steps))
            admitted[slot] = row
        self.peak_pages = max(self.peak_pages, sum(len(s.own) for s in self.slots if s is not None))
        return admitted, preempted


#: Share of a device's free memory (at the start of a generation, the trained model's state and the sampler's weights
#: already in) a default pool may take; the rest is for the prefill's and the decode steps' temporaries.
POOL_FREE_FRACTION = 0.7


def pool_pages(kv: KVCacheConfig, *, slots: int, prompt_pages: int, prompt_bucket_pages: int,
               max_new_tokens: int, page_bytes: int = 0, free_bytes: int | None = None) -> int:
    """The pool's size: ``kv.pages`` (an error when it cannot hold the ``prompt_pages`` and one whole row), or
    enough for every slot's longest completion beside ``prompt_bucket_pages`` (the prompt pages of the generation's
    buckets), rounded up to a power of two (the size is a compiled shape: calls whose prompts differ in length or
    number share it), capped at
    :data:`POOL_FREE_FRACTION` of ``free_bytes`` (the device's free memory, pages of ``page_bytes``; no cap where a
    device does not tell) but never below one whole row's: rows beyond it wait or are preempted."""
    per_row = pages_for(max_new_tokens, kv.page_size) + 1  # a row's completion, and a partial prompt page's copy
    least = 1 + prompt_pages + per_row
    if kv.pages and kv.pages < least:
        raise ValueError(f"rollout.kv.pages={kv.pages} cannot hold one whole row of this generation (scratch page + "
                         f"{prompt_pages} prompt pages + {per_row} for a completion of {max_new_tokens} tokens); "
                         f"use rollout.kv.pages >= {least}, or 0 for enough for every slot")
    if kv.pages:
        return kv.pages
    need = 1 + prompt_bucket_pages + slots * per_row
    pool = power_of_two_at_least(need)  # a run's pools take few sizes (each compiles its programs)
    if free_bytes is not None and page_bytes > 0:
        fits = int(POOL_FREE_FRACTION * free_bytes) // page_bytes
        if fits < pool:  # what is needed where it fits, else a power of two below what fits
            pool = need if need <= fits else max(1 + prompt_bucket_pages + per_row,
                                                 1 << (fits.bit_length() - 1) if fits > 0 else 0)
    return pool


def _device(state) -> jax.Device | None:
    """The device holding ``state`` (a generation's weights, whole on one device), or None where it holds no array."""
    leaf = next((x for x in jax.tree.leaves(state) if isinstance(x, jax.Array)), None)
    return None if leaf is None else next(iter(leaf.devices()))


def _free_bytes(device: jax.Device | None) -> int | None:
    """Free memory of ``device`` (None where it does not say, e.g. CPU, or there is none)."""
    if device is None:
        return None
    limit = memory_limit(device)
    return None if limit is None else int(limit) - int((device.memory_stats() or {}).get("bytes_in_use", 0))


@dataclasses.dataclass(frozen=True, eq=False)
class KeptPages:
    """The keys and values of a generation's unfinished rows on one device, copied out of its pool when it ends,
    and each row's next-token logits: a later generation continues those rows from them instead of prefilling
    their prompt and tokens again (partial rollouts with ``rollout.partial_kv = "keep"``). Row i's cache slots are
    pages ``first[i]`` on (``pages_for(lengths[i], page_size)`` of them) of ``cache``; its logits ``logits[i]``."""

    cache: tuple[PagedKV, ...]
    """Per layer, ``k`` and ``v`` [K, pages, page_size, D]."""
    logits: jax.Array
    first: tuple[int, ...]
    lengths: tuple[int, ...]
    page_size: int


@dataclasses.dataclass(frozen=True, eq=False)
class KeptRow:
    """Row ``index`` of ``pages``: a prompt and the tokens a row has, as a generation left them."""

    pages: KeptPages
    index: int

    @property
    def length(self) -> int:
        """Cache slots the row fills: its prompt and its tokens so far."""
        return self.pages.lengths[self.index]

    def page_ids(self) -> list[int]:
        """The row's pages in :attr:`KeptPages.cache`."""
        first = self.pages.first[self.index]
        return list(range(first, first + pages_for(self.length, self.pages.page_size)))


def _bucketed(values, dtype=np.int32) -> np.ndarray:
    """``values`` padded with zeros to a power-of-two length (the compiled shapes of the page copies)."""
    out = np.zeros(power_of_two_at_least(len(values)), dtype)
    out[:len(values)] = values
    return out


@jax.jit
def _take_pages(cache, ids):
    """Pages ``ids`` of every layer's ``cache`` (a pool, or kept pages)."""
    return tuple(PagedKV(c.k[:, ids], c.v[:, ids]) for c in cache)


@functools.partial(jax.jit, donate_argnames=("cache",))
def _put_pages(cache, pages, ids):
    """The pool ``cache`` with ``pages`` (every layer's) written to page ``ids`` (distinct; past the pool: dropped)."""
    return tuple(PagedKV(_set_pages(c.k, ids, p.k), _set_pages(c.v, ids, p.v)) for c, p in zip(cache, pages))


@jax.jit
def _kept_logits(slot_logits, sequence_logits, from_slot, index):
    """Row i's logits: slot ``index[i]``'s where ``from_slot[i]``, else sequence ``index[i]``'s."""
    return jnp.where(from_slot[:, None], slot_logits[index], sequence_logits[index])


def _place(cache, rows: list[tuple[KeptRow, list[int]]], *, pool: int,
           device) -> tuple[tuple, jax.Array, np.ndarray]:
    """The pool ``cache`` with each kept row's pages copied to its page ids (``rows``: (row, ids) pairs), moved to
    ``device`` where they were kept on another; the rows' logits (in a bucketed count of rows) and the index of
    each row's among them."""
    by_store: dict[int, list[int]] = collections.defaultdict(list)
    for j, (row, _) in enumerate(rows):
        by_store[id(row.pages)].append(j)
    parts, at, offset = [], np.zeros(len(rows), np.int32), 0
    for members in by_store.values():
        store = rows[members[0]][0].pages
        src = [p for j in members for p in rows[j][0].page_ids()]
        dst = [p for j in members for p in rows[j][1]]
        src_ids = _bucketed(src)
        dst_ids = unwritten(len(src_ids), pool)
        dst_ids[:len(dst)] = dst
        index = _bucketed([rows[j][0].index for j in members])
        pages, logits = _take_pages(store.cache, src_ids), _take_rows(store.logits, index)
        if device is not None and device not in store.logits.devices():
            pages, logits = jax.device_put((pages, logits), device)
        cache = _put_pages(cache, pages, dst_ids)
        parts.append(logits)
        at[members], offset = offset + np.arange(len(members)), offset + len(index)
    return cache, parts[0] if len(parts) == 1 else jnp.concatenate(parts), at


@dataclasses.dataclass(frozen=True)
class RowGroup:
    """The rows of one prompt a paged generation decodes: ``prompt`` and each row's tokens sampled already
    (``prefixes``, empty for a new row: a row continues after its prefix, its tokens counted against
    ``max_new_tokens``), and the row ids whose sampling keys the rows use (``keys``)."""

    prompt: list[int]
    prefixes: list[list[int]]
    keys: list[int]
    kept: tuple[KeptRow | None, ...] = ()
    """Per row (empty: none), the keys and values a previous generation left for its prompt and prefix
    (:class:`KeptRow`): that row is placed into the pool instead of prefilled."""
    home: int | None = None
    """The position, among the sampler mesh's devices, of the device holding ``kept`` (:func:`generate_paged`'s
    ``home``): the group decodes there. Needed across processes, where a process holds only its own devices' kept
    rows (its ``kept`` entries for others' are None); None: any device."""


def _water_level(loads: list[float], amount: float) -> float:
    """The level ``L`` at which ``amount`` poured over ``loads`` settles: ``sum(max(L - load, 0)) == amount``."""
    ordered = sorted(loads)
    for k in range(1, len(ordered) + 1):
        level = (amount + sum(ordered[:k])) / k
        if k == len(ordered) or level <= ordered[k]:
            return level
    return 0.0


def device_parts(groups: list[RowGroup], device_count: int) -> list[np.ndarray]:
    """The groups (indices, ascending) each of ``device_count`` device positions decodes, balanced by rows (a
    carried group may hold one running row, a new one ``num_generations``). A group with a :attr:`RowGroup.home`
    goes there; the others, in order, are laid along the positions' room (each position filled up to the level its
    homed rows leave, :func:`_water_level`, so that every position ends with about as many rows) and a group goes
    to the position its middle row falls in: each position's groups are contiguous and a position is off its room by
    at most one group. Without homes, groups of equal size split as ``np.array_split`` does where they divide evenly
    (one group more or less per position otherwise). Every process computes the same parts from the same groups."""
    sizes = [len(g.prefixes) for g in groups]
    parts: list[list[int]] = [[] for _ in range(device_count)]
    loads = [0] * device_count
    for i, group in enumerate(groups):
        if group.home is not None:
            if not 0 <= group.home < device_count:
                raise ValueError(f"group {i}'s home, device position {group.home}, is not one of the sampler mesh's "
                                 f"{device_count} devices")
            parts[group.home].append(i)
            loads[group.home] += sizes[i]
    free = [i for i, group in enumerate(groups) if group.home is None]
    level = _water_level(loads, sum(sizes[i] for i in free))
    edges = np.cumsum([max(level - load, 0.0) for load in loads])  # position p's room ends at edges[p]
    laid = 0
    for i in free:
        position = int(np.searchsorted(edges, laid + sizes[i] / 2, side="right"))
        parts[min(position, device_count - 1)].append(i)
        laid += sizes[i]
    return [np.array(sorted(part), np.int64) for part in parts]


class _Generation:
    """One device's part of a paged generation: some groups, each prompt prefilled once for the rows that start
    afresh and once more with each prefix for the rows that continue one. :meth:`dispatch` schedules and starts a
    decode round; :meth:`collect` reads it back."""

    def __init__(self, graphdef, state, groups: list[RowGroup], params: SamplingParams, *, kv: KVCacheConfig,
                 pad_id: int, prompt_bucket: int, slot_bucket, prefill_tokens: int = PREFILL_TOKENS,
                 slots: int = 0):
        page = kv.page_size
        self.page, self.steps, self.params = page, kv.round_steps, params
        self.tail_slots = kv.tail_slots
        sequences, row_prompt, self.row_start, self.row_keys, self.row_group = [], [], [], [], []
        placed: dict[int, KeptRow] = {}  # sequence -> the kept keys and values it is placed from (not prefilled)
        for k, group in enumerate(groups):
            shared = None  # the prompt's own sequence, shared by the group's new rows
            kept = group.kept or (None,) * len(group.prefixes)
            for prefix, key, row_kv in zip(group.prefixes, group.keys, kept, strict=True):
                if prefix:
                    sequences.append(list(group.prompt) + list(prefix))
                    if row_kv is not None:
                        if row_kv.length != len(sequences[-1]) or row_kv.pages.page_size != page:
                            raise ValueError(f"a kept row of {row_kv.length} slots in pages of "
                                             f"{row_kv.pages.page_size} continues a prompt and prefix of "
                                             f"{len(sequences[-1])} tokens with pages of {page}")
                        placed[len(sequences) - 1] = row_kv
                elif shared is None:
                    sequences.append(list(group.prompt))
                    shared = len(sequences) - 1
                row_prompt.append(len(sequences) - 1 if prefix else shared)
                self.row_start.append(len(prefix))
                self.row_keys.append(key)
                self.row_group.append(k)
        self.rows = len(row_prompt)
        self.lengths = [len(x) for x in sequences]
        # Widths padded to a power of two (at least a page and a prompt bucket): with the bucketed sequence and slot
        # counts, the few shapes a run's programs compile for. Prefilled sequences: the prompts at the prompts' width,
        # a partial rollout's carried rows (prompt and tokens so far, of every length) each in the power-of-two width
        # that holds it, so a long carried row does not widen every prompt's prefill. A row's slots never pass its
        # prompt plus max_new_tokens (a continued row's prefix counts in both), so the page table's width follows the
        # prompts alone: continued rows do not change the round.
        def padded(tokens: int) -> int:
            return max(math.lcm(page, prompt_bucket), 1 << (tokens - 1).bit_length())

        prompt_span = padded(max(len(g.prompt) for g in groups))
        by_width = collections.defaultdict(list)  # width -> the sequences prefilled at it
        for i, n in enumerate(self.lengths):
            if i not in placed:
                by_width[max(prompt_span, padded(n))].append(i)
        buckets = sorted((w, idx, slot_bucket(len(idx))) for w, idx in by_width.items())
        # A caller's ``slots`` (the most rows its calls have) gives every call one program; finer slot buckets
        # (``kv.slot_buckets``) trade that for slots that follow the rows.
        self.slot_buckets = kv.slot_buckets
        if kv.slots:
            self.slots = decode_slots(min(kv.slots, self.rows), kv.slot_buckets)
        else:
            self.slots = decode_slots(slots if slots and kv.slot_buckets == 1 else self.rows, kv.slot_buckets)
        # The view a decode step runs on (layers unstacked, adapters merged, no mesh: the arrays are this device's),
        # made once for the whole generation.
        view = decoding_view(on_mesh(nnx.merge(graphdef, state), None))
        self.graph, weights = split_static(view)  # the structure: a static argument of every program here
        self.device = _device(weights)
        # Committed to their device (no copy): the programs' outputs then are too, so that the first decode round (the
        # pool from the prefill) and the later ones (the pool from a round) call one compiled program, not two.
        self.weights = weights if self.device is None else jax.device_put(weights, self.device)
        pool_dtype = kv.pool_dtype(view.config.dtype)
        page_bytes = view.config.kv_bytes_per_token(pool_dtype) * page
        self.pool = pool_pages(kv, slots=self.slots, prompt_pages=sum(pages_for(n, page) for n in self.lengths),
                               prompt_bucket_pages=sum(count * (w // page) for w, _, count in buckets)
                               + sum(pages_for(self.lengths[i], page) for i in placed),
                               max_new_tokens=params.max_new_tokens, page_bytes=page_bytes,
                               free_bytes=_free_bytes(self.device))
        starts = np.cumsum([1] + [pages_for(n, page) for n in self.lengths])  # prompt pages from page 1 on, in order
        self.prompt_pages = [list(range(a, b)) for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())]
        free = list(range(int(starts[-1]), self.pool))
        self.cache = _empty_pool(self.graph, self.weights, pool=self.pool, page_size=page, dtype=pool_dtype)
        logits, offset = [], 0
        at = np.zeros(slot_bucket(len(sequences)), np.int32)  # sequence -> its row of the buckets' logits
        for width, idx, count in buckets:
            page_ids = unwritten(count * (width // page), self.pool).reshape(count, width // page)
            ids, mask = np.full((count, width), pad_id, np.int32), np.zeros((count, width), np.int32)
            for j, i in enumerate(idx):
                tokens, own = sequences[i], self.prompt_pages[i]
                ids[j, :len(tokens)], mask[j, :len(tokens)], page_ids[j, :len(own)] = tokens, 1, own
            mask[len(idx):, 0] = 1  # bucket rows read one token (their pages are not written)
            # Prefilled a power-of-two number of sequences at a time (dividing the bucket), at most prefill_tokens.
            per_call = min(count, 1 << (max(prefill_tokens // width, 1).bit_length() - 1))
            for first in range(0, count, per_call):
                rows = slice(first, first + per_call)
                self.cache, part = _prefill(self.graph, self.weights, self.cache, ids[rows], mask[rows],
                                            page_ids[rows], page_size=page)
                logits.append(part)
            at[idx], offset = offset + np.arange(len(idx)), offset + count
        if placed:
            self.cache, part, where = _place(self.cache, [(row, self.prompt_pages[i]) for i, row in placed.items()],
                                             pool=self.pool, device=self.device)
            logits.append(part)
            at[list(placed)] = offset + where
        logits = logits[0] if len(logits) == 1 else jnp.concatenate(logits)
        # Each sequence's logits at its index, in a bucketed count of rows (one bucket's are in order already).
        self.prompt_logits = logits if len(buckets) == 1 and not placed else logits[at]
        self.sched = PageScheduler(slots=self.slots, free=free, prompt_pages=self.prompt_pages,
                                   prompt_lengths=self.lengths, row_prompt=row_prompt,
                                   row_slots=[self.lengths[p] + params.max_new_tokens - start
                                              for p, start in zip(row_prompt, self.row_start)],
                                   page_size=page, table_width=pages_for(prompt_span + params.max_new_tokens, page))
        self.program = PagedProgram(decoding=Decoding.of(params, pad_id), page_size=page)
        # Each row's tokens sampled in this call and their log-probs, the first sampled_count[row] of each row real
        # (arrays, not lists: a round's tokens go in with a few array operations for all its slots).
        self.sampled = np.full((self.rows, params.max_new_tokens), pad_id, np.int32)
        self.sampled_logprobs = np.zeros((self.rows, params.max_new_tokens), np.float32)
        self.sampled_count = np.zeros(self.rows, np.int64)
        self.finished_rows = np.zeros(self.rows, bool)
        self.open_rows = collections.Counter(self.row_group)  # group -> rows not finished
        self.generated, self.active = np.zeros(self.slots, np.int32), np.zeros(self.slots, bool)
        self.slot_rows = np.zeros(self.slots, np.int32)
        self.logits = jnp.zeros((self.slots, self.prompt_logits.shape[-1]), self.prompt_logits.dtype,
                                device=self.device)
        self.rounds = self.shrinks = 0
        self.decode_steps = self.slot_steps = self.decoded_tokens = 0  # what the rounds ran (:func:`generate_paged`)
        # Each row runs at most this many rounds once admitted for good (the oldest row is never preempted): a bound
        # far above any real schedule, so that a scheduling fault fails instead of looping.
        self.most_rounds = 4 * self.rows * (pages_for(params.max_new_tokens, self.steps) + 2)

    @property
    def finished(self) -> bool:
        return bool(self.finished_rows.all())

    @property
    def groups_done(self) -> int:
        return sum(1 for k in set(self.row_group) if self.open_rows[k] == 0)

    def advance(self, key, temperature, top_p, *, ahead: bool) -> None:
        """Decode a round and read it back. With ``ahead``, where no row waits and the slots cannot shrink (a long
        generation's tail at its floor) and the pool has the pages, two rounds: the second launched before the first
        is read back, its pages taken with the first's, so that the device does not wait for the host's work between
        them. The rows and their tokens are the same either way (a token's draw depends on its row and position, not
        on the round), so only a caller that stops once some rows finish (a partial rollout) passes ``ahead=False``."""
        self._shrink()
        rounds = 2 if ahead and self._can_run_ahead() else 1
        for out in self.dispatch(key, temperature, top_p, rounds=rounds):
            self.collect(out)

    def _can_run_ahead(self) -> bool:
        """Whether two rounds can be scheduled as one: no row waits, the slots are as few as they get
        (:meth:`_shrink`), some running row may still decode after the first round (not every one reaches
        ``max_new_tokens`` in it) and the free pages cover every running row's next two rounds without a preemption."""
        sched = self.sched
        if sched.waiting or (self.tail_slots and self.slots > decode_slots(self.tail_slots, self.slot_buckets)):
            return False
        running = sched.running()
        longer = running.any() and self.params.max_new_tokens - self.generated[running].min() > self.steps
        return longer and sched.pages_needed(2 * self.steps) <= len(sched.free)

    def dispatch(self, key, temperature, top_p, *, rounds: int = 1) -> list:
        """Schedule the slots and start ``rounds`` decode rounds on the device (more than one only where
        :meth:`_can_run_ahead`: the later rounds admit no row); their outputs, not yet read."""
        sched = self.sched
        if self.rounds > self.most_rounds:
            raise RuntimeError(f"paged sampler: {int((~self.finished_rows).sum())} of {self.rows} rows unfinished "
                               f"after {self.rounds} rounds ({sched.preempted} preemptions); a scheduling fault")
        admitted, preempted = sched.schedule(rounds * self.steps)
        for row in preempted:
            self.sampled[row], self.sampled_logprobs[row], self.sampled_count[row] = self.program.decoding.pad_id, 0, 0
        self.active = sched.running()
        if not self.active.any():  # cannot happen with a pool of at least pool_pages' least; never loop on nothing
            raise RuntimeError(f"paged sampler: {len(sched.waiting)} rows wait and no slot can take one "
                               f"({len(sched.free)} free pages)")
        admit_prompt = np.full(self.slots, -1, np.int32)
        copy_src = np.full(self.slots, SCRATCH_PAGE, np.int32)
        copy_dst = unwritten(self.slots, self.pool)
        for slot, row in admitted.items():
            prompt = sched.row_prompt[row]
            self.slot_rows[slot], self.generated[slot], admit_prompt[slot] = row, self.row_start[row], prompt
            if self.lengths[prompt] % self.page:  # the partial last prompt page becomes the row's first own page
                copy_src[slot], copy_dst[slot] = self.prompt_pages[prompt][-1], sched.slots[slot].own[0]
        if admitted:
            self.logits = _admit(self.logits, self.prompt_logits, admit_prompt)
        table, rows = sched.page_table.copy(), np.asarray(self.row_keys, np.int32)[self.slot_rows]
        # On the device from the start, as a later round's are (the device's own outputs): one compiled program
        lengths, generated, active = jax.device_put((sched.lengths, self.generated, self.active), self.device)
        outs = []
        for _ in range(rounds):
            self.cache, self.logits, *out = _decode_round(
                self.graph, self.weights, self.cache, self.logits, table, lengths, generated, rows, active, copy_src,
                copy_dst, key, temperature, top_p, program=self.program, steps=self.steps)
            lengths, generated, active = out[:3]  # a later round goes on from the device's state: nothing to copy
            copy_src, copy_dst = np.full(self.slots, SCRATCH_PAGE, np.int32), unwritten(self.slots, self.pool)
            outs.append(out)
        self.rounds += rounds
        return outs

    def _shrink(self) -> None:
        """Once no row waits, the running rows move into fewer slots when a smaller bucket (of at least
        ``kv.tail_slots``) holds them: a long tail then decodes without the work of empty slots. Only the slots'
        host state and their next-token logits move; the rows' pages stay."""
        sched = self.sched
        if not self.tail_slots or sched.waiting:
            return
        size = max(decode_slots(sum(s is not None for s in sched.slots), self.slot_buckets),
                   decode_slots(self.tail_slots, self.slot_buckets))
        if size >= self.slots:
            return
        keep = sched.shrink(size)
        self.generated, self.slot_rows, self.slots = self.generated[keep], self.slot_rows[keep], size
        self.logits = _take_rows(self.logits, keep)
        self.shrinks += 1

    def collect(self, out) -> None:
        """Read a round's outputs: each row's new tokens; the slots of rows that stopped freed."""
        lengths, generated, still, tokens, logprobs, real = jax.device_get(out)
        self.sched.lengths[:], self.generated[:] = lengths, generated
        steps = real.shape[1]  # every round runs all its steps (:func:`_round`)
        self.decode_steps, self.slot_steps = self.decode_steps + steps, self.slot_steps + steps * self.slots
        self.decoded_tokens += int(real.sum())
        slots = np.flatnonzero(self.active)
        rows, ok = self.slot_rows[slots], real[slots]
        # A slot's real tokens are its round's first steps (it decodes until it stops): row r's go on from its count.
        # Written through flat indices (a 2-D fancy index is several times slower).
        first = rows.astype(np.int64) * self.sampled.shape[1] + self.sampled_count[rows]
        at = (first[:, None] + np.arange(ok.shape[1]))[ok]
        self.sampled.reshape(-1)[at], self.sampled_logprobs.reshape(-1)[at] = tokens[slots][ok], logprobs[slots][ok]
        self.sampled_count[rows] += ok.sum(axis=1)
        for slot in slots[~still[slots]].tolist():
            row = int(self.slot_rows[slot])
            self.active[slot] = False  # a round launched after this one decodes nothing in it
            self.sched.release(slot)
            self.finished_rows[row] = True
            self.open_rows[self.row_group[row]] -= 1

    def keep(self) -> list[KeptRow | None]:
        """Per row, the keys and values and next-token logits it has now, copied out of the pool (None for a finished
        row and a new row without tokens): a running row's from its slot, a waiting row that continues a prefix
        from its prefilled (or placed) sequence."""
        sched, page = self.sched, self.page
        in_slot = {s.row: i for i, s in enumerate(sched.slots) if s is not None}
        rows, pages, first, lengths, from_slot, index = [], [], [], [], [], []
        for row in range(self.rows):
            seq = sched.row_prompt[row]
            if self.finished_rows[row] or (row not in in_slot and not self.row_start[row]):
                continue
            length = self.lengths[seq] + (int(self.sampled_count[row]) if row in in_slot else 0)
            if row in in_slot:
                slot = in_slot[row]
                if int(sched.lengths[slot]) != length:  # kept pages must hold exactly the row's tokens
                    raise RuntimeError(f"paged sampler bookkeeping: row {row}'s slot holds {int(sched.lengths[slot])} "
                                       f"slots, its prompt and tokens {length}")
                ids = sched.page_table[slot, :pages_for(length, page)].tolist()
            else:
                ids = self.prompt_pages[seq]
            rows.append(row)
            first.append(len(pages))
            lengths.append(length)
            pages += ids
            from_slot.append(row in in_slot)
            index.append(in_slot[row] if row in in_slot else seq)
        if not rows:
            return [None] * self.rows
        store = KeptPages(cache=_take_pages(self.cache, _bucketed(pages)),
                          logits=_kept_logits(self.logits, self.prompt_logits, _bucketed(from_slot, bool),
                                              _bucketed(index)),
                          first=tuple(first), lengths=tuple(lengths), page_size=page)
        out: list[KeptRow | None] = [None] * self.rows
        for i, row in enumerate(rows):
            out[row] = KeptRow(store, i)
        return out


def new_groups(prompt_ids: list[list[int]], num_generations: int) -> list[RowGroup]:
    """Groups of ``num_generations`` new rows per prompt, row ``p*G + j`` sampling with key ``p*G + j``."""
    g = num_generations
    return [RowGroup(list(p), [[] for _ in range(g)], list(range(i * g, (i + 1) * g)))
            for i, p in enumerate(prompt_ids)]


def generate_paged(graphdef, states: list, groups: list[RowGroup], params: SamplingParams, *, seed: int,
                   kv: KVCacheConfig, pad_id: int, prompt_bucket: int, slot_bucket,
                   groups_needed: int | None = None, prefill_tokens: int = PREFILL_TOKENS, slots: int = 0,
                   keep: bool = False, positions: list[int] | None = None, device_count: int | None = None) -> dict:
    """The rows of ``groups`` (in order) decoded with a paged cache (see the module docstring), on one device per
    entry of ``states`` (the weights on that device): the groups are split into parts of about as many rows, one per
    device (:func:`device_parts`), each device with its own pool, slots and scheduler, their rounds run side by
    side. With ``groups_needed`` the generation stops once that many groups have every row finished (a partial
    rollout; the other rows return the tokens they have). Returns numpy ``tokens``, ``mask``, ``logprobs`` [N,
    max_new_tokens] (the tokens sampled in this call, after each row's prefix), ``stopped`` and ``finished`` [N],
    and the counts ``preempted`` (rows), ``pool`` (pages per device), ``peak_pages`` (the most the rows owned at
    once, devices added up), ``prompt_pages``, ``rounds`` and ``shrinks`` (times a device's running rows moved into
    fewer slots), and where the time went: ``prefill_s`` and ``decode_s`` (wall seconds), ``decode_steps`` (the most
    any device ran), ``slot_steps`` (slots x steps, devices added up) and ``decoded_tokens``
    (:func:`slot_occupancy`). ``slot_bucket(n)``: the rows a prefill of n sequences runs with (bucketed, so that few
    programs compile; the decode rounds' slots are :func:`decode_slots`'s). ``prefill_tokens``: the most tokens one
    prefill call takes. ``slots``: with ``kv.slots`` 0, the slots to decode with (devices together) instead of one per
    row: a caller whose row count changes from call to call passes its largest, so that every call runs the same
    compiled program. ``keep``: also return ``kept``, per row its keys and values and next-token logits
    (:meth:`_Generation.keep`; a later call continues the row from them when its :class:`RowGroup` passes them),
    ``home``, per row the position of the device holding them (-1: none kept), and ``keep_s``, the seconds their copy
    took.

    Several processes (a sampler mesh over several hosts): ``states`` are the weights on this process's devices, at
    ``positions`` among the mesh's ``device_count`` devices (default: every device is this process's). Every process
    calls this with the same groups; each decodes the parts of its own devices, the stop test counts every process's
    finished groups (a collective after each round), and the rows and counts are then gathered, so every process
    returns the whole generation (``kept`` holds only its own devices' rows, ``home`` every row's: a group continued
    later from kept rows names its home, :attr:`RowGroup.home`, so that the process holding them decodes it)."""
    device_count = len(states) if device_count is None else device_count
    positions = list(range(len(states))) if positions is None else list(positions)
    across = device_count > len(states)
    homeless = [i for i, g in enumerate(groups) if g.home is None and any(row is not None for row in g.kept)]
    if across and homeless:
        raise ValueError(f"generate_paged: group {homeless[0]} continues kept rows without naming their device "
                         "(RowGroup.home); across processes a kept row continues on the device that kept it")
    parts = device_parts(groups, device_count)
    busy = [at for at, part in enumerate(parts) if len(part)]
    mine = [(state, at) for state, at in zip(states, positions, strict=True) if len(parts[at])]

    def prefilled(state, part):
        gen = _Generation(graphdef, state, [groups[i] for i in part], params, kv=kv, pad_id=pad_id,
                          prompt_bucket=prompt_bucket, slot_bucket=slot_bucket, prefill_tokens=prefill_tokens,
                          slots=-(-slots // len(busy)))
        jax.block_until_ready(gen.prompt_logits)  # the prefill's time is its own, not the first round's
        return gen

    with _device_threads(max(len(mine), 1)) as each:
        start = time.perf_counter()
        gens = each(prefilled, [state for state, _ in mine], [parts[at] for _, at in mine])
        prefill_s, start = time.perf_counter() - start, time.perf_counter()
        temperature, top_p = np.float32(params.temperature), np.float32(params.top_p)
        keys = [jax.device_put(jax.random.key(int(seed)), gen.device) for gen in gens]
        need = len(groups) if groups_needed is None else min(groups_needed, len(groups))
        while _groups_done(gens, across) < need:
            each(lambda gen, key: gen.finished or gen.advance(key, temperature, top_p, ahead=need == len(groups)),
                 gens, keys)
        decode_s, start = time.perf_counter() - start, time.perf_counter()
        held = each(lambda gen: gen.keep(), gens) if keep else [[None] * gen.rows for gen in gens]  # per part
        jax.block_until_ready([(row.pages.cache, row.pages.logits) for rows in held for row in rows if row is not None])
        keep_s = time.perf_counter() - start
    width = params.max_new_tokens
    rows = sampled_arrays(np.concatenate([gen.sampled for gen in gens] or [np.full((0, width), pad_id, np.int32)]),
                          np.concatenate([gen.sampled_logprobs for gen in gens] or [np.zeros((0, width), np.float32)]),
                          np.concatenate([gen.sampled_count for gen in gens] or [np.zeros(0, np.int64)]), params)
    rows |= dict(finished=np.array([f for gen in gens for f in gen.finished_rows], bool),
                 home=np.array([at if row is not None else -1 for (_, at), part in zip(mine, held) for row in part],
                               np.int32))
    counts = dict(preempted=sum(gen.sched.preempted for gen in gens), pool=max((gen.pool for gen in gens), default=0),
                  rounds=max((gen.rounds for gen in gens), default=0), shrinks=sum(gen.shrinks for gen in gens),
                  peak_pages=sum(gen.sched.peak_pages for gen in gens),
                  prompt_pages=sum(len(p) for gen in gens for p in gen.prompt_pages),
                  prefill_s=prefill_s, decode_s=decode_s,
                  decode_steps=max((gen.decode_steps for gen in gens), default=0),
                  slot_steps=sum(gen.slot_steps for gen in gens),
                  decoded_tokens=sum(gen.decoded_tokens for gen in gens), keep_s=keep_s)
    if across:
        rows, counts = _gathered(rows, counts, [at for _, at in mine], [gen.rows for gen in gens],
                                 device_count)
    # The parts' rows, one part after another, back in the groups' order.
    sizes = [len(g.prefixes) for g in groups]
    firsts = np.cumsum([0] + sizes)
    in_groups = np.argsort(np.concatenate([np.arange(firsts[i], firsts[i] + sizes[i]) for at in busy
                                           for i in parts[at]] or [np.zeros(0, np.int64)]))
    rows = {k: v[in_groups] for k, v in rows.items()}
    kept = None
    if keep:
        own = dict(zip([at for _, at in mine], held))
        kept = [row for at in busy for row in own.get(at, [None] * sum(sizes[i] for i in parts[at]))]
        kept = [kept[i] for i in in_groups]
    return rows | counts | dict(kept=kept)


#: How :func:`generate_paged`'s counts combine over processes (the others are added up).
_LONGEST_COUNTS = ("pool", "rounds", "prefill_s", "decode_s", "decode_steps", "keep_s")


def _groups_done(gens: list[_Generation], across: bool) -> int:
    """Finished groups of ``gens``, and with ``across`` of every process's (a collective)."""
    done = sum(gen.groups_done for gen in gens)
    return int(host_allgather(np.int64(done)).sum()) if across else done


def _gathered(rows: dict, counts: dict, positions: list[int], part_rows: list[int], device_count: int):
    """Every process's ``rows`` (:func:`row_arrays`' arrays and ``finished``: its parts' rows, the part at
    ``positions[i]`` holding ``part_rows[i]`` of them) in the order of the parts, and ``counts`` combined over the
    processes. A collective: every process calls it once per generation."""
    layout = np.full((2, device_count), -1, np.int64)  # this process's parts: their positions, their rows
    layout[:, :len(positions)] = positions, part_rows
    held = [(at[at >= 0], n[at >= 0]) for at, n in host_allgather(layout)]  # per process
    most = max(int(n.sum()) for _, n in held)
    gathered = {k: host_allgather(np.pad(v, [(0, most - len(v))] + [(0, 0)] * (v.ndim - 1))) for k, v in rows.items()}
    pieces = sorted((int(at), proc, int(first), int(n))  # (part position, process, its first row there, rows)
                    for proc, (ats, ns) in enumerate(held) for at, first, n in zip(ats, np.cumsum(ns) - ns, ns))
    rows = {k: np.concatenate([v[proc, first:first + n] for _, proc, first, n in pieces]) for k, v in gathered.items()}
    keys = sorted(counts)
    values = host_allgather(np.array([counts[k] for k in keys], np.float64))
    counts = {k: (values[:, i].max() if k in _LONGEST_COUNTS else values[:, i].sum()) for i, k in enumerate(keys)}
    return rows, {k: (float(v) if k.endswith("_s") else int(v)) for k, v in counts.items()}


@contextlib.contextmanager
def _device_threads(count: int):
    """``each(fn, *iterables)``: ``fn`` over the zipped iterables, the ``i``-th call in device ``i``'s own thread, all
    at once, returning when every call has (its results in order, the first error raised); with one device, in the
    calling thread."""
    if count == 1:
        yield lambda fn, *args: [fn(*a) for a in zip(*args)]
        return
    with contextlib.ExitStack() as stack:
        threads = [stack.enter_context(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"paged-device{i}"))
                   for i in range(count)]
        yield lambda fn, *args: [f.result() for f in [t.submit(fn, *a) for t, a in zip(threads, zip(*args))]]


def row_arrays(tokens: list[list[int]], logprobs: list[list[float]], params: SamplingParams, pad_id: int) -> dict:
    """Rows given as token and log-prob lists as :func:`sampled_arrays`."""
    n, width = len(tokens), params.max_new_tokens
    ids, lp = np.full((n, width), pad_id, np.int32), np.zeros((n, width), np.float32)
    for r, (t, l) in enumerate(zip(tokens, logprobs)):
        ids[r, :len(t)], lp[r, :len(t)] = t, l
    return sampled_arrays(ids, lp, np.array([len(t) for t in tokens], np.int64), params)


def sampled_arrays(ids: np.ndarray, logprobs: np.ndarray, counts: np.ndarray, params: SamplingParams) -> dict:
    """Rows of ``counts`` sampled tokens each (``ids`` and ``logprobs`` [N, max_new_tokens], padded after them) as
    numpy ``tokens``, ``mask``, ``logprobs`` [N, max_new_tokens] and ``stopped`` [N] (the row ends in one of
    ``params``' stop ids)."""
    mask = (np.arange(ids.shape[1])[None, :] < counts[:, None]).astype(np.int32)
    last = ids[np.arange(len(ids)), np.maximum(counts - 1, 0)]
    stopped = (counts > 0) & np.isin(last, np.asarray(params.stop_token_ids, np.int32))
    return dict(tokens=ids, mask=mask, logprobs=logprobs, stopped=stopped)


def rollout_of(arrays: dict, prompt_ids: list[list[int]], *, pad_id: int, prompt_bucket: int,
               version: int) -> RolloutBatch:
    """The :class:`RolloutBatch` of :func:`row_arrays` ``arrays``, row r continuing ``prompt_ids[r]`` (left-padded to a
    multiple of ``prompt_bucket``), sampled with weights ``version``."""
    ids, mask = left_pad(prompt_ids, pad_id, multiple_of=prompt_bucket)
    return RolloutBatch(prompt_ids=ids, prompt_mask=mask, completion_ids=arrays["tokens"],
                        completion_mask=arrays["mask"], sampling_logprobs=arrays["logprobs"],
                        truncated=~arrays["stopped"], policy_version=version)
