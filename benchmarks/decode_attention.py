"""Decode attention (one query per row over a KV cache): the dense reference against the Pallas kernel.

A sampler-shaped step: ``--rows`` rows, a cache of ``--slots`` slots of which ``--filled`` are allowed per
row (after 10 slots of left padding), ``--kv-heads`` KV heads x ``--group`` query heads, bf16. One timed call
attends over ``--layers`` layers' caches (separate K and V arrays, so they do not sit in L2), as a decode step
does.
Reported: time per layer and the bandwidth on the allowed part of the cache (K and V read once).

``--append`` times the step with its rope and cache write instead (``decode_attention_append``): ``--steps``
decode steps in a loop that carries the caches (so they are updated in place, as in the sampler), the kernel
against rope + cache write by XLA + the attention kernel (``split``) and the reference.

    python benchmarks/decode_attention.py --out results.jsonl
    python benchmarks/decode_attention.py --append --out results.jsonl
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_common import bench, env_line, report  # noqa: E402


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
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.append:
        return time_append(args)

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


def time_append(args):
    """``--append``: decode steps at slots ``10 + filled ..`` (each allowing its own slot), caches carried."""
    import jax
    import jax.numpy as jnp

    from jrl.kernels.attention import decode_attention, decode_attention_append
    from jrl.kernels.attention.reference import rope_and_write

    b, s, kv, d, n = args.rows, args.slots, args.kv_heads, args.head_dim, args.kv_heads * args.group
    first = 10 + args.filled
    if first + args.steps > s:
        raise SystemExit(f"--slots {s} has no room for {args.steps} steps after {first} filled slots")
    key = jax.random.key(0)
    normal = lambda i, shape: jax.random.normal(jax.random.fold_in(key, i), shape, jnp.bfloat16)  # noqa: E731
    qkv = normal(1, (b, n + 2 * kv, d))
    caches = [normal(10 + i, (b, s, kv, d)) for i in range(2 * args.layers)]
    angles = jnp.arange(b, dtype=jnp.float32)[:, None] * jnp.ones((d,))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    kv_bytes = 2 * b * (args.filled + args.steps / 2) * kv * d * 2

    def split(qkv, cos, sin, k_cache, v_cache, allowed, index, **kw):  # rope and cache write by XLA, then the kernel
        q, k_cache, v_cache = rope_and_write(qkv, cos, sin, k_cache, v_cache, index)
        return decode_attention(q, k_cache, v_cache, allowed, impl="pallas_gpu", **kw), k_cache, v_cache

    variants = [("reference", {}), ("split", {})] + [
        ("pallas_gpu", dict(block_k=bk, num_warps=w, num_stages=st))
        for bk, w, st in ((32, 2, 2), (64, 2, 2), (64, 2, 3), (64, 4, 2), (128, 4, 1), (128, 4, 2), (128, 8, 2))]
    for impl, kw in variants:
        call = (functools.partial(split, **kw) if impl == "split"
                else functools.partial(decode_attention_append, impl=impl, **kw))

        def run(qkv, caches, impl=impl, call=call):
            def step(i, carry):
                caches, total = carry
                index = first + i
                allowed = (jnp.arange(s) >= 10) & (jnp.arange(s) <= index)
                allowed = jnp.broadcast_to(allowed, (b, s))
                out = []
                for k, v in zip(caches[::2], caches[1::2]):
                    o, k, v = call(qkv, cos, sin, k, v, allowed, index)
                    out += [k, v]
                    total = total + o[0, 0, 0].astype(jnp.float32)
                return out, total

            return jax.lax.fori_loop(0, args.steps, step, (caches, jnp.zeros((), jnp.float32)))[1]

        t = bench(jax.jit(run), qkv, caches)
        per_layer = t["ms"] / args.layers / args.steps
        report(dict(bench="decode_attention_append", impl=impl, **kw, rows=b, slots=s, filled=args.filled,
                    steps=args.steps, kv_heads=kv, group=args.group, head_dim=d,
                    us_per_layer=round(1e3 * per_layer, 2),
                    filled_kv_tbs=round(kv_bytes / (per_layer * 1e-3) / 1e12, 2), env=env_line()), args.out)


if __name__ == "__main__":
    main()
