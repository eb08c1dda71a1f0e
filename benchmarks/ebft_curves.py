"""Does an EBFT run learn? Runs a config for several seeds, plots ``ebft/alignment``, ``ebft/cfm_loss``
and ``ebft/reward`` and compares the means of the first and the last 10 steps.

    python benchmarks/ebft_curves.py --config configs/ebft.py [--seeds 0 1 2] [--max-steps N]
        [--name NAME] [--out runs/bench_ebft_NAME] [-- extra scripts/train.py overrides]

Each seed is a separate ``scripts/train.py --config CONFIG --seed S --data.seed S`` process, timed end to
end (arguments after ``--`` are appended, e.g. ``-- --ebft.use-whitening``).
Prints a markdown table (one row per seed) and writes ``benchmarks/plots/ebft_NAME.png`` (10-step moving
means; NAME defaults to the config's file name, so ``configs/ebft_strided.py`` gives
``plots/ebft_strided.png``).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
from seed_runs import ROOT, WINDOW, first_last, plot, run_seed

#: (metric, direction it should move) plotted and tabulated.
METRICS = (("ebft/alignment", "up"), ("ebft/cfm_loss", "down"), ("ebft/reward", "up"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True, help="training config file (config() -> TrainConfig)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=None, help="override the config's max_steps")
    parser.add_argument("--name", default=None, help="plot name (default: the config file's stem)")
    parser.add_argument("--out", type=Path, default=None, help="run directories (default: runs/bench_<name>)")
    args = parser.parse_args(own)
    if not args.config.is_file():
        parser.error(f"--config {args.config} does not exist")
    name = args.name or args.config.stem
    stem = name if name.startswith("ebft") else f"ebft_{name}"
    out = args.out or ROOT / "runs" / f"bench_{stem}"
    out.mkdir(parents=True, exist_ok=True)

    print(f"# {args.config} | {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}" + (f" | extra: {' '.join(extra)}" if extra else ""))
    header = ["seed", "steps", "wall (s)"] + [f"{k} first {WINDOW} → last {WINDOW}" for k, _ in METRICS]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    curves, moved = {}, {k: [] for k, _ in METRICS}
    for seed in args.seeds:
        rows, wall = run_seed(args.config, seed, out, max_steps=args.max_steps, extra=extra)
        curves[seed] = rows
        cells = [str(seed), str(len(rows)), f"{wall:.0f}"]
        for key, direction in METRICS:
            a, b = first_last(rows, key)
            cells.append(f"{a:.4f} → {b:.4f} ({b - a:+.4f})")
            moved[key].append((b - a) if direction == "up" else (a - b))
        print("| " + " | ".join(cells) + " |", flush=True)
    for key, direction in METRICS:
        gains = np.array(moved[key])
        print(f"{key}: moved the desired way ({direction}) on {int((gains > 0).sum())}/{len(gains)} seeds; "
              f"mean improvement {gains.mean():+.4f}")
    png = ROOT / "benchmarks" / "plots" / f"{stem}.png"
    plot(curves, [k for k, _ in METRICS], png,
         f"{args.config.name} {' '.join(extra)} ({len(curves)} seeds)".replace("  ", " "))
    print(f"plot: {png.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
