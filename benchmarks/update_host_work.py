"""Host time of a packed GRPO update's plan (``PolicyUpdate.policy_terms``: the step's loss mask and normalisers,
the packed rows and, with ``--share-prompts``, their attention layout) on one long-tailed step's rows: the work a
trainer that prepares the next step during an update (``Trainer.train_step``) takes off the devices' path. Host
only: the model is the smallest shape (its size plays no part), run with ``JAX_PLATFORMS=cpu``.

    JAX_PLATFORMS=cpu python benchmarks/update_host_work.py --rows 512 --mean 1024 --max-new 8192 --generations 16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from packed_update import long_tailed_batch  # noqa: E402
from train_step_vs_torch import SHAPES, jrl_update  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--mean", type=float, default=1024.0, help="mean completion length (geometric)")
    ap.add_argument("--max-new", type=int, default=8192)
    ap.add_argument("--generations", type=int, default=16, help="rows per prompt (a GRPO group)")
    ap.add_argument("--vocab", type=int, default=128256, help="token ids drawn below this")
    ap.add_argument("--micro-rows", type=int, default=4, help="packed rows per micro-batch")
    ap.add_argument("--share-prompts", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    model = types.SimpleNamespace(attention="auto", remat="auto", scan_layers=False, mode="full", logprobs="auto",
                                  loss_head="auto")
    learner, update = jrl_update(model, SHAPES["tiny"], micro_batch_size=args.micro_rows, packing=True,
                                 share_prompts=args.share_prompts)
    batch, lengths = long_tailed_batch(args.rows, args.prompt, args.mean, args.max_new, args.vocab, 0,
                                       args.generations)
    seconds = []
    for _ in range(args.reps):
        t = time.perf_counter()
        (term,) = update.policy_terms(learner, batch)
        seconds.append(time.perf_counter() - t)
    print(f"{args.rows} rows, {int(lengths.sum()) + args.rows * args.prompt} tokens -> {term.rows.input_ids.shape[0]} "
          f"packed rows of {term.rows.input_ids.shape[1]}: policy_terms {statistics.median(seconds):.3f} s median "
          f"({', '.join(f'{s:.3f}' for s in seconds)})")


if __name__ == "__main__":
    main()
