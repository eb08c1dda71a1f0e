"""Host time of each phase of one learner update of a benchmark shape (the GRPO update of
``train_step_vs_torch.py``, one micro-batch): where the accelerator waits on the host between two steps.

Phases, medians of updates 4-10: the step's loss mask and normalisers (``PolicyUpdate.policy_term``), planning
the micro-batches, placing the rows and aux values, flattening the program's arguments, the jitted call's
return (it launches the program's kernels), waiting for the program, and fetching its packed metrics.

It drives the learner's internals (``Learner._plan``, ``_put_micro_batch`` and the ``micro_step_and_apply``
program of :mod:`jrl.train.update_programs`) to time them apart, so it follows their changes.

    python benchmarks/step_host_phases.py --shape llama1b
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import jax  # noqa: E402
from train_step_vs_torch import SHAPES, jrl_update, step_batch  # noqa: E402

from jrl.train import learner as L  # noqa: E402
from jrl.train import update_programs as P  # noqa: E402

PHASES = ("loss mask and normalisers", "plan", "place rows and aux", "flatten arguments", "jitted call returns",
          "wait for the program", "fetch metrics")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--updates", type=int, default=10)
    args = ap.parse_args()
    args.mode, args.attention, args.remat, args.logprobs, args.loss_head = "full", "auto", "auto", "auto", "auto"
    shape = SHAPES[args.shape]
    learner, update = jrl_update(args, shape)
    batch = step_batch(8, 1024, shape["vocab_size"])
    times: dict[str, list[float]] = {name: [] for name in PHASES}
    for i in range(args.updates):
        t = [time.perf_counter()]
        term = update.policy_term(learner, batch)
        t.append(time.perf_counter())
        (_, term, rows_slice), = learner._plan([term])[0]
        t.append(time.perf_counter())
        placed = learner._put_micro_batch(L.take_rows(term.rows, rows_slice), term.aux)
        t.append(time.perf_counter())
        jax.tree.leaves((learner._params, learner._opt_state, learner._frozen, placed))
        t.append(time.perf_counter())
        learner._params, learner._opt_state, part = P.micro_step_and_apply(
            learner._params, learner._opt_state, learner._frozen, placed, graphdef=learner._static_graphdef,
            loss=term.loss, tx=learner.tx, router=learner._router)
        part.values.copy_to_host_async()
        t.append(time.perf_counter())
        learner.block_until_ready()
        t.append(time.perf_counter())
        jax.device_get(part)
        t.append(time.perf_counter())
        if i >= 3:
            for name, a, b in zip(PHASES, t, t[1:]):
                times[name].append((b - a) * 1e3)
    for name, values in times.items():
        print(f"{name:>26}: {statistics.median(values):8.3f} ms")


if __name__ == "__main__":
    main()
