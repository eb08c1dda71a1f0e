"""Where two traced steps differ: the GPU kernels of two profiles (``--profile DIR`` of ``scaling.py`` or
``train_step_vs_torch.py``) grouped by kernel name with XLA's instance numbers dropped, side by side, ranked by
the difference in time.

    python benchmarks/profile_diff.py DIR_ONE_GPU DIR_FSDP2 --top 40 [--json OUT]

A layout that is slower than another shows here which kinds of kernel it runs more of (the gathered weights'
copies, casts, the collectives); look the full names up in the optimized HLO (``--xla_dump_to``) to see what they
compute.
"""

from __future__ import annotations

import argparse
import collections
import json
import re

from kernels_common import trace_kernels

_INSTANCE = re.compile(r"([._]\d+)+$")


def kernel_kind(name: str) -> str:
    """A kernel name without XLA's instance suffix (``loop_convert_fusion_12`` -> ``loop_convert_fusion``)."""
    return _INSTANCE.sub("", name.split("(")[0].strip())[:80]


def per_kind(trace_dir: str) -> dict[str, tuple[float, int]]:
    """Milliseconds and calls per kernel kind in the trace under ``trace_dir``."""
    out = collections.defaultdict(lambda: [0.0, 0])
    for _, dur, name in trace_kernels(trace_dir):
        entry = out[kernel_kind(name)]
        entry[0] += dur / 1e3
        entry[1] += 1
    return {k: (ms, calls) for k, (ms, calls) in out.items()}


def diff(a: dict[str, tuple[float, int]], b: dict[str, tuple[float, int]], top: int) -> list[dict]:
    """The ``top`` kinds by |time in b - time in a|."""
    rows = []
    for kind in set(a) | set(b):
        ms_a, calls_a = a.get(kind, (0.0, 0))
        ms_b, calls_b = b.get(kind, (0.0, 0))
        rows.append(dict(kind=kind, ms_a=round(ms_a, 3), calls_a=calls_a, ms_b=round(ms_b, 3), calls_b=calls_b,
                         delta_ms=round(ms_b - ms_a, 3)))
    return sorted(rows, key=lambda r: -abs(r["delta_ms"]))[:top]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="trace directory of the reference step")
    ap.add_argument("b", help="trace directory of the step compared with it")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    a, b = per_kind(args.a), per_kind(args.b)
    rows = diff(a, b, args.top)
    total_a, total_b = sum(ms for ms, _ in a.values()), sum(ms for ms, _ in b.values())
    print(f"kernel time: a {total_a:.2f} ms, b {total_b:.2f} ms, delta {total_b - total_a:+.2f} ms")
    print(f"{'kind':<60} {'a ms':>9} {'calls':>6} {'b ms':>9} {'calls':>6} {'delta':>8}")
    for r in rows:
        print(f"{r['kind']:<60} {r['ms_a']:>9.3f} {r['calls_a']:>6} {r['ms_b']:>9.3f} {r['calls_b']:>6} "
              f"{r['delta_ms']:>+8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(a=args.a, b=args.b, total_a_ms=total_a, total_b_ms=total_b, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
