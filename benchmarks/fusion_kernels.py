"""The top GPU kernels of a profiled program named by what they compute: each XLA fusion kernel of a trace
(``--profile`` of ``packed_update.py`` and the others) looked up in the optimized HLO that XLA dumped for the same
program, with its output shape, the operations it fuses and the JAX operations (``op_name``) they came from.

    XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*micro_step.*" \\
        python benchmarks/packed_update.py ... --profile /tmp/prof
    python benchmarks/fusion_kernels.py /tmp/prof/micro4 /tmp/hlo --top 40

Kernels that are not XLA fusions (cuBLAS, cuDNN, Triton calls) are listed with their time only.
"""

from __future__ import annotations

import argparse
import collections
import glob
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_common import summarize_kernels, trace_kernels  # noqa: E402


def hlo_fusions(text: str) -> tuple[dict[str, str], dict[str, str]]:
    """(instruction name -> its definition, computation name -> its body) of an HLO module's text; instruction
    names as kernels are named in a trace ('.' and '-' as '_')."""
    instructions = {m.group(1).replace(".", "_").replace("-", "_"): m.group(2)
                    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?)$", text, re.M)}
    computations = {m.group(1): m.group(2)
                    for m in re.finditer(r"^%?([\w.\-]+) (?:\([^\n]*\) -> [^\n]*)?\{\n(.*?)\n\}", text, re.M | re.S)}
    return instructions, computations


def describe(name: str, instructions: dict[str, str], computations: dict[str, str]) -> list[str]:
    """Lines on kernel ``name``: its output, its JAX op, the operations its fused computation holds and where they
    came from (none for a kernel that is not an instruction of the module)."""
    line = instructions.get(name)
    if line is None:
        return []
    out = [f"  out {line.split(' fusion(')[0][:200]}"]
    op_name = re.search(r'op_name="([^"]*)"', line)
    if op_name:
        out.append(f"  op_name {op_name.group(1)[-220:]}")
    called = re.search(r"calls=%?([\w.\-]+)", line)
    body = computations.get(called.group(1), "") if called else ""
    if body:
        ops = collections.Counter(re.findall(r"= \S+ (\w[\w\-]*)\(", body))
        out.append(f"  ops {dict(ops.most_common(12))}")
        sources = collections.Counter(n[-120:] for n in re.findall(r'op_name="([^"]*)"', body))
        out += [f"    {count}x {source}" for source, count in sources.most_common(5)]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace_dir", help="the profiler trace's directory")
    ap.add_argument("dump_dir", help="XLA's dump directory (--xla_dump_to, --xla_dump_hlo_as_text)")
    ap.add_argument("--top", type=int, default=90, help="kernels by time")
    args = ap.parse_args()
    profile = summarize_kernels(trace_kernels(args.trace_dir), top=args.top)
    dumps = glob.glob(f"{args.dump_dir}/*after_optimizations.txt")
    if not dumps:
        raise SystemExit(f"no *after_optimizations.txt in {args.dump_dir}: run the program with XLA_FLAGS "
                         "--xla_dump_to=DIR --xla_dump_hlo_as_text")
    text = max((Path(p).read_text() for p in dumps), key=len)  # the largest module: the step's program
    instructions, computations = hlo_fusions(text)
    print(f"kernel_ms {profile['kernel_ms']}, {profile['category_ms']}")
    for kernel in profile["top_kernels"]:
        print(f"\n== {kernel['name']}: {kernel['ms']} ms, {kernel['calls']} calls")
        print("\n".join(describe(kernel["name"], instructions, computations)))


if __name__ == "__main__":
    main()
