"""The learner's GRPO update on one long-tailed step's rows, packed (``--optim.packing``) or padded: what a GRPO step
of long ragged completions spends after its generation, without the sampler in the way.

A step of ``--rows`` rows: ``--prompt`` prompt tokens each (one prompt per ``--generations`` rows, a GRPO group),
completions of geometric lengths (mean ``--mean``, cut at ``--max-new``, drawn with ``--seed``), the DAPO update of
``train_step_vs_torch.py`` (token-level, clipped 0.2/0.28), one optimizer step per update over micro-batches of
``--micro-rows`` rows (packed rows with packing). Reported per setting (medians of the updates after the first,
which compiles): the update's wall time, trained tokens/s (prompt and completion tokens up to each row's last loss
token: what the update computes without padding), the model FLOP rate against ``--peak-tflops`` (6 x parameters per
trained token), the packed rows' count and fill (trained tokens over rows x width; past 1 with ``--share-prompts``,
whose rows hold each prompt once), and with ``--profile DIR`` one more update's GPU kernel time by category and its
idle time.

    python benchmarks/packed_update.py --shape llama1b --micro-rows 1,2 --out packed.jsonl
    python benchmarks/packed_update.py --shape llama1b --micro-rows 4 --no-scan-layers    # layers unrolled
    python benchmarks/packed_update.py --shape llama1b --micro-rows 4 --no-scan-layers --loss-head logprobs
    python benchmarks/packed_update.py --shape llama1b --no-packing --micro-rows 4
    python benchmarks/packed_update.py --shape llama1b --micro-rows 4 --no-scan-layers --share-prompts

Against ``train_step_vs_torch.py --batch B --seq S`` (rows of one width, no segments) it tells what packing costs
beyond the tokens themselves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_common import env_line, kernel_profile, peak_bytes, report  # noqa: E402
from train_step_vs_torch import SHAPES, jrl_update, num_params, time_updates  # noqa: E402


def long_tailed_batch(rows: int, prompt: int, mean: float, max_new: int, vocab: int, seed: int, generations: int):
    """A GRPO :class:`~jrl.train.algorithms.grpo_update.StepBatch` of ``rows`` full prompts (one per ``generations``
    rows) and completions of geometric lengths (mean ``mean``, at most ``max_new``), the completion width the longest
    row's."""
    import numpy as np

    from jrl.train.algorithms.grpo_update import StepBatch

    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.geometric(1.0 / mean, rows), max_new)
    width = int(lengths.max())
    c_mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
    c_ids = rng.integers(1, vocab, (rows, width)).astype(np.int32) * c_mask
    prompts = rng.integers(1, vocab, (-(-rows // generations), prompt)).astype(np.int32)
    ids = np.concatenate([np.repeat(prompts, generations, axis=0)[:rows], c_ids], 1)
    mask = np.concatenate([np.ones((rows, prompt), np.int32), c_mask], 1)
    return StepBatch(input_ids=ids, attention_mask=mask, completion_ids=c_ids, completion_mask=c_mask,
                     advantages=rng.standard_normal(rows).astype(np.float32),
                     truncated=lengths >= max_new), lengths


def run(args, shape: dict, micro_rows: int) -> dict:
    import jax

    from jrl.train.algorithms.grpo_update import packed_step

    learner, update = jrl_update(args, shape, micro_batch_size=micro_rows, packing=args.packing,
                                 share_prompts=args.share_prompts)
    batch, lengths = long_tailed_batch(args.rows, args.prompt, args.mean, args.max_new, shape["vocab_size"], args.seed,
                                       args.generations)
    tokens = int(args.rows * args.prompt + lengths.sum())
    layout = {}
    if args.packing:
        packed, _ = packed_step(batch, learner)
        r, width = packed.input_ids.shape
        layout = dict(packed_rows=r, sequences_per_row=packed.gather.shape[1], width=width,
                      fill=round(tokens / (r * width), 4), attention_width=packed.segment_ids.shape[1])
    times, metrics = time_updates(learner, update, batch, args.updates)
    med, peak = statistics.median(times[1:]), peak_bytes()
    profile = None
    if args.profile:
        profile = kernel_profile(lambda: (update(learner, batch), learner.block_until_ready()),
                                 trace_dir=f"{args.profile}/micro{micro_rows}")
    return dict(shape=args.shape, packing=args.packing, share_prompts=args.share_prompts,
                generations=args.generations, scan_layers=args.scan_layers, remat=args.remat,
                loss_head=args.loss_head, micro_rows=micro_rows, rows=args.rows, prompt=args.prompt,
                mean_new=round(float(lengths.mean()), 1),
                max_new=int(lengths.max()), tokens=tokens, **layout,
                update_s=round(med, 3), times=[round(t, 3) for t in times],
                tokens_per_s=round(tokens / med),
                mfu=round(6 * num_params(shape) * tokens / med / (args.peak_tflops * 1e12), 4),
                peak_gib=None if peak is None else round(peak / 2**30, 2), loss=metrics[-1]["loss"],
                device=jax.local_devices()[0].device_kind, env=env_line(), date=time.strftime("%Y-%m-%d"),
                **({"profile": profile} if profile else {}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--mean", type=float, default=1024.0, help="mean completion length (geometric)")
    ap.add_argument("--max-new", type=int, default=8192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--generations", type=int, default=8, help="rows per prompt (a GRPO group)")
    ap.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--share-prompts", action="store_true", help="OptimConfig.share_prompts (with packing)")
    ap.add_argument("--micro-rows", default="1", help="comma list: rows (packed rows with packing) per micro-batch")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                    help="stacked, scanned layers (--no-scan-layers: unrolled)")
    ap.add_argument("--remat", default="auto", help="remat policy of the decoder layers (ModelConfig.remat)")
    ap.add_argument("--loss-head", default="auto", choices=("auto", "fused", "logprobs"),
                    help="how the loss reaches the LM head (TrainConfig.loss_head)")
    ap.add_argument("--updates", type=int, default=3, help="updates per setting, at least 2 (the first compiles)")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100 SXM: 989)")
    ap.add_argument("--profile", default=None, metavar="DIR", help="also trace one more update per setting")
    ap.add_argument("--out", default=None, help="append one JSON line per setting here")
    args = ap.parse_args()
    if args.updates < 2:
        ap.error(f"--updates {args.updates}: at least 2 (the first update compiles and is not timed)")
    args.mode, args.attention, args.logprobs = "full", "auto", "auto"
    for micro in (int(m) for m in args.micro_rows.split(",")):
        row = run(args, dict(SHAPES[args.shape]), micro)
        report(row, args.out)


if __name__ == "__main__":
    main()
