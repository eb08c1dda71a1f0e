"""Compiles every Triton kernel of jrl.kernels for an H100 (sm_90) with the local Triton -- no GPU
needed -- and checks the PTX for what makes them fast: Hopper tensor-core instructions (wgmma) and
pipelined asynchronous global->shared copies (cp.async) in the matmuls, 16-byte vector loads and stores in
the row kernels (which are bound by memory). Arrays are declared 16-byte aligned, as
jax-triton declares them. Exits non-zero when a kernel lacks either. Run by the kernel tests as a
subprocess (Triton's compiler state stays out of the test process)."""

import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from jrl.kernels.logprobs import triton_kernels as LK
from jrl.kernels.moe import triton_kernels as MK

TARGET = GPUTarget("cuda", 90, 32)
MATMUL_PATTERNS = {"wgmma": r"wgmma\.mma_async", "cp.async": r"cp\.async"}
ROW_PATTERNS = {"v4 loads": r"ld\.global[.\w]*\.v4", "v4 stores": r"st\.global[.\w]*\.v4"}
ROW_KERNELS = (MK.take_rows_kernel, MK.swiglu_fwd_kernel, MK.swiglu_bwd_kernel)


def compile_ptx(fn, pointer_types, consts, warps, stages):
    names = fn.arg_names
    signature = {n: ("constexpr" if n in consts else pointer_types[n]) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if signature[n].startswith("*")}
    src = ASTSource(fn, signature, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": warps, "num_stages": stages}).asm["ptx"]


def main():
    bf, f32, i32 = "*bf16", "*fp32", "*i32"
    cases = [
        ("gmm fwd", MK.gmm_kernel, dict(lhs_ptr=bf, rhs_ptr=bf, tile_group_ptr=i32, tile_row_ptr=i32, tile_end_ptr=i32,
                                       out_ptr=bf),
         dict(T=32768, KDIM=2048, NDIM=1024, num_groups=64, stride_re=2048 * 1024, stride_rk=1024, stride_rn=1,
              BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, EVEN_K=True, IEEE=False, FILL=True), 4, 4),
        ("gmm dlhs (rhs transposed)", MK.gmm_kernel,
         dict(lhs_ptr=bf, rhs_ptr=bf, tile_group_ptr=i32, tile_row_ptr=i32, tile_end_ptr=i32, out_ptr=bf),
         dict(T=32768, KDIM=1024, NDIM=2048, num_groups=64, stride_re=2048 * 1024, stride_rk=1, stride_rn=1024,
              BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, EVEN_K=True, IEEE=False, FILL=True), 4, 4),
        ("tgmm", MK.tgmm_kernel, dict(lhs_ptr=bf, dout_ptr=bf, group_start_ptr=i32, group_end_ptr=i32, out_ptr=bf),
         dict(KDIM=2048, NDIM=1024, BLOCK_K=128, BLOCK_N=128, BLOCK_T=64, IEEE=False), 4, 4),
        *[(f"logprobs fwd{' (save_probs)' if save else ''}", LK.lp_fwd_kernel,
           dict(h_ptr=bf, w_ptr=bf, tgt_ptr=i32, inv_temp_ptr=f32, m_ptr=f32, s_ptr=f32, t_ptr=f32, tg_ptr=f32,
                e_ptr=bf, mt_ptr=f32),
           dict(N=16384, H=4096, V=151936, v_per_split=16896, BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, NUM_SPLITS=9,
                WITH_ENT=True, UPCAST=False, EVEN_H=True, SAVE=save), 8, 3) for save in (False, True)],
        ("take_rows", MK.take_rows_kernel, dict(src_ptr=bf, index_ptr=i32, scale_ptr=f32, out_ptr=bf),
         dict(R=262144, NSRC=32768, H=2048, K=8, HAS_SCALE=False, FILL=False, BLOCK_R=16, BLOCK_H=512), 4, 1),
        ("take_rows scaled", MK.take_rows_kernel, dict(src_ptr=f32, index_ptr=i32, scale_ptr=f32, out_ptr=bf),
         dict(R=262144, NSRC=32768, H=2048, K=8, HAS_SCALE=True, FILL=True, BLOCK_R=16, BLOCK_H=512), 4, 1),
        ("swiglu fwd", MK.swiglu_fwd_kernel, dict(a_ptr=bf, b_ptr=bf, count_ptr=i32, out_ptr=bf),
         dict(R=262144, F=768, BLOCK_R=16, BLOCK_F=256), 4, 1),
        ("swiglu bwd", MK.swiglu_bwd_kernel, dict(a_ptr=bf, b_ptr=bf, g_ptr=bf, count_ptr=i32, da_ptr=bf, db_ptr=bf),
         dict(R=262144, F=768, BLOCK_R=16, BLOCK_F=256), 4, 1),
        ("logprobs bwd dz", LK.lp_bwd_dz_kernel,
         dict(h_ptr=bf, w_ptr=bf, tgt_ptr=i32, inv_temp_ptr=f32, voff_ptr=i32, lse_ptr=f32, ent_ptr=f32, glp_ptr=f32,
              gent_ptr=f32, dz_ptr=bf),
         dict(N=16384, H=4096, V=151936, CV=8192, BLOCK_N=128, BLOCK_V=128, BLOCK_K=64, GROUP_N=8, WITH_ENT=True,
              UPCAST=False, EVEN_H=True), 8, 3),
    ]
    bad = 0
    for name, fn, ptrs, consts, warps, stages in cases:
        ptx = compile_ptx(fn, ptrs, consts, warps, stages)
        wants = ROW_PATTERNS if fn in ROW_KERNELS else MATMUL_PATTERNS
        counts = {label: len(re.findall(pattern, ptx)) for label, pattern in wants.items()}
        ok = all(counts.values())
        bad += not ok
        print(f"{name}: {', '.join(f'{k} {v}' for k, v in counts.items())} -> {'ok' if ok else 'MISSING'}")
    print(f"triton {triton.__version__}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
