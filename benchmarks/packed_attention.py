"""cuDNN's packed-layout attention (forward + backward) over the packed rows of a long-tailed GRPO step, with the
bound on runs per row (``AttentionMask.max_segments``) as the update passes it and tighter ones.

    python benchmarks/packed_attention.py [--rows 512] [--mean 1024] [--max-new 8192] [--micro-rows 4] \
        [--bounds step,micro,64,16] [--share-prompts]

The step's rows (``--rows`` completions of geometric lengths of mean ``--mean`` cut at ``--max-new``, after
``--prompt``-token prompts, ``--generations`` per prompt) are packed as the trainer packs them
(:func:`jrl.train.packing.pack`); each micro-batch of ``--micro-rows`` packed rows is timed with random queries, keys
and values (the 1B shape's heads by default). Bounds: ``step`` = the update's (the step's most sequences per row,
a power of two, plus one), ``micro`` = the micro-batch's own most runs per row, a power of two, a number = that bound
where it holds the micro-batch's runs (1: each micro-batch's own count). ``--flatten`` lays each micro-batch's rows end
to end as one row. Prints one JSON line per bound: the summed time over the micro-batches, and the largest difference
of its query gradients (each micro-batch's first row, first 64 positions) from the first bound's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_common import bench, env_line, report  # noqa: E402


def packed_segments(args) -> tuple[np.ndarray, int]:
    """(segment ids [R, E] int32 of the step's packed rows, E the attention's layout; sequence slots per row)."""
    from jrl.train.packing import pack

    rng = np.random.default_rng(args.seed)
    prompts = args.rows // args.generations
    width = args.prompt + args.max_new
    ids = np.zeros((args.rows, width), np.int32)
    attention = np.zeros((args.rows, width), np.int32)
    completion = np.zeros((args.rows, args.max_new), np.int32)
    lengths = np.minimum(rng.geometric(1.0 / args.mean, args.rows), args.max_new)
    for p in range(prompts):
        prompt = rng.integers(1, 1000, args.prompt)
        for j in range(args.generations):
            r = p * args.generations + j
            ids[r, :args.prompt] = prompt
            ids[r, args.prompt:args.prompt + lengths[r]] = rng.integers(1, 1000, lengths[r])
            attention[r, :args.prompt + lengths[r]] = 1
            completion[r, :lengths[r]] = 1
    rows = pack(ids, attention, completion, rows_multiple=args.micro_rows, share_prompts=args.share_prompts)
    return rows.segment_ids, rows.gather.shape[1]


def runs_per_row(segments: np.ndarray) -> np.ndarray:
    return 1 + (segments[:, 1:] != segments[:, :-1]).sum(axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--generations", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--mean", type=int, default=1024)
    ap.add_argument("--max-new", type=int, default=8192)
    ap.add_argument("--micro-rows", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--bounds", default="step,micro")
    ap.add_argument("--share-prompts", action="store_true")
    ap.add_argument("--flatten", action="store_true", help="each micro-batch's rows laid end to end as one row")
    ap.add_argument("--impl", default="cudnn")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.flatten and "step" in args.bounds.split(","):
        ap.error("--flatten lays a micro-batch's runs in one row: the step's bound per row does not hold them")

    import jax
    import jax.numpy as jnp

    from jrl.kernels.attention import api
    from jrl.kernels.attention.mask import AttentionMask

    print(env_line(), flush=True)
    segments, s = packed_segments(args)
    r, e = segments.shape
    runs = runs_per_row(segments)
    print(f"{r} packed rows of {e}, {s} sequence slots per row; runs per row: max {runs.max()}, mean {runs.mean():.1f}",
          flush=True)
    micro = [segments[i:i + args.micro_rows] for i in range(0, r, args.micro_rows)]
    if args.flatten:  # one row per micro-batch, each packed row's segments kept apart
        micro = [(seg + (seg.max() + 1) * np.arange(len(seg))[:, None]).reshape(1, -1) for seg in micro]
    key = jax.random.key(args.seed)
    kq, kk, kv, ko = jax.random.split(key, 4)
    b, e = micro[0].shape
    q = jax.random.normal(kq, (b, e, args.heads, args.head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, (b, e, args.kv_heads, args.head_dim), jnp.bfloat16)
    v = jax.random.normal(kv, (b, e, args.kv_heads, args.head_dim), jnp.bfloat16)
    dout = jax.random.normal(ko, q.shape, jnp.bfloat16)

    def pow2(n: int) -> int:
        return 1 << (int(n) - 1).bit_length()

    programs = {}

    def step_fn(bound: int):
        if bound not in programs:
            def f(q, k, v, seg, dout):
                mask = AttentionMask.packed(seg, max_segments=bound)
                out, vjp = jax.vjp(lambda q, k, v: api.attention(q, k, v, mask, impl=args.impl), q, k, v)
                return vjp(dout)
            programs[bound] = jax.jit(f)
        return programs[bound]

    reference = None
    for name in args.bounds.split(","):
        total, used = 0.0, set()
        grads = []
        for seg in micro:
            need = int(runs_per_row(seg).max())
            bound = {"step": s + 1, "micro": pow2(need)}.get(name) or max(int(name), need)
            used.add(bound)
            seg = jnp.asarray(seg)
            t = bench(step_fn(bound), q, k, v, seg, dout, reps=3, target_s=0.02)
            total += t["ms"]
            grads.append(jax.device_get(step_fn(bound)(q, k, v, seg, dout)[0][0, :64].astype(jnp.float32)))
        grads = np.stack(grads)
        diff = None if reference is None else float(np.max(np.abs(grads - reference)))
        reference = grads if reference is None else reference
        report({"bench": "packed_attention", "bound": name, "bounds_used": sorted(used), "micro_batches": len(micro),
                "ms_fwd_bwd_total": round(total, 2), "max_abs_diff_vs_first": diff}, args.out)


if __name__ == "__main__":
    main()
