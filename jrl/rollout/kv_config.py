"""The ``rollout.kv`` section: how the embedded sampler keeps its KV cache."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jrl.validation import check_int, invalid

KV_LAYOUTS = ("dense", "paged")
KV_DTYPES = ("model", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True)
class KVCacheConfig:
    """The embedded (``jax``) sampler's KV cache. ``dense``: every row of a generation gets ``prompt +
    max_new_tokens`` slots and the generation runs until its longest row ends (one jitted loop; the fastest while
    the rows fit). ``paged``: a pool of fixed-size pages, taken as a row grows and returned when it stops, a prompt's
    pages shared by its ``num_generations`` rows; rows decode in ``slots`` decode slots and a stopped row's slot
    takes the next waiting row (continuous batching), so memory follows the tokens actually generated
    (:mod:`jrl.rollout.paged`)."""

    layout: str = "dense"
    """``dense`` or ``paged``."""
    page_size: int = 16
    """Slots per page (``paged``)."""
    round_steps: int = 64
    """Decode steps the device runs between two scheduling rounds of the slots (``paged``). Each round costs a few
    milliseconds of host work (reading its tokens back, freeing and admitting rows, starting the next); more steps
    make fewer rounds, but a slot whose row stops waits up to this many steps for the next row (on an H100, 1B model,
    long-tailed completions: 64 steps 17% faster than 16, benchmarks/RESULTS.md)."""
    slots: int = 0
    """Rows decoded at once per device (``paged``): 0 = every row of a generation; fewer bounds the pages in use and
    the work of a decode step, the rows waiting for a slot start as others stop."""
    tail_slots: int = 16
    """The fewest slots a generation's tail decodes in (``paged``). Once no row waits for a slot and the running rows
    fit a smaller slot count (``slot_buckets``; with powers of two: at most half the slots), they move into it (at
    least this many), so the last long rows decode without the work of empty slots (their pages stay where they are:
    only the page table's rows move). Each slot count is a program of its own, compiled once per run. 0 keeps a
    generation's slots."""
    slot_buckets: int = 8
    """Slot counts a decode round may take per doubling above 128 slots (``paged``; 1, 2, 4 or 8). Each slot count
    is a program of its own, so slots are bucketed: 1 = powers of two, the fewest programs (a generation of 600 rows
    decodes in 1,024 slots, and once its steps' products are bound by their arithmetic, hundreds of rows, the empty
    slots cost as much as full ones); 4 = quarter steps (512, 640, 768, 896, 1,024); 8 = eighth steps (512, 576,
    640, ...), so 600 rows take 640 slots and the tail shrinks in small steps, for up to eight times the programs
    (on an H200, 1B model, a long-tailed partial generation: 4 gave 9% more tokens/s than 1, 8 4% more than 4, the
    first step's compile time not longer; benchmarks/RESULTS.md). Above 1 a partial rollout also decodes in the
    slots its rows need instead of the most a step can have."""
    pages: int = 0
    """Pages in each device's pool (``paged``), shared by all layers' keys and values: 0 = enough for every slot's
    longest completion, capped at 70% of the device's free memory when a generation starts (where the device tells
    it; a power of two of pages). Fewer saves memory: when a growing row finds no free page, the row admitted last
    gives its pages back and starts again later (its tokens come out the same: each row samples from a key of its
    own). Too few for one whole row is an error that names the minimum."""
    dtype: str = "model"
    """Element type of the pool's keys and values (``paged``): ``model`` (the sampler's compute dtype) or
    ``float8_e4m3fn``: one byte each, half a bfloat16 pool's memory and half the bytes a decode step's attention reads;
    each key and value is rounded to 3 mantissa bits (and clipped to +-448), so the sampler's log-probs move a little
    away from the learner's (the per-token importance ratio of the loss sees the difference). On a GPU the fused
    decode kernel reads it (on an H200 in 0.70 of a bfloat16 pool's time on wide steps: it widens each block in
    registers, so it is bound by its instructions before the memory; benchmarks/RESULTS.md); elsewhere the reference
    attention does."""

    def pool_dtype(self, model_dtype) -> jnp.dtype:
        """The pool's element type for a model computing in ``model_dtype``."""
        return jnp.dtype(model_dtype if self.dtype == "model" else self.dtype)

    def __post_init__(self):
        if self.layout not in KV_LAYOUTS:
            raise invalid("KVCacheConfig", "layout", self.layout, f"use one of {KV_LAYOUTS}")
        if self.dtype not in KV_DTYPES:
            raise invalid("KVCacheConfig", "dtype", self.dtype, f"use one of {KV_DTYPES}")
        check_int(self, "page_size", lo=1)
        check_int(self, "round_steps", lo=1)
        check_int(self, "slots", lo=0, fix="use 0 (every row at once) or a slot count")
        check_int(self, "tail_slots", lo=0, fix="use 0 (keep the slots) or the fewest slots to shrink to")
        check_int(self, "pages", lo=0, fix="use 0 (enough for every slot) or a page count")
        if self.slot_buckets not in (1, 2, 4, 8):
            raise invalid("KVCacheConfig", "slot_buckets", self.slot_buckets,
                          "use 1 (powers of two), 2, 4 or 8 slot counts per doubling")
