"""Does a trainer fed by two explorer processes learn like the single-process asynchronous run? (CPU)

For each seed, the default GRPO run (``configs/grpo.py``, 300 steps) twice with the same staleness bound:

- ``async``: one process, the rollout producer one batch ahead (``--rollout.prefetch-depth 1``);
- ``split``: ``--mode train`` plus two ``--mode explore`` processes (``e0``, ``e1``) on one SQLite queue.

    python benchmarks/explorers.py [--seeds 0 1 2] [--max-steps 300] [--max-staleness 2]

Prints one Markdown row per run (reward over the first and last 10 steps, exact match, wall time, mean staleness
of the trained groups, groups that went stale, each explorer's share) and the plot
``benchmarks/plots/explorers_reward_curves.png``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from seed_runs import ROOT, first_last, plot

CONFIG = ROOT / "configs" / "grpo.py"


def _common(seed: int, out: Path, args) -> list[str]:
    return ["--config", str(CONFIG), "--seed", str(seed), "--data.seed", str(seed), "--output-dir", str(out),
            "--max-steps", str(args.max_steps), "--rollout.max-staleness", str(args.max_staleness), "--overwrite"]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_async(seed: int, out: Path, args) -> tuple[list[dict], float]:
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), *_common(seed, out, args),
           "--rollout.prefetch-depth", "1"]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return _rows(out), time.perf_counter() - start


def run_split(seed: int, out: Path, args) -> tuple[list[dict], float]:
    shutil.rmtree(out, ignore_errors=True)  # so the explorers cannot see an earlier run's weights
    common = _common(seed, out, args)
    if args.max_queued:
        common[-1:-1] = ["--explore.max-queued", str(args.max_queued)]
    start = time.perf_counter()
    trainer = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), *common, "--mode", "train"],
                               cwd=ROOT, stdout=subprocess.DEVNULL)
    first = out / "published" / "v00000000"
    while not first.exists():  # explorers start once the trainer has cleared the old run and published
        if trainer.poll() is not None:
            raise SystemExit(f"the trainer exited {trainer.returncode} before publishing its weights")
        time.sleep(0.5)
    explorers = [subprocess.Popen([sys.executable, str(ROOT / "scripts" / "explore.py"), *common[:-1],
                                   "--explore.name", name], cwd=ROOT, stdout=subprocess.DEVNULL)
                 for name in ("e0", "e1")]
    for p in (trainer, *explorers):
        if p.wait() != 0:
            raise SystemExit(f"{p.args} exited {p.returncode}")
    return _rows(out), time.perf_counter() - start


def summary(kind: str, seed: int, rows: list[dict], wall: float, out: Path) -> dict:
    r0, r1 = first_last(rows, "reward/mean")
    e0, e1 = first_last(rows, "reward/exact_match/mean")
    result = {"kind": kind, "seed": seed, "wall": wall, "reward_first": r0, "reward_last": r1, "exact_first": e0,
              "exact_last": e1, "staleness": float(np.mean([r["async/staleness"] for r in rows]))}
    if kind == "split":
        with sqlite3.connect(out / "experience.db") as db:
            result["stale"] = db.execute("SELECT COUNT(*) FROM jrl_experience WHERE stale = 1").fetchone()[0]
            result["shares"] = dict(db.execute("SELECT explorer, COUNT(*) FROM jrl_experience WHERE consumed_step IS "
                                               "NOT NULL GROUP BY explorer").fetchall())
        result["staleness"] = float(np.mean([r["async/staleness_mean"] for r in rows]))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--max-staleness", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_explorers")
    parser.add_argument("--max-queued", type=int, default=None, help="explore.max_queued of the split runs")
    args = parser.parse_args()
    results, curves = [], {}
    for seed in args.seeds:
        for kind, run in (("async", run_async), ("split", run_split)):
            out = args.out / kind / f"seed{seed}"
            rows, wall = run(seed, out, args)
            results.append(summary(kind, seed, rows, wall, out))
            curves[f"{kind} {seed}"] = rows
            print(json.dumps(results[-1]), flush=True)
    print("\n| run | seed | wall (s) | reward first 10 | reward last 10 | exact match last 10 | mean staleness | "
          "stale groups | groups trained per explorer |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        shares = ", ".join(f"{k} {v}" for k, v in sorted(r.get("shares", {}).items())) or "-"
        print(f"| {r['kind']} | {r['seed']} | {r['wall']:.0f} | {r['reward_first']:.3f} | {r['reward_last']:.3f} | "
              f"{r['exact_last']:.3f} | {r['staleness']:.2f} | {r.get('stale', '-')} | {shares} |")
    for kind in ("async", "split"):
        mine = [r for r in results if r["kind"] == kind]
        print(f"| {kind} mean | | {np.mean([r['wall'] for r in mine]):.0f} | "
              f"{np.mean([r['reward_first'] for r in mine]):.3f} | {np.mean([r['reward_last'] for r in mine]):.3f} | "
              f"{np.mean([r['exact_last'] for r in mine]):.3f} | {np.mean([r['staleness'] for r in mine]):.2f} | | |")
    plot(curves, ["reward/mean"], ROOT / "benchmarks" / "plots" / "explorers_reward_curves.png",
         title="one process (async) vs trainer + 2 explorers (split)")


if __name__ == "__main__":
    main()
