"""Runs the MoE Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1) with torch tensors and
checks them against numpy. Executed as a subprocess by test_moe.py (the variable must be set before
triton is imported); exits non-zero on a mismatch."""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

import jax.numpy as jnp  # noqa: E402

from jrl.kernels.moe import triton_kernels as K  # noqa: E402
from jrl.kernels.moe.schedule import group_bounds, tile_schedule  # noqa: E402
from kernels_testlib import allow_loop_bounds_from_memory, np_gmm, np_tgmm  # noqa: E402

allow_loop_bounds_from_memory()


def schedule(group_sizes, t, bm):
    tg, rs, re_ = tile_schedule(jnp.asarray(group_sizes), t, bm)
    st, en = group_bounds(jnp.asarray(group_sizes), t)
    return [torch.from_numpy(np.array(a)) for a in (tg, rs, re_, st, en)]


def relerr(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    worst = 0.0
    for (t, k, n, gs, bm, bn, bk, transpose) in [
        (37, 24, 40, [10, 0, 7, 3, 9], 16, 16, 16, False),   # rows past the sum, empty group, K % BK != 0
        (64, 32, 48, [16, 16, 16, 16], 16, 32, 16, False),
        (50, 40, 24, [0, 25, 0, 20], 32, 16, 32, True),       # transposed rhs (input-gradient pass)
    ]:
        e = len(gs)
        lhs = rng.standard_normal((t, k)).astype(np.float32)
        rhs = rng.standard_normal((e, n, k) if transpose else (e, k, n)).astype(np.float32)
        nout = n
        tg, rs, re_, st, en = schedule(np.array(gs, np.int32), t, bm)
        out = torch.full((t, nout), float("nan"), dtype=torch.float32)
        stride_rk, stride_rn = (1, k) if transpose else (n, 1)
        grid = (tg.shape[0] * (-(-nout // bn)),)
        K.gmm_kernel[grid](torch.from_numpy(lhs), torch.from_numpy(rhs), tg, rs, re_, out,
                           t, k, nout, e, rhs.shape[1] * rhs.shape[2], stride_rk, stride_rn,
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=(k % bk == 0), IEEE=True, FILL=True)
        o = out.numpy()
        assert np.isfinite(o).all(), "gmm_kernel left unwritten (NaN) output"
        want = np_gmm(lhs, rhs.transpose(0, 2, 1) if transpose else rhs, gs)
        err = relerr(o, want)
        print(f"gmm t={t} k={k} n={n} gs={gs} transpose={transpose}: relerr {err:.2e}")
        worst = max(worst, err)
        used = sum(gs)
        if used < t:  # FILL=False: the rows past the groups stay as they were (NaN), the others as with FILL
            out = torch.full((t, nout), float("nan"), dtype=torch.float32)
            K.gmm_kernel[grid](torch.from_numpy(lhs), torch.from_numpy(rhs), tg, rs, re_, out,
                               t, k, nout, e, rhs.shape[1] * rhs.shape[2], stride_rk, stride_rn,
                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=(k % bk == 0), IEEE=True, FILL=False)
            o = out.numpy()
            assert np.isnan(o[used:]).all(), "gmm_kernel FILL=False wrote rows past the groups"
            err = relerr(o[:used], want[:used])
            print(f"gmm FILL=False rows in use: relerr {err:.2e}")
            worst = max(worst, err)
        if not transpose:
            dout = rng.standard_normal((t, n)).astype(np.float32)
            outg = torch.full((e, k, n), float("nan"), dtype=torch.float32)
            bkt, bnt, bt = 16, 16, 16
            grid = (e * (-(-k // bkt)) * (-(-n // bnt)),)
            K.tgmm_kernel[grid](torch.from_numpy(lhs), torch.from_numpy(dout), st, en, outg, k, n,
                                BLOCK_K=bkt, BLOCK_N=bnt, BLOCK_T=bt, IEEE=True)
            o = outg.numpy()
            assert np.isfinite(o).all(), "tgmm_kernel left unwritten (NaN) output"
            err = relerr(o, np_tgmm(lhs, dout, gs))
            print(f"tgmm t={t} k={k} n={n} gs={gs}: relerr {err:.2e}")
            worst = max(worst, err)
    worst = max(worst, check_row_kernels(rng))
    print(f"worst relerr {worst:.2e}")
    sys.exit(0 if worst < 1e-5 else 1)


def check_row_kernels(rng) -> float:
    """take_rows (with and without a scale, indices past the source, storing their zeros or not) and the SwiGLU
    passes (rows past ``count`` left unwritten) against numpy; outputs start as NaN so that a row left unwritten
    shows: it must be one of those the kernel may skip, and every other row is written."""
    worst = 0.0
    nsrc, h, k, r = 7, 40, 3, 19
    src = rng.standard_normal((nsrc, h)).astype(np.float32)
    index = rng.permutation(nsrc * k + 4)[:r].astype(np.int32)  # some past nsrc * k: routed nowhere
    scale = rng.random(nsrc * k).astype(np.float32)
    live = index // k < nsrc
    for has_scale, fill in ((False, True), (True, True), (True, False)):
        out = torch.full((r, h), float("nan"), dtype=torch.float32)
        K.take_rows_kernel[(-(-r // 8), -(-h // 16))](torch.from_numpy(src), torch.from_numpy(index),
                                                      torch.from_numpy(scale), out, r, nsrc, h, k, has_scale, fill,
                                                      BLOCK_R=8, BLOCK_H=16)
        want = np.where(live[:, None], src[np.minimum(index // k, nsrc - 1)], 0)
        if has_scale:
            want = want * np.where(live, scale[np.minimum(index, nsrc * k - 1)], 0)[:, None]
        got = out.numpy()
        written = np.isfinite(got).all(1)
        assert (written == (live | fill)).all(), f"take_rows fill={fill}: rows written {written} (routed {live})"
        err = relerr(got[written], want[written])
        print(f"take_rows scale={has_scale} fill={fill}: relerr {err:.2e}")
        worst = max(worst, err)
    r, f, count = 21, 24, 13
    a, b, g = (rng.standard_normal((r, f)).astype(np.float32) for _ in range(3))
    live = (np.arange(r) < count)[:, None]
    sig = 1 / (1 + np.exp(-a))
    wants = {"swiglu fwd": [np.where(live, a * sig * b, 0)],
             "swiglu bwd": [np.where(live, g * b * sig * (1 + a * (1 - sig)), 0), np.where(live, g * a * sig, 0)]}
    grid = (-(-r // 8), -(-f // 16))
    for name, want in wants.items():
        outs = [torch.full((r, f), float("nan"), dtype=torch.float32) for _ in want]
        args = [torch.from_numpy(a), torch.from_numpy(b)] + ([torch.from_numpy(g)] if name == "swiglu bwd" else [])
        kernel = K.swiglu_fwd_kernel if name == "swiglu fwd" else K.swiglu_bwd_kernel
        kernel[grid](*args, torch.tensor([count], dtype=torch.int32), *outs, r, f, BLOCK_R=8, BLOCK_F=16)
        for got, w in zip(outs, want):
            written = np.isfinite(got.numpy()).all(1)
            assert (written == live[:, 0]).all(), f"{name}: rows written {written}, wanted those < {count}"
            err = relerr(got.numpy()[:count], w[:count])
            print(f"{name}: relerr {err:.2e}")
            worst = max(worst, err)
    return worst


if __name__ == "__main__":
    main()
