"""Do replay, re-roll, docs_per_step and streaming change learning on the built-in task, and in which direction?
Runs ``configs/grpo.py`` with and without each option for several seeds, each as its own ``scripts/train.py``
process.

    python benchmarks/grpo_pipeline_options.py [--seeds 0 1 2] [--max-steps 300] [--out runs/bench_options]

Pairs (the second of each differs from the first only by the option):

- ``default`` / ``replay``: the shipped run, and the same with ``--replay.buffer-size 16``;
- ``default`` / ``docs``: the same with ``--docs-per-step 32`` (two optimizer updates per 64-sequence rollout);
- ``default`` / ``stream``: the same with ``--scoring.stream-groups 2`` (generated and scored in 4 chunks);
- ``exact`` / ``reroll``: the exact-match reward alone (so that groups where every completion fails get
  reward 0 and count for re-roll), and the same with ``--reroll.start-fraction 0`` (``reroll``, no limit on the
  re-rolls of one prompt, as the reference), ``0.5`` (``reroll_late``: from step 150 of 300), or ``0`` with
  ``--reroll.max-rerolls 1`` (``reroll_once``: each failed prompt gets one more try).

Per run: the mean training reward of the first and last 10 steps and over the whole run, the fraction of
generated groups without learning signal (``frac_reward_zero_std``), the groups the option moved
(``replay_buffer_replacements`` / ``reroll_groups`` summed), for re-roll the share of re-rolled groups that failed
again (``reroll_failed_again`` / ``reroll_groups``), and the greedy held-out accuracy at the last step
(``--eval-every`` = the run length: before the first step and after the last) and, with a shorter ``--eval-every``,
its mean over the evaluations of the run's second half (less noisy than one evaluation).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
from seed_runs import ROOT, first_last, run_seed

EXACT = ("--rewards", "jrl.data.tasks.arithmetic:exact_match")
VARIANTS = {
    "default": (),
    "replay": ("--replay.buffer-size", "16"),
    "docs": ("--docs-per-step", "32"),
    "stream": ("--scoring.stream-groups", "2"),
    "exact": EXACT,
    "reroll": (*EXACT, "--reroll.start-fraction", "0"),
    "reroll_late": (*EXACT, "--reroll.start-fraction", "0.5"),
    "reroll_once": (*EXACT, "--reroll.start-fraction", "0", "--reroll.max-rerolls", "1"),
}
#: What each variant's "moved" column sums.
MOVED = {"replay": "replay_buffer_replacements", "reroll": "reroll_groups", "reroll_late": "reroll_groups",
         "reroll_once": "reroll_groups"}


def held_out_accuracy(run_dir: Path, max_steps: int) -> tuple[float, float]:
    """Greedy exact-match accuracy of the last evaluation in ``run_dir/eval.jsonl``, and its mean over the
    evaluations after step ``max_steps / 2``."""
    rows = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines() if x.strip()]
    acc = [float(r["eval/greedy/reward/exact_match/mean"]) for r in rows]
    late = [a for r, a in zip(rows, acc) if r["step"] > max_steps // 2]
    return acc[-1], float(np.mean(late))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--eval-every", type=int, default=None, help="held-out evaluation interval (default: the "
                        "run length)")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="arguments added to every run, e.g. a harder task: --extra --data.arithmetic.max-operand 12")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_options")
    args = parser.parse_args()

    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}{', every run with ' + ' '.join(args.extra) if args.extra else ''}")
    print("| variant | seed | wall (s) | reward first 10 | reward last 10 | reward mean | exact match last 10 | "
          "groups without signal | groups moved | re-rolls failed again | held-out greedy accuracy | "
          "held-out, mean of 2nd half |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    summary: dict[str, list[tuple[float, ...]]] = {}
    for name in args.variants:
        for seed in args.seeds:
            extra = (*VARIANTS[name], "--eval-every", str(args.eval_every or args.max_steps), *args.extra)
            rows, wall = run_seed(ROOT / "configs" / "grpo.py", seed, args.out / name, max_steps=args.max_steps,
                                  extra=extra)
            r0, r1 = first_last(rows, "reward/mean")
            _, e1 = first_last(rows, "reward/exact_match/mean")
            mean = float(np.mean([r["reward/mean"] for r in rows]))
            flat = float(np.mean([r["frac_reward_zero_std"] for r in rows]))
            moved = sum(r.get(MOVED.get(name, ""), 0.0) for r in rows)
            rerolls = MOVED.get(name) == "reroll_groups" and moved > 0
            again = sum(r.get("reroll_failed_again", 0.0) for r in rows) / moved if rerolls else np.nan
            acc, late = held_out_accuracy(args.out / name / f"seed{seed}", args.max_steps)
            summary.setdefault(name, []).append((r1, mean, flat, again, acc, late))
            print(f"| {name} | {seed} | {wall:.0f} | {r0:.3f} | {r1:.3f} | {mean:.3f} | {e1:.3f} | {flat:.3f} | "
                  f"{moved:.0f} | {again:.3f} | {acc:.3f} | {late:.3f} |", flush=True)
    print("\n| variant | reward last 10 | reward mean | groups without signal | re-rolls failed again | held-out greedy "
          "accuracy (± s.e.) | held-out, mean of 2nd half (± s.e.) |")
    print("|---|---|---|---|---|---|---|")
    for name, values in summary.items():
        v = np.asarray(values)
        r1, mean, flat, again, acc, late = v.mean(axis=0)
        se = v.std(axis=0, ddof=1) / np.sqrt(len(v)) if len(v) > 1 else np.full(v.shape[1], np.nan)
        print(f"| {name} | {r1:.3f} | {mean:.3f} | {flat:.3f} | {again:.3f} | {acc:.3f} ± {se[4]:.3f} | "
              f"{late:.3f} ± {se[5]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
