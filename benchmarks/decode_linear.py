"""A decode step's projections (``jrl.kernels.decode_linear``): the Pallas kernels against XLA running the same
ops (the reference), on a decoder layer's shapes: attention output ``o`` and MLP ``down`` plus the residual
add (``matmul_add``), the MLP's gate and up projections with SwiGLU (``gate_up``, ``matmul_swiglu``), and the
attention's query, key and value projections side by side (``qkv``, ``matmul_concat``; XLA: three GEMMs and a
concatenation).

Each timed call runs one op over ``--layers`` layers' weights (separate arrays, so every layer's weight
comes from memory, as in a decode step; each layer's output feeds the next layer's input). Reported per op
and implementation: microseconds per layer and the weight bandwidth (weight bytes / time). ``--sweep`` also
times block configurations of the kernel.

    python benchmarks/decode_linear.py --shape llama1b --rows 64 [--sweep] --out results.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_common import bench, report  # noqa: E402
from train_step_vs_torch import SHAPES  # noqa: E402

SWEEP = {
    "matmul_add": [dict(split_k=sk, block_n=bn, block_k=bk) for sk, bn, bk in
                   itertools.product((1, 2, 4), (16, 32, 64), (128, 256))],
    "matmul_swiglu": [dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st) for bn, bk, w, st in
                      itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 4))],
}
SWEEP["matmul_concat"] = SWEEP["matmul_add"]


def ops(shape: dict) -> dict:
    """name -> (kernel, contraction K, each weight matrix's output columns) of a layer's projections."""
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    return {"o": ("matmul_add", q, (h,)), "down": ("matmul_add", i, (h,)), "gate_up": ("matmul_swiglu", h, (i, i)),
            "qkv": ("matmul_concat", h, (q, kv, kv))}


def timed(kernel: str, k: int, widths: tuple[int, ...], rows: int, layers: int, impl: str, config: dict):
    """(jitted fn, args): ``kernel`` over ``layers`` layers' weights (``residual + h @ w``, SwiGLU of h times
    the gate and up weights, or h times each weight side by side), each layer's output feeding the next layer's
    input."""
    import jax
    import jax.numpy as jnp

    from jrl.kernels import decode_linear

    fn = getattr(decode_linear, kernel)
    keys = jax.random.split(jax.random.key(0), layers * len(widths) + 2)
    h = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    mats = [[0.02 * jax.random.normal(keys[2 + len(widths) * j + i], (k, n), jnp.bfloat16)
             for i, n in enumerate(widths)] for j in range(layers)]
    res = jax.random.normal(keys[1], (rows, widths[0]), jnp.bfloat16)

    def run(h, mats, res):
        total = jnp.zeros((), jnp.float32)
        for ws in mats:
            if kernel == "matmul_concat":
                out = fn(h, ws, impl=impl, **config)
            else:
                out = fn(h, *ws, *([res] if kernel == "matmul_add" else []), impl=impl, **config)
            h = h.at[:, 0].add(out[:, 0])  # the next layer waits for this one
            total = total + out[0, 0].astype(jnp.float32)
        return total

    return jax.jit(run), (h, mats, res)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--ops", default="o,down,gate_up,qkv")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import jax

    shape = SHAPES[args.shape]
    for name in args.ops.split(","):
        kernel, k, widths = ops(shape)[name]
        configs = [("reference", {}), ("pallas_gpu", {})]
        configs += [("pallas_gpu", c) for c in SWEEP[kernel]] if args.sweep else []
        for impl, config in configs:
            try:
                fn, fargs = timed(kernel, k, widths, args.rows, args.layers, impl, config)
                us = 1e3 * bench(fn, *fargs)["ms"] / args.layers
                row = dict(bench="decode_linear", shape=args.shape, op=name, rows=args.rows, k=k, n=sum(widths),
                           impl=impl, config=config, us_per_layer=round(us, 2),
                           weight_tbs=round(2 * k * sum(widths) / us / 1e6, 3))
            except Exception as e:  # a configuration Triton cannot compile
                row = dict(bench="decode_linear", op=name, impl=impl, config=config, error=repr(e)[:300])
            row["device"] = jax.devices()[0].device_kind
            report(row, args.out)


if __name__ == "__main__":
    main()
