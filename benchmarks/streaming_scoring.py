"""Does scoring while generating (``--scoring.stream-groups``) shorten a step when rewards are slow? Runs the
default config with a reward that costs ``--ms-per-completion`` of wall time per completion (a stand-in for a
verifier or a sandbox: it sleeps, so it needs no CPU), once unstreamed and once per ``--streams`` value.

    python benchmarks/streaming_scoring.py [--steps 40] [--ms-per-completion 4] [--streams 2 4] [--seed 0]

Prints per run the median over steps 6.. of the step's wall time (generation + reward + train + sync) and of
its parts, from metrics.jsonl.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from seed_runs import ROOT, run_seed

SLOW_REWARD = '''
import time
from jrl.data.tasks.arithmetic import exact_match

def slow_exact_match(prompts, completions, completion_ids, **kw):
    time.sleep({seconds} * len(completions))
    return exact_match(prompts, completions, completion_ids, **kw)
'''
#: The parts of a step's wall time (without prefetching, the wait for the rollout is its generation).
PARTS = ("time/wait_rollout", "time/reward", "time/train", "time/sync")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--ms-per-completion", type=float, default=4.0)
    parser.add_argument("--streams", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench_streaming")
    args = parser.parse_args()
    reward = Path(tempfile.mkdtemp()) / "slow_reward.py"
    reward.write_text(SLOW_REWARD.format(seconds=args.ms_per_completion / 1000))

    print(f"# {platform.processor() or platform.machine()}, python {platform.python_version()}, "
          f"{time.strftime('%Y-%m-%d')}; reward {args.ms_per_completion:g} ms per completion, 1 worker")
    print("| stream_groups | step (s) | rollout (s) | reward (s) | train (s) | reward/mean last 10 |")
    print("|---|---|---|---|---|---|")
    for stream in [0, *args.streams]:
        extra = ["--rewards", f"{reward}:slow_exact_match", "--scoring.stream-groups", str(stream),
                 "--save-every", "0"]
        rows, _ = run_seed(ROOT / "configs" / "grpo.py", args.seed, args.out / f"stream{stream}",
                           max_steps=args.steps, extra=extra)
        tail = rows[5:]
        step = np.median([sum(r[k] for k in PARTS) for r in tail])
        med = {k: float(np.median([r[k] for r in tail])) for k in ("time/rollout", *PARTS)}
        last = float(np.mean([r["reward/mean"] for r in rows[-10:]]))
        print(f"| {stream} | {step:.3f} | {med['time/rollout']:.3f} | {med['time/reward']:.3f} | "
              f"{med['time/train']:.3f} | {last:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
