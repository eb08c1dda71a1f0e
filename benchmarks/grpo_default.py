"""Does the shipped default GRPO run learn? Runs ``configs/grpo.py`` for several seeds and compares the
mean reward of the first and the last 10 steps.

    python benchmarks/grpo_default.py [--seeds 0 1 2] [--max-steps 300] [--out runs/bench_grpo]

Each seed is a separate ``scripts/train.py`` process (``--seed S --data.seed S``), timed end to end.
Prints one markdown row per seed and writes ``reward_curves.png`` (10-step moving means) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
WINDOW = 10


def run_seed(seed: int, max_steps: int, out: Path) -> tuple[list[dict], float]:
    run_dir = out / f"seed{seed}"
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(ROOT / "configs" / "grpo.py"),
           "--seed", str(seed), "--data.seed", str(seed), "--max-steps", str(max_steps),
           "--output-dir", str(run_dir), "--overwrite"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, wall


def window_means(rows: list[dict], key: str) -> tuple[float, float]:
    values = np.array([r[key] for r in rows], dtype=np.float64)
    return float(values[:WINDOW].mean()), float(values[-WINDOW:].mean())


def plot(curves: dict[int, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for seed, rows in curves.items():
        steps = np.array([r["step"] for r in rows])
        for ax, key in zip(axes, ("reward/mean", "reward/exact_match/mean")):
            y = np.array([r[key] for r in rows])
            smooth = np.convolve(y, np.ones(WINDOW) / WINDOW, mode="valid")
            ax.plot(steps[WINDOW - 1:], smooth, label=f"seed {seed}")
            ax.set_title(f"{key} ({WINDOW}-step moving mean)")
            ax.set_xlabel("step")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_grpo")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}")
    print("| seed | steps | wall (s) | reward first 10 | reward last 10 | gain | exact match first 10 | "
          "exact match last 10 |")
    print("|---|---|---|---|---|---|---|---|")
    curves, gains = {}, []
    for seed in args.seeds:
        rows, wall = run_seed(seed, args.max_steps, args.out)
        curves[seed] = rows
        r0, r1 = window_means(rows, "reward/mean")
        e0, e1 = window_means(rows, "reward/exact_match/mean")
        gains.append(r1 - r0)
        print(f"| {seed} | {len(rows)} | {wall:.0f} | {r0:.3f} | {r1:.3f} | {r1 - r0:+.3f} | {e0:.3f} | {e1:.3f} |",
              flush=True)
    plot(curves, args.out / "reward_curves.png")
    print(f"\nmean gain {np.mean(gains):+.3f}, min gain {np.min(gains):+.3f}; plot: {args.out / 'reward_curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
