"""Fused logprob+entropy benchmark: forward+backward time and peak device memory of jrl's fused
implementations vs the naive XLA version (full [N, V] float32 logits) and vs the lm_head matmul's own
forward+backward (``h @ W`` -> bf16 logits, then dh and dW from a bf16 cotangent).

    python benchmarks/kernels_logprobs.py [--N 16384] [--H 4096] [--V 151936] [--sweep]
                                          [--variants naive,xla,triton,triton_bwdxla,triton_save,matmul]

Each variant runs in its own child process (``--variant NAME``) so that ``peak_bytes_in_use`` is its
own. Triton variants are ``triton`` plus optional ``_``-joined options: ``bwdxla`` (dz by XLA),
``c16k`` (16384-column backward chunks), ``save`` (``save_probs``: no logits recompute in the backward,
at the cost of an [N, V] buffer in the compute dtype). ``--sweep`` first times the Triton forward kernel
and the backward dz kernel over a few tile configs (one child process) and runs the triton variants with
the fastest. Prints markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import kernels_common as C

HERE = os.path.dirname(os.path.abspath(__file__))


def _inputs(n, h, v, seed=0):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.key(seed), 5)
    hidden = jax.random.normal(k[0], (n, h), jnp.bfloat16)
    lm_head = (jax.random.normal(k[1], (h, v), jnp.float32) * (2.0 / h ** 0.5)).astype(jnp.bfloat16)
    targets = jax.random.randint(k[2], (n,), 0, v, jnp.int32)
    g_lp = jax.random.normal(k[3], (n,), jnp.float32)
    g_ent = jax.random.normal(k[4], (n,), jnp.float32)
    return hidden, lm_head, targets, g_lp, g_ent


def run_variant(args):
    import jax
    import jax.numpy as jnp

    from jrl.kernels import logprobs
    from jrl.kernels.logprobs import reference

    n, h, v = args.N, args.H, args.V
    hidden, lm_head, targets, g_lp, g_ent = _inputs(n, h, v)
    cfg = json.loads(args.config) if args.config else {}
    name = args.variant
    io_bytes = 2 * (hidden.size * 2 + lm_head.size * 2) + targets.size * 4 + 4 * n * 4  # inputs + grads + vectors
    # Everything the step reads is an argument: a closed-over array would be baked into the HLO as a
    # constant (the [N, V] cotangent of the matmul baseline is 5 GB).
    if name == "matmul":
        aux = (jax.random.normal(jax.random.key(9), (n, v), jnp.bfloat16),)
        io_bytes += 2 * n * v * 2  # cotangent input and logits output, both [N, V] bf16

        def fwd(hh, ww, aux):
            return hh @ ww

        def fb(hh, ww, aux):
            o, vjp = jax.vjp(lambda a, b: a @ b, hh, ww)
            return (o, *vjp(aux[0]))
    else:
        aux = (targets, g_lp, g_ent)
        if name == "naive":
            def lp_fn(hh, ww, t):
                return reference.token_logprobs(hh, ww, t, with_entropy=True)
        else:
            kw = {}
            if name.startswith("triton"):
                from jrl.kernels.logprobs import triton as T

                c = dict(cfg)
                opts = {"bwdxla": ("bwd", "xla"), "c16k": ("chunk_v", 16384), "save": ("save_probs", True)}
                for opt in name.split("_")[1:]:
                    if opt not in opts:
                        raise SystemExit(f"unknown triton variant option {opt!r} in {name!r}; options: {list(opts)}")
                    c[opts[opt][0]] = opts[opt][1]
                kw = {"config": T.Config(**c)}
            impl = "triton" if name.startswith("triton") else name

            def lp_fn(hh, ww, t):
                return logprobs.token_logprobs(hh, ww, t, with_entropy=True, impl=impl, **kw)

        def fwd(hh, ww, aux):
            return lp_fn(hh, ww, aux[0])

        def fb(hh, ww, aux):
            out, vjp = jax.vjp(lambda a, b: lp_fn(a, b, aux[0]), hh, ww)
            return (*out, *vjp((aux[1], aux[2])))

    res = {"variant": name}
    fb_j = jax.jit(fb)
    try:
        compiled = fb_j.lower(hidden, lm_head, aux).compile()
        ma = compiled.memory_analysis()
        res["temp_bytes"] = getattr(ma, "temp_size_in_bytes", None)
    except Exception as e:  # noqa: BLE001
        res["temp_bytes"] = None
        res["compile_note"] = f"{type(e).__name__}: {str(e)[:200]}"
    r = C.bench(fb_j, hidden, lm_head, aux, reps=args.reps, max_inner=3)
    res["fb_ms"] = r["ms"]
    res["fb_spread"] = [r["min_ms"], r["max_ms"]]
    res["peak_bytes"] = C.peak_bytes()
    res["io_bytes"] = io_bytes
    if name != "matmul" and name != "naive":
        out = fb_j(hidden, lm_head, aux)
        ref = jax.jit(lambda hh, ww, t, gl, ge: (lambda o, vjp: (*o, *vjp((gl, ge))))(
            *jax.vjp(lambda a, b: reference.token_logprobs(a, b, t, with_entropy=True), hh, ww)))
        # The check against the naive path at full size needs its ~30 GB; do it only when asked.
        if args.check:
            want = ref(hidden, lm_head, targets, g_lp, g_ent)
            res["rel_err"] = [float(jnp.linalg.norm((o.astype(jnp.float32) - w.astype(jnp.float32)).ravel())
                                    / jnp.linalg.norm(w.astype(jnp.float32).ravel())) for o, w in zip(out, want)]
        res["finite"] = bool(all(bool(jnp.isfinite(o.astype(jnp.float32)).all()) for o in out))
    res["fwd_ms"] = C.bench(jax.jit(fwd), hidden, lm_head, aux, reps=args.reps, max_inner=3)["ms"]
    print("RESULT " + json.dumps(res), flush=True)


def run_sweep(args):
    import jax
    import jax.numpy as jnp

    from jrl.kernels.logprobs import triton as T
    from jrl.kernels.logprobs._common import Flags

    n, h, v = args.N, args.H, args.V
    hidden, lm_head, targets, g_lp, g_ent = _inputs(n, h, v)
    inv_temp = jnp.float32(1.0)
    flags = Flags(with_entropy=True)
    fwd_cands = [dict(fwd_block_n=128, fwd_block_v=256, fwd_block_k=64, fwd_warps=8, fwd_stages=3),
                 dict(fwd_block_n=128, fwd_block_v=256, fwd_block_k=64, fwd_warps=8, fwd_stages=4),
                 dict(fwd_block_n=256, fwd_block_v=128, fwd_block_k=64, fwd_warps=8, fwd_stages=4),
                 dict(fwd_block_n=128, fwd_block_v=256, fwd_block_k=32, fwd_warps=8, fwd_stages=5),
                 dict(fwd_block_n=128, fwd_block_v=256, fwd_block_k=64, fwd_warps=8, fwd_stages=3, num_splits=6)]
    best_f = None
    print("| sweep | kernel | config | ms | TFLOP/s |\n|---|---|---|---|---|", flush=True)
    for c in fwd_cands:
        cfg = T.Config(**c)
        f = jax.jit(lambda a, b, t, cfg=cfg: T._forward(a, b, t, inv_temp, flags, cfg)[:2])
        try:
            ms = C.bench(f, hidden, lm_head, targets, reps=5, max_inner=3)["ms"]
        except Exception as e:  # noqa: BLE001
            print(f"| sweep | fwd | {c} | failed: {type(e).__name__}: {str(e)[:200]} | |", flush=True)
            continue
        print(f"| sweep | fwd | {c} | {ms:.2f} | {2 * n * h * v / ms / 1e9:.0f} |", flush=True)
        if best_f is None or ms < best_f[0]:
            best_f = (ms, c)
    lse = jnp.zeros((n,), jnp.float32) + 12.0
    ent = jnp.zeros((n,), jnp.float32) + 5.0
    width = 8192
    bwd_cands = [dict(bwd_block_n=128, bwd_block_v=256, bwd_block_k=64, bwd_warps=8, bwd_stages=3),
                 dict(bwd_block_n=128, bwd_block_v=256, bwd_block_k=64, bwd_warps=8, bwd_stages=4),
                 dict(bwd_block_n=256, bwd_block_v=128, bwd_block_k=64, bwd_warps=8, bwd_stages=4),
                 dict(bwd_block_n=128, bwd_block_v=256, bwd_block_k=64, bwd_warps=8, bwd_stages=3, bwd_group_n=16)]
    best_b = None
    for c in bwd_cands:
        cfg = T.Config(**c)
        f = jax.jit(lambda a, b, t, cfg=cfg: T._dz_triton(a, b, t, inv_temp, lse, ent, g_lp, g_ent, flags, cfg,
                                                            jnp.bfloat16, jnp.int32(0), width))
        try:
            ms = C.bench(f, hidden, lm_head, targets, reps=5)["ms"]
        except Exception as e:  # noqa: BLE001
            print(f"| sweep | bwd dz | {c} | failed: {type(e).__name__}: {str(e)[:200]} | |", flush=True)
            continue
        print(f"| sweep | bwd dz ({width} cols) | {c} | {ms:.3f} | {2 * n * h * width / ms / 1e9:.0f} |", flush=True)
        if best_b is None or ms < best_b[0]:
            best_b = (ms, c)
    # The same product through XLA (cuBLAS) for comparison.
    f = jax.jit(lambda a, b: jnp.dot(a, jax.lax.dynamic_slice_in_dim(b, 0, width, axis=1),
                                     preferred_element_type=jnp.float32))
    ms = C.bench(f, hidden, lm_head, reps=5)["ms"]
    print(f"| sweep | XLA dot f32 out ({width} cols) | - | {ms:.3f} | {2 * n * h * width / ms / 1e9:.0f} |", flush=True)
    best = {**(best_f[1] if best_f else {}), **(best_b[1] if best_b else {})}
    print("BEST " + json.dumps(best), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--N", type=int, default=16384)
    ap.add_argument("--H", type=int, default=4096)
    ap.add_argument("--V", type=int, default=151936)
    ap.add_argument("--variants", default="matmul,naive,xla,triton,triton_bwdxla,triton_c16k,triton_save")
    ap.add_argument("--variant", default=None, help="(child) run one variant")
    ap.add_argument("--config", default=None, help="(child) triton Config fields as JSON")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--check", action="store_true", help="also compare against the naive path in each child")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--timeout", type=int, default=240)
    args = ap.parse_args()
    if args.variant:
        return run_variant(args)
    if args.sweep_child:
        return run_sweep(args)

    print(f"# logprobs benchmark\n\n{C.env_line()}\n\ncommand: python {' '.join(sys.argv)}\n", flush=True)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    base = [sys.executable, os.path.join(HERE, "kernels_logprobs.py"), "--N", str(args.N), "--H", str(args.H),
            "--V", str(args.V), "--reps", str(args.reps)]
    config = None
    if args.sweep:
        p = subprocess.run(base + ["--sweep-child"], capture_output=True, text=True, env=env, timeout=args.timeout)
        for line in p.stdout.splitlines():
            if line.startswith("BEST "):
                config = line[5:]
            else:
                print(line, flush=True)
        if p.returncode:
            print(f"sweep failed (rc {p.returncode}): {p.stderr[-2000:]}", flush=True)
        print(f"\nchosen triton config: {config}\n", flush=True)
    rows = {}
    for name in args.variants.split(","):
        cmd = base + ["--variant", name] + (["--config", config] if config and name.startswith("triton") else [])
        if args.check:
            cmd.append("--check")
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{name}: timed out after {args.timeout}s", flush=True)
            continue
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if not got:
            print(f"{name}: failed (rc {p.returncode}): {p.stderr[-1500:]}", flush=True)
            continue
        rows[name] = json.loads(got[-1][7:])
    mm = rows.get("matmul", {}).get("fb_ms")
    nv = rows.get("naive", {}).get("fb_ms")
    print(f"N={args.N} H={args.H} V={args.V}, bf16 inputs, logprobs + entropy, forward+backward (dh, dW)\n")
    print("| variant | fwd ms | fwd+bwd ms | x naive | x matmul fwd+bwd | peak GiB | peak - inputs/grads GiB | XLA temp GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        pk = r.get("peak_bytes")
        over = None if pk is None else pk - r["io_bytes"]
        print(f"| {name} | {r['fwd_ms']:.1f} | {r['fb_ms']:.1f} | {r['fb_ms'] / nv if nv else float('nan'):.2f} | "
              f"{r['fb_ms'] / mm if mm else float('nan'):.2f} | {C.gib(pk)} | {C.gib(over)} | {C.gib(r.get('temp_bytes'))} |")
    print("\n" + json.dumps(rows))


if __name__ == "__main__":
    main()
