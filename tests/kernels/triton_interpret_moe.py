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
from kernels_testlib import np_gmm, np_tgmm  # noqa: E402


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
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN_K=(k % bk == 0), IEEE=True)
        o = out.numpy()
        assert np.isfinite(o).all(), "gmm_kernel left unwritten (NaN) output"
        err = relerr(o, np_gmm(lhs, rhs.transpose(0, 2, 1) if transpose else rhs, gs))
        print(f"gmm t={t} k={k} n={n} gs={gs} transpose={transpose}: relerr {err:.2e}")
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
    print(f"worst relerr {worst:.2e}")
    sys.exit(0 if worst < 1e-5 else 1)


if __name__ == "__main__":
    main()
