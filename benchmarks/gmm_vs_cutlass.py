"""jrl's grouped-matmul forward (and forward + backward) against PyTorch's CUTLASS kernel (``torch._grouped_mm``) in
alternation: every round times every side once, so a GPU whose clock drifts between runs (CUTLASS's own
forward moved by up to 13% between calls on one H200) moves all sides alike. Prints, per shape, each side's min and
median over the rounds and CUTLASS's time over the side's (speed ratio: above 1, the side is faster).

    python benchmarks/gmm_vs_cutlass.py [--rounds 4] [--sides mosaic_gpu,mosaic_gpu:row_blocks,triton]
                                        [--schedule-probe] [--backward]

Shapes: the grouped-matmul benchmark's (T=32768, K=2048, N=1024; E=64 and 128; uniform and skewed groups,
benchmarks/kernels_gmm.py) and the Qwen3-30B-A3B layer's two expert matmuls at 8,192 tokens x top-8 with a
router's (multinomial) group sizes. Sides: ``mosaic_gpu`` (the Mosaic kernel's shipped config),
``mosaic_gpu:row_blocks`` (row tiles at multiples of the tile height), ``triton``. ``--schedule-probe`` adds the
Mosaic kernel's tile schedule alone (the XLA kernels that turn group sizes into tiles, run before each launch).
``--backward`` adds forward + backward sides (the product and the gradients of both operands for one output
gradient): ``jrl.kernels.moe.gmm``'s implementations ``mosaic_gpu`` and ``triton`` among ``--sides`` (their
weight gradient is the Triton transposed kernel), against ``torch.autograd.grad`` through ``torch._grouped_mm``.
Each time is kernels_common.bench's median of 7 repetitions.
"""

from __future__ import annotations

import argparse
import json
import statistics

import kernels_common as C
from kernels_gmm import group_sizes

SHAPES = [(32768, 2048, 1024, 64, "uniform"), (32768, 2048, 1024, 64, "skewed"),
          (32768, 2048, 1024, 128, "uniform"), (32768, 2048, 1024, 128, "skewed"),
          (65536, 2048, 768, 128, "routed"), (65536, 768, 2048, 128, "routed")]


def jrl_sides(names, t, schedule_probe):
    """name -> jitted ``(lhs, rhs, group_sizes) -> out``."""
    import jax

    from jrl.kernels import moe
    from jrl.kernels.moe import mosaic_gpu_kernel as MK, schedule as S

    configs = {"mosaic_gpu": MK.DEFAULT_CONFIG, "mosaic_gpu:row_blocks": MK.MosaicGmmConfig(row_align=None)}
    sides = {}
    for name in names:
        if name in configs:
            sides[name] = jax.jit(lambda a, b, g, cfg=configs[name]: MK.gmm_call(
                a, b, g, transpose_rhs=False, out_dtype=a.dtype, cfg=cfg))
        else:
            sides[name] = jax.jit(lambda a, b, g, impl=name: moe.gmm(a, b, g, impl=impl))
    if schedule_probe:
        cfg = MK.DEFAULT_CONFIG
        sides["schedule alone"] = jax.jit(lambda a, b, g: S.aligned_tile_schedule(g, t, cfg.cta_m, cfg.tile_align))
    return sides


def backward_sides(names):
    """name -> jitted ``(lhs, rhs, group_sizes, dout) -> (out, dlhs, drhs)``: the forward and both gradients."""
    import jax

    from jrl.kernels import moe

    def fwd_bwd(lhs, rhs, gs, dout, impl):
        out, vjp = jax.vjp(lambda a, b: moe.gmm(a, b, gs, impl=impl), lhs, rhs)
        return out, *vjp(dout)  # the product returned too: a linear map's gradients do not need it, XLA would drop it

    return {f"{impl} fwd+bwd": jax.jit(lambda a, b, g, d, impl=impl: fwd_bwd(a, b, g, d, impl))
            for impl in names if impl in moe.available_impls()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sides", default="mosaic_gpu,mosaic_gpu:row_blocks,triton")
    ap.add_argument("--schedule-probe", action="store_true")
    ap.add_argument("--backward", action="store_true")
    args = ap.parse_args()

    import jax.numpy as jnp
    import numpy as np
    import torch

    print(f"# grouped matmul vs CUTLASS, alternating\n\n{C.env_line()}, torch {torch.__version__}\n",
          flush=True)
    rng = np.random.default_rng(0)
    results = {}
    for t, k, n, e, dist in SHAPES:
        lhs = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
        rhs = jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k), jnp.bfloat16)
        gs_np = group_sizes(t, e, dist)
        gs = jnp.asarray(gs_np)
        sides = {name: (f, (lhs, rhs, gs)) for name, f in jrl_sides(args.sides.split(","), t,
                                                                   args.schedule_probe).items()}
        x = torch.as_tensor(np.asarray(lhs.astype(jnp.float32)), device="cuda").to(torch.bfloat16)
        w = torch.as_tensor(np.asarray(jnp.swapaxes(rhs, 1, 2).astype(jnp.float32)), device="cuda").to(torch.bfloat16)
        offs = torch.as_tensor(gs_np, device="cuda").cumsum(0).to(torch.int32)

        def cutlass():
            with torch.no_grad():
                return torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)

        torch_sides = {"CUTLASS": cutlass}
        if args.backward:
            dout = jnp.asarray(rng.standard_normal((t, n)), jnp.bfloat16)
            sides.update({name: (f, (lhs, rhs, gs, dout)) for name, f in backward_sides(args.sides.split(",")).items()})
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            dout_t = torch.as_tensor(np.asarray(dout.astype(jnp.float32)), device="cuda").to(torch.bfloat16)
            torch_sides["CUTLASS fwd+bwd"] = lambda: torch.autograd.grad(
                torch._grouped_mm(xg, wg.transpose(-2, -1), offs=offs), (xg, wg), dout_t)
        _check_agree(sides)
        times = {name: [] for name in [*sides, *torch_sides]}
        for _ in range(args.rounds):
            for name, (f, inputs) in sides.items():
                times[name].append(C.bench(f, *inputs)["ms"])
            for name, f in torch_sides.items():
                times[name].append(C.bench(f, wait=lambda _: torch.cuda.synchronize())["ms"])
        key = f"T={t} K={k} N={n} E={e} {dist}"
        print(f"## {key}\n\n| side | min ms | median ms | CUTLASS / side (min) | CUTLASS / side (median) |\n"
              "|---|---|---|---|---|")
        for name, ts in times.items():
            peer = "CUTLASS fwd+bwd" if name.endswith("fwd+bwd") else "CUTLASS"
            c_min, c_med = min(times[peer]), statistics.median(times[peer])
            print(f"| {name} | {min(ts):.4f} | {statistics.median(ts):.4f} | {c_min / min(ts):.3f} | "
                  f"{c_med / statistics.median(ts):.3f} |", flush=True)
        print()
        results[key] = times
    print(json.dumps(results))


def _check_agree(sides: dict) -> None:
    """Every jrl side of one pass computes the same result (the first side of the pass is the yardstick)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    first = {}
    for name, (f, inputs) in sides.items():
        if name == "schedule alone":
            continue
        pass_name = "fwd+bwd" if name.endswith("fwd+bwd") else "fwd"
        outs = [np.asarray(o.astype(jnp.float32)) for o in jax.tree.leaves(f(*inputs))]
        ref_name, ref = first.setdefault(pass_name, (name, outs))
        for o, r in zip(outs, ref):
            assert np.abs(o - r).max() <= 1e-2 * np.abs(r).max(), f"{name} differs from {ref_name}"


if __name__ == "__main__":
    main()
