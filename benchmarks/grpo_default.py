"""Does the shipped default GRPO run learn? Runs ``configs/grpo.py`` (or ``--config``) for several seeds and
compares the mean reward of the first and the last 10 steps.

    python benchmarks/grpo_default.py [--seeds 0 1 2] [--max-steps 300] [--out runs/bench_grpo]
    python benchmarks/grpo_default.py --config configs/grpo_multiturn.py --second env/turns/mean \
        --train-args "--eval-every 25 --eval.holdout 64 --eval.decodings greedy"

With ``--eval-every`` among ``--train-args`` it also prints the held-out greedy reward of the first and the last
evaluation (``eval.jsonl``).

Each seed is a separate ``scripts/train.py`` process (``--seed S --data.seed S``), timed end to end.
Prints one markdown row per seed and writes ``reward_curves.png`` (10-step moving means) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
from seed_runs import ROOT, first_last, plot, run_seed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_grpo")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "grpo.py")
    parser.add_argument("--second", default="reward/exact_match/mean", help="a second metric in the table and plot")
    parser.add_argument("--train-args", default="", help="more scripts/train.py arguments, one string")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"# {args.config.name}")
    print(f"| seed | steps | wall (s) | reward first 10 | reward last 10 | gain | {args.second} first 10 | "
          f"{args.second} last 10 |")
    print("|---|---|---|---|---|---|---|---|")
    curves, gains = {}, []
    for seed in args.seeds:
        rows, wall = run_seed(args.config, seed, args.out, max_steps=args.max_steps, extra=args.train_args.split())
        curves[seed] = rows
        r0, r1 = first_last(rows, "reward/mean")
        e0, e1 = first_last(rows, args.second)
        gains.append(r1 - r0)
        print(f"| {seed} | {len(rows)} | {wall:.0f} | {r0:.3f} | {r1:.3f} | {r1 - r0:+.3f} | {e0:.3f} | {e1:.3f} |",
              flush=True)
        evals = args.out / f"seed{seed}" / "eval.jsonl"
        if evals.exists():
            held = [json.loads(line) for line in evals.read_text().splitlines() if line.strip()]
            key = "eval/greedy/reward/mean"
            print(f"  held-out {key} at steps {held[0]['step']} -> {held[-1]['step']}: "
                  f"{' '.join(f'{h[key]:.3f}' for h in held)}", flush=True)
    plot(curves, ["reward/mean", args.second], args.out / "reward_curves.png")
    print(f"\nmean gain {np.mean(gains):+.3f}, min gain {np.min(gains):+.3f}; plot: {args.out / 'reward_curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
