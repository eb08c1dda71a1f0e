"""Decode attention (one query per row over a KV cache): the dense reference against the Pallas kernel.

A sampler-shaped step: ``--rows`` rows, a cache of ``--slots`` slots of which ``--filled`` are allowed per
row (after 10 slots of left padding), ``--kv-heads`` KV heads x ``--group`` query heads, bf16. One timed call
attends over ``--layers`` layers' caches (separate K and V arrays, so they do not sit in L2), as a decode step
does.
Reported: time per layer and the bandwidth on the allowed part of the cache (K and V read once).

``--append`` times the step with its rope and cache write instead (``decode_attention_append``): ``--steps``
decode steps in a loop that carries the caches (so they are updated in place, as in the sampler), the kernel
against rope + cache write by XLA + the attention kernel (``split``) and the reference.

``--paged`` times the paged step (``paged_decode_attention_append``: rope, the write to the pool and the attention
through a page table) on rows of ragged lengths (geometric, mean ``--filled``, at most ``--slots``; pages of
``--page-size`` slots in shuffled order, a page table ``--slots`` wide as the sampler's), for each
``--splits`` (programs per row and KV head) and ``--blocks`` shape; reported besides the bandwidth on the rows'
cache; ``--kv-dtype float8_e4m3fn`` keeps the pools in one byte per value (``rollout.kv.dtype``).

    python benchmarks/decode_attention.py --out results.jsonl
    python benchmarks/decode_attention.py --append --out results.jsonl
    python benchmarks/decode_attention.py --paged --rows 512 --filled 1800 --slots 8448 --splits 1,2,8
"""

from __future__ import annotations

import argparse
import functools
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_common import bench, env_line, kernel_profile, report  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--slots", type=int, default=384)
    ap.add_argument("--filled", type=int, default=246)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--append", action="store_true")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--paged", action="store_true")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-dtype", default="bfloat16", help="--paged: the pool's dtype (bfloat16 or float8_e4m3fn)")
    ap.add_argument("--splits", default="1,2,4,8", help="--paged: comma-separated programs per (row, KV head)")
    ap.add_argument("--blocks", default="64:2:2,64:1:2,128:4:2",
                    help="--paged: comma-separated block shapes, each block_k:num_warps:num_stages")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="--paged: also the kernel profile of one call per shape (traces under DIR)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.append:
        return time_append(args)
    if args.paged:
        return time_paged(args)

    import jax
    import jax.numpy as jnp

    from jrl.kernels.attention import decode_attention

    b, s, kv, d = args.rows, args.slots, args.kv_heads, args.head_dim
    key = jax.random.key(0)
    q = jax.random.normal(key, (b, kv * args.group, d), jnp.bfloat16)
    caches = [jax.random.normal(jax.random.fold_in(key, i), (b, s, kv, d), jnp.bfloat16)
              for i in range(2 * args.layers)]  # a K and a V cache per layer
    allowed = jnp.zeros((b, s), bool).at[:, 10:10 + args.filled].set(True)
    kv_bytes = 2 * b * args.filled * kv * d * 2
    variants = [("reference", {})] + [("pallas_gpu", dict(block_k=bk, num_warps=w, num_stages=st))
                                      for bk, w, st in ((32, 2, 2), (64, 2, 2), (64, 4, 2), (64, 4, 3), (128, 4, 1),
                                                        (128, 4, 2), (128, 4, 3), (128, 8, 2), (256, 8, 2))]
    for impl, kw in variants:
        step = jax.jit(lambda q, caches, a, impl=impl, kw=kw: [decode_attention(q, k, v, a, impl=impl, **kw)
                                                              for k, v in zip(caches[::2], caches[1::2])])
        t = bench(step, q, caches, allowed)
        per_layer = t["ms"] / args.layers
        report(dict(bench="decode_attention", impl=impl, **kw, rows=b, slots=s, filled=args.filled, kv_heads=kv,
                    group=args.group, head_dim=d, us_per_layer=round(1e3 * per_layer, 2),
                    filled_kv_tbs=round(kv_bytes / (per_layer * 1e-3) / 1e12, 2), env=env_line()), args.out)


def _step_inputs(args, cache_shape: tuple[int, ...]):
    """Random bf16 inputs of a decode step of ``--rows`` rows: the projections [B, N + 2K, D], a K and a V cache of
    ``cache_shape`` per layer, and rope's cos / sin [B, D]."""
    import jax
    import jax.numpy as jnp

    b, kv, d = args.rows, args.kv_heads, args.head_dim
    key = jax.random.key(0)
    normal = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)  # noqa: E731
    caches = [normal(10 + i, cache_shape) for i in range(2 * args.layers)]
    angles = jnp.arange(b, dtype=jnp.float32)[:, None] * jnp.ones((d,))
    return normal(1, (b, kv * args.group + 2 * kv, d)), caches, jnp.cos(angles), jnp.sin(angles)


def _steps(layer, state: list, *, steps: int):
    """A call of ``steps`` decode steps of every layer: ``layer(i, k, v) -> (out, k, v)`` on each (K, V) pair of the
    caches in ``state[0]``, carried through the loop; each call consumes those caches and puts the updated ones in
    their place (donated, so they are updated in place as in the sampler, not copied per call), and returns a
    scalar of the outputs (all of them, so no part of any is dead code)."""
    import jax
    import jax.numpy as jnp

    def step(i, carry):
        caches, total = carry
        out = []
        for k, v in zip(caches[::2], caches[1::2]):
            o, k, v = layer(i, k, v)
            out += [k, v]
            total = total + jnp.sum(o, dtype=jnp.float32)
        return out, total

    run = jax.jit(lambda caches: jax.lax.fori_loop(0, steps, step, (caches, jnp.zeros((), jnp.float32))),
                  donate_argnums=0)

    def call():
        state[0], total = run(state[0])
        return total

    return call


def time_append(args):
    """``--append``: decode steps at slots ``10 + filled ..`` (each allowing its own slot), caches carried."""
    import jax.numpy as jnp

    from jrl.kernels.attention import decode_attention, decode_attention_append
    from jrl.kernels.attention.reference import rope_and_write

    b, s, kv, d = args.rows, args.slots, args.kv_heads, args.head_dim
    first = 10 + args.filled
    if first + args.steps > s:
        raise SystemExit(f"--slots {s} has no room for {args.steps} steps after {first} filled slots")
    qkv, caches, cos, sin = _step_inputs(args, (b, s, kv, d))
    kv_bytes = 2 * b * (args.filled + args.steps / 2) * kv * d * 2
    state = [caches]

    def split(qkv, cos, sin, k_cache, v_cache, allowed, index, **kw):  # rope and cache write by XLA, then the kernel
        q, k_cache, v_cache = rope_and_write(qkv, cos, sin, k_cache, v_cache, index)
        return decode_attention(q, k_cache, v_cache, allowed, impl="pallas_gpu", **kw), k_cache, v_cache

    variants = [("reference", {}), ("split", {})] + [
        ("pallas_gpu", dict(block_k=bk, num_warps=w, num_stages=st))
        for bk, w, st in ((32, 2, 2), (64, 2, 2), (64, 2, 3), (64, 4, 2), (128, 4, 1), (128, 4, 2), (128, 8, 2))]
    for impl, kw in variants:
        call = (functools.partial(split, **kw) if impl == "split"
                else functools.partial(decode_attention_append, impl=impl, **kw))

        def layer(i, k, v, call=call):
            index = first + i
            allowed = jnp.broadcast_to((jnp.arange(s) >= 10) & (jnp.arange(s) <= index), (b, s))
            return call(qkv, cos, sin, k, v, allowed, index)

        t = bench(_steps(layer, state, steps=args.steps))
        per_layer = t["ms"] / args.layers / args.steps
        report(dict(bench="decode_attention_append", impl=impl, **kw, rows=b, slots=s, filled=args.filled,
                    steps=args.steps, kv_heads=kv, group=args.group, head_dim=d,
                    us_per_layer=round(1e3 * per_layer, 2),
                    filled_kv_tbs=round(kv_bytes / (per_layer * 1e-3) / 1e12, 2), env=env_line()), args.out)


def time_paged(args):
    """``--paged``: ``--steps`` decode steps over pools carried through a loop (updated in place), each row one slot
    longer per step."""
    import jax.numpy as jnp
    import numpy as np

    from jrl.kernels.attention import stored_as
    from jrl.kernels.attention.decode_pallas_gpu import paged_decode_attention_append

    b, kv, d, page = args.rows, args.kv_heads, args.head_dim, args.page_size
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.geometric(1 / args.filled, b), args.slots - args.steps).astype(np.int32)
    width = -(-args.slots // page)
    need = -(-(lengths + args.steps) // page)
    ids = rng.permutation(int(need.sum())).astype(np.int32) + 1  # page 0: scratch
    table = np.zeros((b, width), np.int32)
    for r, (a, z) in enumerate(zip(np.cumsum(need) - need, np.cumsum(need))):
        table[r, :z - a] = ids[a:z]
    pool = int(need.sum()) + 1
    qkv, pools, cos, sin = _step_inputs(args, (kv, pool, page, d))
    pools = [stored_as(p, args.kv_dtype) for p in pools]
    kv_bytes = 2 * (float(lengths.sum()) + b * args.steps / 2) * kv * d * jnp.dtype(args.kv_dtype).itemsize
    table, lengths = jnp.asarray(table), jnp.asarray(lengths)
    blocks = [tuple(int(x) for x in shape.split(":")) for shape in args.blocks.split(",")]
    state = [pools]
    for splits, (bk, w, st) in itertools.product([int(x) for x in args.splits.split(",")], blocks):
        def layer(i, k, v, splits=splits, bk=bk, w=w, st=st):
            at = lengths + i
            return paged_decode_attention_append(
                qkv, cos, sin, k, v, table, at + 1, table[jnp.arange(b), at // page], at % page,
                scale=d ** -0.5, block_k=bk, splits=splits, num_warps=w, num_stages=st)

        call = _steps(layer, state, steps=args.steps)
        t = bench(call)
        per_layer = t["ms"] / args.layers / args.steps
        profile = (kernel_profile(call, trace_dir=f"{args.profile}/{splits}_{bk}_{w}_{st}", top=8)
                   if args.profile else None)
        report(dict(bench="paged_decode_attention_append", splits=splits, block_k=bk, num_warps=w,
                    num_stages=st, kv_dtype=args.kv_dtype, rows=b, mean_filled=round(float(lengths.mean()), 1),
                    table_slots=width * page, page_size=page, steps=args.steps, kv_heads=kv, group=args.group, head_dim=d,
                    us_per_layer=round(1e3 * per_layer, 2),
                    filled_kv_tbs=round(kv_bytes / (per_layer * 1e-3) / 1e12, 2),
                    **({"profile": profile} if profile else {}), env=env_line()), args.out)


if __name__ == "__main__":
    main()
