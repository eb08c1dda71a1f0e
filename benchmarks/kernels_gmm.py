"""Grouped-matmul benchmark: jrl.kernels.moe.gmm implementations vs ``jax.lax.ragged_dot`` and vs a dense
matmul of the same FLOPs, forward and forward+backward, uniform and skewed group sizes.

    python benchmarks/kernels_gmm.py [--T 32768] [--K 2048] [--N 1024] [--E 8,64,128]
                                     [--impls triton,reference] [--sweep [triton,mosaic_gpu]]

``--impls`` may also name ``tokamax:mosaic`` / ``tokamax:triton``: tokamax's ``ragged_dot`` with that
implementation (default configs, no autotuning), for comparison (tokamax must be installed; it is not a jrl
dependency).

``--sweep`` first times each Triton pass (fwd, dlhs, tgmm) alone over a few tile configs, per E (groups of the
first of ``--dists``), and uses the fastest per pass and E for the main table (and prints them); without it the
implementation's default tile table is used. ``--sweep mosaic_gpu`` (or ``--sweep`` with ``mosaic_gpu`` among
``--impls``) times the Mosaic kernel's passes (fwd, dlhs) alone over a few configs and only prints them (the main
table runs its shipped config). Times are medians of back-to-back dispatches
(see kernels_common.bench); TFLOP/s counts 2*T*K*N per matmul (x3 for forward+backward). "skewed":
expert e gets a share proportional to (e+1)^-1.2, the last quarter of the experts get no tokens; "routed":
multinomial counts of equal expected size (a router's), so group boundaries fall anywhere.
Prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import sys

import kernels_common as C  # noqa: F401  (puts the repo on sys.path)


def group_sizes(t: int, e: int, dist: str):
    import numpy as np

    if dist == "uniform":
        gs = np.full(e, t // e)
    elif dist == "routed":  # multinomial: group boundaries anywhere, as a router's counts
        gs = np.random.default_rng(e).multinomial(t, np.full(e, 1.0 / e))
    elif dist == "skewed":
        live = e - e // 4
        p = np.zeros(e)
        p[:live] = (np.arange(live) + 1.0) ** -1.2
        gs = np.floor(p / p.sum() * t)
    else:
        raise ValueError(dist)
    gs = gs.astype(np.int32)
    gs[0] += t - gs.sum()
    return gs


def sweep(lhs, rhs, gs, dout, log):
    import jax

    from jrl.kernels.moe import triton as T

    # 128x128x64 with 3 stages (96 KB of shared memory) fits two programs per SM; the 5-6 stage configs
    # keep more loads in flight for the memory-heavy many-expert shapes.
    gcands = [T.GmmConfig(128, 256, 64, 8, 4), T.GmmConfig(128, 256, 64, 8, 3), T.GmmConfig(128, 128, 64, 4, 4),
              T.GmmConfig(128, 128, 64, 4, 3), T.GmmConfig(128, 128, 64, 8, 3), T.GmmConfig(256, 128, 64, 8, 3),
              T.GmmConfig(256, 128, 64, 8, 4), T.GmmConfig(64, 256, 64, 4, 4),
              T.GmmConfig(128, 256, 32, 8, 5), T.GmmConfig(128, 256, 32, 8, 6), T.GmmConfig(128, 128, 64, 4, 6)]
    tcands = [T.TgmmConfig(128, 128, 32, 4, 4), T.TgmmConfig(128, 128, 64, 8, 3), T.TgmmConfig(128, 256, 64, 8, 3),
              T.TgmmConfig(128, 256, 32, 8, 4), T.TgmmConfig(128, 128, 32, 8, 4), T.TgmmConfig(256, 128, 32, 8, 4)]
    best = {}
    for pass_, cands in (("fwd", gcands), ("dlhs", gcands), ("tgmm", tcands)):
        rows = []
        for cfg in cands:
            if pass_ == "fwd":
                f = jax.jit(lambda a, b, g, cfg=cfg: T.gmm_call(a, b, g, transpose_rhs=False, out_dtype=a.dtype, cfg=cfg))
                args = (lhs, rhs, gs)
            elif pass_ == "dlhs":
                f = jax.jit(lambda d, b, g, cfg=cfg: T.gmm_call(d, b, g, transpose_rhs=True, out_dtype=d.dtype, cfg=cfg))
                args = (dout, rhs, gs)
            else:
                f = jax.jit(lambda a, d, g, cfg=cfg: T.tgmm_call(a, d, g, out_dtype=a.dtype, cfg=cfg))
                args = (lhs, dout, gs)
            try:
                r = C.bench(f, *args, reps=5)
                rows.append((r["ms"], cfg))
                log(f"| sweep | {pass_} | {cfg} | {r['ms']:.3f} |")
            except Exception as e:  # noqa: BLE001  (a config that does not compile/fit is skipped)
                log(f"| sweep | {pass_} | {cfg} | failed: {type(e).__name__}: {str(e)[:200]} |")
        best[pass_] = min(rows, key=lambda x: x[0])[1]
    return T.Configs(fwd=best["fwd"], dlhs=best["dlhs"], tgmm=best["tgmm"])


def sweep_mosaic(lhs, rhs, gs, dout, log):
    """Time the Mosaic kernel's forward and input-gradient passes alone over a few configs (printed only)."""
    import jax

    from jrl.kernels.moe import mosaic_gpu_kernel as MK

    cands = [MK.MosaicGmmConfig(), MK.MosaicGmmConfig(row_align=None), MK.MosaicGmmConfig(delay_release=1),
             MK.MosaicGmmConfig(stages=3, out_slots=2), MK.MosaicGmmConfig(split="m"),
             MK.MosaicGmmConfig(tile_n=64, stages=5)]
    for pass_ in ("fwd", "dlhs"):
        transpose = pass_ == "dlhs"
        a = dout if transpose else lhs
        for cfg in cands:
            reason = MK.unsupported_reason(a.shape, a.dtype, rhs.shape, rhs.dtype, transpose_rhs=transpose, cfg=cfg)
            if reason:
                log(f"| sweep | mosaic {pass_} | {cfg} | skipped: {reason} |")
                continue
            f = jax.jit(lambda a, b, g, cfg=cfg, tr=transpose: MK.gmm_call(a, b, g, transpose_rhs=tr,
                                                                          out_dtype=a.dtype, cfg=cfg))
            try:
                log(f"| sweep | mosaic {pass_} | {cfg} | {C.bench(f, a, rhs, gs, reps=5)['ms']:.3f} |")
            except Exception as e:  # noqa: BLE001  (a config that does not compile/fit is skipped)
                log(f"| sweep | mosaic {pass_} | {cfg} | failed: {type(e).__name__}: {str(e)[:200]} |")


def _op(impl: str, kw: dict):
    """``(lhs, rhs, group_sizes) -> out`` of a jrl gmm implementation or of ``tokamax:<implementation>``."""
    if impl.startswith("tokamax:"):
        import tokamax

        return lambda a, b, g: tokamax.ragged_dot(a, b, g, implementation=impl.split(":", 1)[1])
    from jrl.kernels import moe

    return lambda a, b, g: moe.gmm(a, b, g, impl=impl, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=32768)
    ap.add_argument("--K", type=int, default=2048)
    ap.add_argument("--N", type=int, default=1024)
    ap.add_argument("--E", default="8,64,128")
    ap.add_argument("--dists", default="uniform,skewed")
    ap.add_argument("--impls", default="triton,reference")
    ap.add_argument("--sweep", nargs="?", const="triton,mosaic_gpu", default="",
                    help="implementations whose tile configs to sweep first (bare flag: both, where in --impls)")
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    def log(s):
        print(s, flush=True)

    log(f"# gmm benchmark\n\n{C.env_line()}\n\ncommand: python {' '.join(sys.argv)}\n")
    t, k, n = args.T, args.K, args.N
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((t, k)), jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal((t, n)), jnp.bfloat16)
    configs_by_e = {}
    impls = args.impls.split(",")
    swept = [x for x in args.sweep.split(",") if x and x in impls]
    if swept:
        log("| sweep E | pass | config | ms |\n|---|---|---|---|")
        for e in [int(x) for x in args.E.split(",")]:
            rhs = jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k), jnp.bfloat16)
            gs = jnp.asarray(group_sizes(t, e, args.dists.split(",")[0]))
            elog = lambda s, e=e: log(s.replace("| sweep |", f"| {e} |", 1))  # noqa: E731
            if "triton" in swept:
                configs_by_e[e] = sweep(lhs, rhs, gs, dout, elog)
                log(f"\nE={e}: chosen per-pass configs: {configs_by_e[e]}\n")
            if "mosaic_gpu" in swept:
                sweep_mosaic(lhs, rhs, gs, dout, elog)

    flops = 2.0 * t * k * n
    w2 = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.bfloat16)
    dense_f = jax.jit(lambda a, b: a @ b)
    dense_fb = jax.jit(lambda a, b, g: (lambda o, vjp: (o, *vjp(g)))(*jax.vjp(lambda x, y: x @ y, a, b)))
    d_f = C.bench(dense_f, lhs, w2, reps=args.reps)["ms"]
    d_fb = C.bench(dense_fb, lhs, w2, dout, reps=args.reps)["ms"]
    log(f"dense [{t},{k}]x[{k},{n}] bf16: fwd {d_f:.3f} ms ({flops / d_f / 1e9:.1f} TFLOP/s), "
        f"fwd+bwd {d_fb:.3f} ms ({3 * flops / d_fb / 1e9:.1f} TFLOP/s)\n")
    log("| E | groups | impl | fwd ms | fwd TFLOP/s | fwd % dense | fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd % dense | max rel err vs ragged_dot |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for e in [int(x) for x in args.E.split(",")]:
        rhs = jnp.asarray(rng.standard_normal((e, k, n)) / np.sqrt(k), jnp.bfloat16)
        for dist in args.dists.split(","):
            gs = jnp.asarray(group_sizes(t, e, dist))
            ref_out = None
            configs = configs_by_e.get(e)
            for impl in sorted(impls, key=lambda x: x != "reference"):  # reference first
                kw = {"configs": configs} if (impl == "triton" and configs is not None) else {}
                op = _op(impl, kw)
                f = jax.jit(op)

                def fb_(a, b, g, d, op=op):
                    o, vjp = jax.vjp(lambda x, y: op(x, y, g), a, b)
                    return (o, *vjp(d))

                fb = jax.jit(fb_)
                reps = 3 if impl == "reference" else args.reps
                try:
                    tf = C.bench(f, lhs, rhs, gs, reps=reps, max_inner=5 if impl == "reference" else 50)["ms"]
                    tfb = C.bench(fb, lhs, rhs, gs, dout, reps=reps, max_inner=3 if impl == "reference" else 50)["ms"]
                    outs = fb(lhs, rhs, gs, dout)
                    if impl == "reference":
                        ref_out = outs
                    err = ""
                    if ref_out is not None and impl != "reference":
                        err = max(float(jnp.linalg.norm((o.astype(jnp.float32) - r.astype(jnp.float32)).ravel())
                                        / jnp.linalg.norm(r.astype(jnp.float32).ravel())) for o, r in zip(outs, ref_out))
                        err = f"{err:.1e}"
                except Exception as ex:  # noqa: BLE001
                    log(f"| {e} | {dist} | {impl} | failed: {type(ex).__name__}: {str(ex)[:300]} |")
                    continue
                row = dict(E=e, dist=dist, impl=impl, fwd_ms=tf, fwd_tflops=flops / tf / 1e9,
                           fb_ms=tfb, fb_tflops=3 * flops / tfb / 1e9, dense_fwd_ms=d_f, dense_fb_ms=d_fb)
                results.append(row)
                log(f"| {e} | {dist} | {impl} | {tf:.3f} | {row['fwd_tflops']:.1f} | {100 * d_f / tf:.0f}% | "
                    f"{tfb:.3f} | {row['fb_tflops']:.1f} | {100 * d_fb / tfb:.0f}% | {err} |")
    log("\n" + json.dumps({"dense_fwd_ms": d_f, "dense_fb_ms": d_fb, "configs": {e: str(c) for e, c in configs_by_e.items()},
                           "rows": results}))


if __name__ == "__main__":
    main()
