"""Runs the logprob Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1) with torch tensors
and checks them against a float64 numpy reference. Executed as a subprocess by test_logprobs.py (the
variable must be set before triton is imported); exits non-zero on a mismatch."""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from jrl.kernels.logprobs import triton_kernels as K  # noqa: E402
from kernels_testlib import allow_loop_bounds_from_memory  # noqa: E402

allow_loop_bounds_from_memory()


def ref(h, w, tgt, inv_temp):
    l = (h.astype(np.float64) @ w.astype(np.float64)) * inv_temp
    m = l.max(1, keepdims=True)
    lse = (m + np.log(np.exp(l - m).sum(1, keepdims=True)))[:, 0]
    p = np.exp(l - lse[:, None])
    ent = lse - (p * l).sum(1)
    logp = l[np.arange(len(tgt)), tgt] - lse
    return l, lse, logp, ent, p


def relerr(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main():
    rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    worst = 0.0
    for (n, h, v, bn, bv, bk, splits) in [(37, 48, 300, 16, 32, 16, 3), (16, 32, 64, 16, 16, 32, 8)]:
        hid = rng.standard_normal((n, h)).astype(np.float32)
        w = (rng.standard_normal((h, v)) * 0.3).astype(np.float32)
        tgt = rng.integers(0, v, n).astype(np.int32)
        inv_temp = np.float32(1 / 0.7)
        l, lse, logp, ent, p = ref(hid, w, tgt, inv_temp)
        v_tiles = -(-v // bv)
        v_per_split = -(-v_tiles // splits) * bv
        grid = (-(-n // bn) * splits,)
        args = [torch.from_numpy(hid), torch.from_numpy(w), torch.from_numpy(tgt), torch.tensor([inv_temp])]
        errs = []
        for save in (False, True):
            parts = [torch.full((splits, n), float("nan")) for _ in range(4)]
            e_out = torch.full((n, v) if save else (1,), float("nan"))
            mt_out = torch.full((n, v_tiles) if save else (1,), float("nan"))
            K.lp_fwd_kernel[grid](*args, *parts, e_out, mt_out, n, h, v, v_per_split, BLOCK_N=bn, BLOCK_V=bv,
                                  BLOCK_K=bk, NUM_SPLITS=splits, WITH_ENT=True, UPCAST=True, EVEN_H=(h % bk == 0),
                                  SAVE=save)
            m, s, t, tg = (x.numpy().astype(np.float64) for x in parts)
            big = m.max(0)
            sc = np.exp(m - big)
            lse_k = big + np.log((s * sc).sum(0))
            logp_k = tg.sum(0) - lse_k
            ent_k = lse_k - (t * sc).sum(0) / (s * sc).sum(0)
            errs += [relerr(logp_k, logp), relerr(ent_k, ent)]
            if save:  # the saved tiles give back p and l: p = e * exp(mt - lse), l = mt + log(e)
                e_k = e_out.numpy().astype(np.float64)
                mt_k = np.repeat(mt_out.numpy().astype(np.float64), bv, axis=1)[:, :v]
                assert np.isfinite(e_k).all() and np.isfinite(mt_k).all(), "lp_fwd_kernel left unsaved entries"
                errs += [relerr(e_k * np.exp(mt_k - lse[:, None]), p), relerr(mt_k + np.log(e_k), l)]
        # dz over two chunks (one full, one remainder)
        glp = rng.standard_normal(n).astype(np.float32)
        gent = rng.standard_normal(n).astype(np.float32)
        onehot = np.zeros_like(l)
        onehot[np.arange(n), tgt] = 1
        dz_ref = (glp[:, None] * (onehot - p) - gent[:, None] * p * (l - lse[:, None] + ent[:, None])) * inv_temp
        cv = max(16, (v // 2) // 16 * 16)  # chunk starts are multiples of 16 (as the caller guarantees)
        for v0, width in [(0, cv), (cv, v - cv)]:
            dz = torch.full((n, width), float("nan"))
            grid = (-(-n // bn) * -(-width // bv),)
            K.lp_bwd_dz_kernel[grid](*args, torch.tensor([v0], dtype=torch.int32),
                                     torch.from_numpy(lse.astype(np.float32)), torch.from_numpy(ent.astype(np.float32)),
                                     torch.from_numpy(glp), torch.from_numpy(gent), dz, n, h, v, width,
                                     BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, GROUP_N=2, WITH_ENT=True, UPCAST=True,
                                     EVEN_H=(h % bk == 0))
            assert np.isfinite(dz.numpy()).all(), "lp_bwd_dz_kernel left unwritten (NaN) output"
            errs.append(relerr(dz.numpy(), dz_ref[:, v0:v0 + width]))
        errs_txt = ["%.2e" % e for e in errs]
        print(f"n={n} h={h} v={v} splits={splits}: relerr logp/ent, saved logp/ent/p/l, dz {errs_txt}")
        worst = max(worst, *errs)
    print(f"worst relerr {worst:.2e}")
    sys.exit(0 if worst < 1e-5 else 1)


if __name__ == "__main__":
    main()
