"""Hopper grouped matmul: a Pallas Mosaic GPU kernel with TMA loads and warp specialisation (no jax_triton here:
``mosaic_gpu.py`` makes it an implementation of ``jrl.kernels.moe``, and the CPU tests lower it for CUDA).

``gmm(lhs, rhs)`` over rows sorted by group, done the way CUTLASS's grouped GEMM does it: one persistent program
per SM walks (row tile, n-tile) pairs of a schedule (``schedule.aligned_tile_schedule``); in each program a
memory warpgroup streams ``lhs`` and ``rhs[g]`` blocks through a ring of shared-memory stages with TMA while two compute
warpgroups run ``wgmma`` on them, each owning half of the program's tile. A group's row tiles start at its first
row rounded down to 8 rows (``MosaicGmmConfig.row_align``; or to the tile height; a TMA load's row offset read from
memory must be visibly aligned), so a tile may begin with rows of the previous group (with row blocks, a block
shared by two groups is computed once per group); each tile stores only its own group's rows: whole tiles in one
swizzled store, partial ones through a ladder of power-of-two-row stores (a TMA box has a static size). Rows past
``sum(group_sizes)`` are written as zeros without a product (an expert-parallel device's buffer is mostly such
rows), or not at all (``fill_past_groups=False``) where nothing reads them. ``rhs`` may be read transposed in place
(the input gradient's ``dout @ rhs[g].T``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jrl.kernels.moe.schedule import aligned_tile_schedule


@dataclasses.dataclass(frozen=True)
class MosaicGmmConfig:
    """Tiles of the kernel. Each of the two compute warpgroups owns a ``tile_m x tile_n`` float32 accumulator; a
    program's tile puts the two side by side along N (``split="n"``: ``tile_m x 2 tile_n``) or along M (``"m"``)."""

    tile_m: int = 128
    tile_n: int = 128
    tile_k: int = 64
    # shared-memory stages of the load ring (each tile_k deep)
    stages: int = 4
    split: str = "n"
    # store buffers per compute warpgroup (2 lets a chunk's store overlap the next chunk's register copy, at the
    # cost of a load stage's worth of shared memory)
    out_slots: int = 1
    # keep one wgmma in flight across pipeline steps (a stage is released one step late)
    delay_release: int = 0
    # registers left to the memory warpgroup (it only issues TMA copies)
    memory_registers: int = 40
    # where a group's row tiles may start: a multiple of this (8: at most 7 rows of the previous group per first
    # tile; None: of the tile height, so tiles are row blocks and a block two groups share is computed for each)
    row_align: int | None = 8

    @property
    def cta_m(self) -> int:
        return self.tile_m * (2 if self.split == "m" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (2 if self.split == "n" else 1)

    @property
    def tile_align(self) -> int:
        """What a row tile's first row is a multiple of (the schedule's ``align``)."""
        return self.row_align or self.cta_m


# Chosen on an H200 against 3-stage, two-slot, delayed-release and M-split variants (T=32768, K=2048, N=1024,
# E in {8, 64, 128}) and row blocks (8-row starts: 4-6% faster on routed group sizes, the Qwen3-30B-A3B layer 3%;
# benchmarks/RESULTS.md).
DEFAULT_CONFIG = MosaicGmmConfig()


def unsupported_reason(lhs_shape, lhs_dtype, rhs_shape, rhs_dtype, *, transpose_rhs: bool = False,
                       cfg: MosaicGmmConfig = DEFAULT_CONFIG) -> str | None:
    """Why :func:`gmm_call` cannot take these operands (None when it can)."""
    if jnp.dtype(lhs_dtype) not in (jnp.bfloat16, jnp.float16) or jnp.dtype(rhs_dtype) != jnp.dtype(lhs_dtype):
        return f"needs bf16/f16 operands of one dtype, got {jnp.dtype(lhs_dtype)} and {jnp.dtype(rhs_dtype)}"
    t, k = lhs_shape
    n = rhs_shape[1] if transpose_rhs else rhs_shape[2]
    if not (t and k and n):
        return f"an empty dimension (T={t}, K={k}, N={n})"
    if cfg.row_align is not None and (cfg.row_align % 8 or cfg.cta_m % cfg.row_align):
        return f"row_align={cfg.row_align} must be a multiple of 8 dividing the tile height {cfg.cta_m}"
    if t % cfg.cta_m or k % cfg.tile_k or n % cfg.cta_n:
        return (f"needs T % {cfg.cta_m} == 0, K % {cfg.tile_k} == 0 and N % {cfg.cta_n} == 0, "
                f"got T={t}, K={k}, N={n}")
    return None


def gmm_call(lhs, rhs, group_sizes, *, transpose_rhs: bool, out_dtype, cfg: MosaicGmmConfig = DEFAULT_CONFIG,
             num_sms: int | None = None, fill_past_groups: bool = True):
    """One launch: ``lhs [T, K] x rhs -> [T, N]`` (``out_dtype``, float32 accumulation), ``rhs`` [E, K, N], or
    [E, N, K] read transposed; operands as :func:`unsupported_reason` allows. ``num_sms``: programs to launch
    (default: the GPU's SM count). ``fill_past_groups=False``: the rows past ``sum(group_sizes)`` are left
    unwritten."""
    t, k = lhs.shape
    e = rhs.shape[0]
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    out_dtype = jnp.dtype(out_dtype)
    tm, tn, tk = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_m, cta_n = cfg.cta_m, cfg.cta_n
    split_m = cfg.split == "m"
    n_iters, k_iters = n // cta_n, k // tk
    # one store chunk is 128 bytes wide, so any row offset into it keeps TMA's shared-memory alignment
    epi_n = min(tn, 128 // out_dtype.itemsize)
    chunks = tn // epi_n

    def swizzled(dtype, minor):
        size = jnp.dtype(dtype).itemsize
        swizzle = plgpu.find_swizzle(minor * size * 8)
        return (plgpu.TilingTransform((8, swizzle // size)), plgpu.SwizzleTransform(swizzle))

    in_transforms = swizzled(lhs.dtype, tk)

    # A tile's first row is read from memory in units of ``align`` rows and reaches the TMA load as a block index (row
    # blocks) or as that count times ``align``, an element offset visibly a multiple of 8 (Mosaic's layout inference
    # takes no other data-dependent offset into swizzled tiles).
    align = cfg.tile_align
    blocked = cfg.row_align is None

    def pipeline(step, context, units=0):
        return plgpu.emit_pipeline_warp_specialized(
            step,
            grid=(k_iters,),
            memory_registers=cfg.memory_registers,
            in_specs=[
                plgpu.BlockSpec((cta_m, tk) if blocked else (pl.Element(cta_m), tk),
                                lambda kk: (units if blocked else units * align, kk), transforms=in_transforms,
                                memory_space=plgpu.SMEM, delay_release=cfg.delay_release),
                plgpu.BlockSpec((cta_n, tk) if transpose_rhs else (tk, cta_n),
                                (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0)),
                                transforms=in_transforms, memory_space=plgpu.SMEM, delay_release=cfg.delay_release),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=cfg.stages,
            compute_context=context,
        )

    def body(live_ref, group_ref, units_ref, lo_ref, hi_ref, lhs_gmem, rhs_gmem, out_gmem):
        ignore = lambda *_, **__: None  # noqa: E731  (the allocations do not depend on the bodies)
        # ``out_slots`` store slots for each of the two compute warpgroups, seen two ways: swizzled (bank-conflict-free
        # register stores) for a chunk whose rows all belong to the pair, plain (any row offset) for the ladder of a
        # partial chunk.
        slots = (2, cfg.out_slots, tm, epi_n)
        out_smem = plgpu.RefUnion(plgpu.SMEM(slots, out_dtype),
                                  plgpu.SMEM(slots, out_dtype, transforms=swizzled(out_dtype, epi_n)))

        @functools.partial(
            pl.run_scoped,
            allocs=pipeline(ignore, ignore).get_allocations(lhs_gmem, rhs_gmem.at[0]),
            out_smem=out_smem,
            collective_axes="wg",
        )
        def _scope(allocs, out_smem):
            plain_smem, swizzled_smem = out_smem
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((live_ref[0] * n_iters,), collective_axes="sm")
            def _tiles(info):
                (lin,) = info.index
                mt, nt = lin // n_iters, lax.rem(lin, n_iters)
                g, units, lo = group_ref[mt], units_ref[mt], lo_ref[mt]
                # this warpgroup's rows of the block: [row0, row0 + tm); the pair's rows in them: [first, last)
                row0 = units * align + (wg * tm if split_m else 0)
                first = jnp.clip(lo - row0, 0, tm)
                last = jnp.clip(hi_ref[mt] - row0, 0, tm)
                full = jnp.logical_and(first == 0, last == tm)
                col0 = nt * cta_n + (0 if split_m else wg * tn)

                def free_slot():
                    # the slot's previous chunk has been read (slots are taken in turn within a tile and, when the
                    # chunk count is a multiple of the slot count, across tiles too)
                    plgpu.wait_smem_to_gmem(cfg.out_slots - 1 if chunks % cfg.out_slots == 0 else 0,
                                            wait_read_only=True)

                def store_rows(c, value):
                    # rows [first, last) of chunk c through a plain slot, as stores of 2^j rows, largest first
                    slot = plain_smem.at[wg, c % cfg.out_slots]
                    slot[...] = value
                    plgpu.commit_smem()
                    count, off, size = last - first, first, tm
                    while size >= 1:
                        plgpu.copy_smem_to_gmem(slot.at[pl.ds(off, size)],
                                                out_gmem.at[pl.ds(row0 + off, size), pl.ds(col0 + c * epi_n, epi_n)],
                                                predicate=(count & size) != 0, commit_group=False)
                        off = off + (count & size)
                        size //= 2

                def context(run_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tm, tn), jnp.float32))
                    def _acc(acc_ref):
                        run_pipeline(acc_ref)
                        plgpu.wgmma_wait(0)
                        acc = acc_ref[...].astype(out_dtype)
                        for c in range(chunks):
                            value = acc[:, c * epi_n:(c + 1) * epi_n]
                            free_slot()

                            @pl.when(full)
                            def _whole():
                                slot = swizzled_smem.at[wg, c % cfg.out_slots]
                                slot[...] = value
                                plgpu.commit_smem()
                                plgpu.copy_smem_to_gmem(
                                    slot, out_gmem.at[pl.ds(row0, tm), pl.ds(col0 + c * epi_n, epi_n)],
                                    commit_group=False)

                            @pl.when(jnp.logical_not(full))
                            def _rows():
                                store_rows(c, value)

                            plgpu.commit_smem_to_gmem_group()

                def step(_, a_smem, b_smem, acc_ref):
                    a = a_smem.at[pl.ds(wg * tm, tm)] if split_m else a_smem
                    if transpose_rhs:  # b_smem is [N, K]: this warpgroup's rows, transposed for wgmma
                        b = (b_smem if split_m else b_smem.at[pl.ds(wg * tn, tn)]).transpose((1, 0))
                    else:
                        b = b_smem if split_m else b_smem.at[:, pl.ds(wg * tn, tn)]
                    plgpu.wgmma(acc_ref, a, b)
                    plgpu.wgmma_wait(cfg.delay_release)
                    return acc_ref

                @pl.when(g < e)
                def _product():
                    pipeline(step, context, units)(
                        lhs_gmem,
                        (rhs_gmem.at[g].at[pl.ds(nt * cta_n, cta_n), :] if transpose_rhs
                         else rhs_gmem.at[g].at[:, pl.ds(nt * cta_n, cta_n)]),
                        allocations=allocs,
                    )

                if fill_past_groups:
                    # the sentinel group's rows (past sum(group_sizes)): zeros from the compute warpgroups, no
                    # product
                    @pl.when(jnp.logical_and(g >= e, wg < 2))
                    def _zeros():
                        for c in range(chunks):
                            free_slot()
                            store_rows(c, jnp.zeros((tm, epi_n), out_dtype))
                            plgpu.commit_smem_to_gmem_group()

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((t, n), out_dtype),
        grid=(num_sms or jax.devices()[0].core_count,),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )

    @jax.custom_batching.sequential_vmap  # the kernel has no batching rule: vmap loops over the batch
    def run(lhs, rhs, group_sizes):
        group, start, lo, hi, live = aligned_tile_schedule(group_sizes, t, cta_m, align)
        return kernel(live, group, start // align, lo, hi, lhs, rhs)

    return run(lhs, rhs, group_sizes)
