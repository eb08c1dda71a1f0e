"""The paged decode kernel compiled for an NVIDIA GPU on any machine (no GPU needed): registers, shared memory and
the instructions of its block loop, by opcode.

The kernel is lowered for CUDA with ``pallas_call(debug=True)``, which prints its Triton IR; that IR is compiled by
the installed ``triton`` package for the chosen architecture (its own ptxas) and disassembled with its nvdisasm.
The device compiles with the Triton inside jaxlib instead, so registers and counts differ a little from a GPU's
(e.g. 168 registers and 1,362 loop instructions on an H200 where this reports 202 and 1,370 for the same kernel):
use it to compare variants of a kernel before spending GPU time on them, not as a measurement of one.

    python benchmarks/kernel_sass.py --kv-dtype float8_e4m3fn --block-k 64 --warps 1
    python benchmarks/kernel_sass.py --kv-dtype bfloat16 --block-k 64 --warps 2 --sass out.sass
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_common import report  # noqa: E402

_INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def triton_ir(args) -> str:
    """The Triton module of one paged decode step's kernel, as ``pallas_call(debug=True)`` prints it."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl

    from jrl.kernels.attention import decode_pallas_gpu as kernel

    b, kv, g, d, page = args.rows, args.kv_heads, args.group, args.head_dim, args.page_size
    qkv = jnp.zeros((b, kv * g + 2 * kv, d), jnp.bfloat16)
    pool, rope = jnp.zeros((kv, args.pool_pages, page, d), args.kv_dtype), jnp.zeros((b, d), jnp.float32)
    table, ones = jnp.zeros((b, args.slots // page), jnp.int32), jnp.ones((b,), jnp.int32)

    def step(*a):
        return kernel.paged_decode_attention_append(*a, scale=d ** -0.5, splits=args.splits, block_k=args.block_k,
                                                    num_warps=args.warps, num_stages=args.stages, interpret=False)

    printed = io.StringIO()
    call = pl.pallas_call
    with contextlib.redirect_stdout(printed):
        kernel.pl.pallas_call = lambda *a, **k: call(*a, **{**k, "debug": True})
        try:
            jax.jit(step).trace(qkv, rope, rope, pool, pool, table, ones, ones, ones).lower(
                lowering_platforms=("cuda",))
        finally:
            kernel.pl.pallas_call = call
    return printed.getvalue()


def module_text(printed: str) -> str:
    """The printed module without its source locations (which the printer abbreviates past parsing)."""
    lines, depth = [], 0
    for line in printed[printed.index("module @"):].splitlines():
        line = re.sub(r'\s+\[unknown\]|\s+"[^"]*"\(#loc\d*\)|\s+#loc\d*$', "", line)
        lines.append(line)
        depth += line.count("{") - line.count("}")
        if depth == 0 and line.strip() == "}":
            break
    return "\n".join(lines)


def compile_sass(ttir: str, *, arch: int, warps: int, stages: int) -> tuple[dict, str]:
    """(resource usage, SASS text) of the Triton module ``ttir`` compiled for ``sm_<arch>``."""
    import triton
    from triton.backends.compiler import GPUTarget

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ttir"
        src.write_text(ttir)
        compiled = triton.compile(str(src), target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": warps, "num_stages": stages})
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)], capture_output=True,
                               text=True, check=True).stdout
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                              check=True).stdout
    resources = {k.lower(): int(v) for k, v in re.findall(r"(REG|STACK):(\d+)", usage)}
    resources["shared_bytes"] = int(compiled.metadata.shared)
    return resources, sass


def hot_loop(sass: str) -> list[str]:
    """The opcodes of the longest backward branch's body (the kernel's block loop)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\.(L_x_\d+):", line.strip()))}
    best: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\(\.(L_x_\d+)\)", line)
        if m and labels.get(m.group(1), i) < i:
            body = [x.group(1) for x in map(_INSTRUCTION.match, lines[labels[m.group(1)]:i + 1]) if x]
            best = max(best, body, key=len)
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-dtype", default="float8_e4m3fn")
    ap.add_argument("--block-k", type=int, default=64)
    ap.add_argument("--warps", type=int, default=1)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--splits", type=int, default=4)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--slots", type=int, default=8448, help="the page table's width in slots")
    ap.add_argument("--pool-pages", type=int, default=4096)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    ap.add_argument("--top", type=int, default=25, help="opcodes listed")
    ap.add_argument("--sass", default=None, help="also write the whole SASS here")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    resources, sass = compile_sass(module_text(triton_ir(args)), arch=args.arch, warps=args.warps,
                                   stages=args.stages)
    if args.sass:
        Path(args.sass).write_text(sass)
    loop = hot_loop(sass)
    report(dict(bench="kernel_sass", kernel="paged_decode_attention_append", kv_dtype=args.kv_dtype,
                block_k=args.block_k, num_warps=args.warps, num_stages=args.stages, arch=args.arch, **resources,
                instructions=sum(1 for line in sass.splitlines() if _INSTRUCTION.match(line)),
                loop_instructions=len(loop),
                loop_opcodes=dict(collections.Counter(loop).most_common(args.top))), args.out)


if __name__ == "__main__":
    main()
