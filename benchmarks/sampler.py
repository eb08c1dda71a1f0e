"""The embedded sampler (``JaxRolloutEngine.generate``) against the memory-bandwidth limit of the GPU, and
transformers ``generate`` on the same work.

Random-weight model of a benchmark shape (``train_step_vs_torch.SHAPES``) in bf16; ``--rows`` rows of
``--prompt`` prompt tokens, ``--new`` new tokens each, temperature 1, no top-k / top-p. Without
``--stop-fraction`` no row stops early, so every row runs to the end. With it the first
``fraction * vocab`` token ids are stop tokens: on a random model (near-uniform next-token distribution)
each row stops at each step with about that probability, so completion lengths are ragged (reported:
mean length and the share of rows that stopped). Reported: median wall time of a call after a compiling
one, generated tokens/s (slots up to each row's stop), and for full-length rows the bandwidth limit: every decode
step reads all weights once plus the KV cache written so far, at ``--bandwidth-tbs`` (with ragged rows the limit
depends on the schedule and is not reported).

    python benchmarks/sampler.py --shape llama1b --rows 64 --prompt 128 --new 256 --out results.jsonl
    python benchmarks/sampler.py --rows 64 --generations 4 --new 256    # 16 prompts x 4 completions
    python benchmarks/sampler.py --backend transformers --rows 64 --prompt 128 --new 256
    python benchmarks/sampler.py --rows 512 --generations 8 --new 8192 --stop-fraction 0.002 --kv paged --slots 256

``--kv paged`` decodes with the paged KV cache and continuous batching (``rollout.kv``); reported besides: the KV
memory the dense layout would allocate, the paged pool's, the most pages the rows held at once (and the prompts'),
preemptions and scheduling rounds, and the medians of the prefill's and the decode's seconds, the decode steps and
the slots' occupancy. ``--carried N`` adds N rows that continue earlier tokens (a partial rollout's carried rows,
prefilled again with them) and ``--groups-needed`` stops once that many groups are finished, as a partial step does:

    python benchmarks/sampler.py --rows 512 --generations 8 --new 8192 --stop-fraction 0.001 --kv paged \
        --carried 96 --groups-needed 64 --slots 1024
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_common import report  # noqa: E402
from train_step_vs_torch import LORA_TARGETS, SHAPES  # noqa: E402


def bandwidth_limit_s(cfg, rows: int, prompt: int, new: int, tbs: float) -> float:
    """Seconds to read the weights once per decode step plus the KV cache filled so far (bf16)."""
    weights = 2 * cfg.num_params()
    kv_per_token = cfg.kv_bytes_per_token() * rows
    cache = sum(kv_per_token * (prompt + i) for i in range(new))
    return (new * weights + cache) / (tbs * 1e12)


def run_jrl(args, cfg, prompts, stop_ids) -> tuple[list[float], float, dict | None]:
    """Wall times of ``reps + 1`` generate calls (the first compiles), the mean completion length, and with
    ``--profile`` the kernel profile of one more call."""
    import jax

    from jrl.models.lora import LoraConfig, apply_lora
    from jrl.models.transformer import create_model
    from jrl.rollout.base import SamplingParams
    from jrl.rollout.jax_engine import JaxRolloutEngine
    from jrl.rollout.kv_config import KVCacheConfig
    from jrl.rollout.paged import slot_occupancy

    model = create_model(cfg, seed=0)
    if args.lora:
        apply_lora(model, LoraConfig(rank=16, alpha=32.0, target_modules=LORA_TARGETS))
    knobs = ("page_size", "round_steps", "tail_slots", "slot_buckets")
    kv = KVCacheConfig(layout=args.kv, slots=args.slots, pages=args.pages, dtype=args.kv_dtype,
                       **{k: getattr(args, k) for k in knobs if getattr(args, k) is not None})
    for k in knobs:  # as run (the config's defaults where unset)
        setattr(args, k, getattr(kv, k))
    engine = JaxRolloutEngine(model, pad_id=0, prompt_bucket=args.prompt, kv=kv)
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0, stop_token_ids=stop_ids)
    groups = paged_generation_groups(args, prompts) if args.kv == "paged" else None
    times, lengths, timings = [], [], []
    for rep in range(args.reps + 1):
        t0 = time.perf_counter()
        if args.kv == "paged":  # the paged sampler's own call (its host arrays, the pool's counts, its timings)
            out = engine.paged_groups(groups, params, seed=rep, groups_needed=args.groups_needed)
            mask, stats = out["mask"], out
            timings.append({k: out[k] for k in ("prefill_s", "decode_s", "decode_steps")}
                           | dict(occupancy=slot_occupancy(out)))
        else:
            batch = engine.generate(prompts, params, num_generations=args.generations, seed=rep)
            mask = jax.block_until_ready(batch.completion_mask)
        times.append(time.perf_counter() - t0)
        lengths.append(float(mask.sum(axis=1).mean()))
        print(f"call {rep + 1} of {args.reps + 1}: {times[-1]:.2f} s, mean length {lengths[-1]:.1f}",
              file=sys.stderr, flush=True)
    if args.kv == "paged":
        args.paged_stats = paged_memory(stats, cfg, args, kv.pool_dtype(cfg.dtype)) | {
            k: round(statistics.median(t[k] for t in timings[1:]), 4) for k in timings[0]}
    profile = None
    if args.profile:
        from kernels_common import kernel_profile

        if args.kv == "paged":
            call = lambda: engine.paged_groups(groups, params, seed=0, groups_needed=args.groups_needed)["mask"]
        else:
            call = lambda: engine.generate(prompts, params, num_generations=args.generations, seed=0).completion_ids
        profile = kernel_profile(call, trace_dir=args.profile)
    return times, statistics.mean(lengths[1:]), profile


def paged_generation_groups(args, prompts) -> list:
    """The paged generation's groups: ``--generations`` new rows per prompt, and first ``--carried`` rows that continue
    tokens sampled earlier (as a partial rollout's carried rows do: each prefilled again with its tokens, of
    geometric lengths with mean ``--carried-mean``, below ``--new``), two per group, on the first prompts."""
    import numpy as np

    from jrl.rollout.paged import RowGroup, new_groups

    rng = np.random.default_rng(1)
    fresh = new_groups(prompts, args.generations)
    base, carried = len(prompts) * args.generations, []
    for i in range(0, args.carried, 2):
        n = min(2, args.carried - i)
        done = np.minimum(rng.geometric(1 / args.carried_mean, n), args.new - 1)
        carried.append(RowGroup(prompts[(i // 2) % len(prompts)], [rng.integers(1, 1000, k).tolist() for k in done],
                                list(range(base + i, base + i + n))))
    return carried + fresh


def paged_memory(stats: dict, cfg, args, pool_dtype) -> dict:
    """KV bytes of the dense layout and of the paged pool (of ``pool_dtype``) for this generation, and what the rows
    held at most (from a paged generation's counts)."""
    from jrl.rollout.jax_engine import row_bucket

    page_bytes = cfg.kv_bytes_per_token(pool_dtype) * args.page_size
    gib = 2 ** 30
    dense_bytes = row_bucket(args.rows) * (args.prompt + args.new) * cfg.kv_bytes_per_token()
    return dict(dense_kv_gib=round(dense_bytes / gib, 3),
                pool_kv_gib=round(stats["pool"] * page_bytes / gib, 3),
                peak_kv_gib=round((stats["peak_pages"] + stats["prompt_pages"]) * page_bytes / gib, 3),
                preempted=stats["preempted"], rounds=stats["rounds"], shrinks=stats["shrinks"])


def run_transformers(args, shape, prompts) -> tuple[list[float], float]:
    """The same for transformers ``generate`` (sampling, every row to ``--new`` tokens)."""
    import torch
    from train_step_vs_torch import hf_model

    model = hf_model(shape, args.prompt + args.new).eval()
    ids = torch.tensor(prompts, device="cuda")
    times = []
    for rep in range(args.reps + 1):
        torch.manual_seed(rep)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                           top_p=1.0, max_new_tokens=args.new, min_new_tokens=args.new, pad_token_id=0)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times, float(args.new)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    ap.add_argument("--backend", choices=("jrl", "transformers"), default="jrl")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lora", action="store_true", help="rank-16 LoRA on every projection (jrl)")
    ap.add_argument("--generations", type=int, default=1,
                    help="rows per prompt (jrl: num_generations, each prompt prefilled once; --rows / this prompts)")
    ap.add_argument("--stop-fraction", type=float, default=0.0,
                    help="share of the vocabulary that stops a row (ragged lengths; jrl)")
    ap.add_argument("--kv", choices=("dense", "paged"), default="dense", help="rollout.kv.layout (jrl)")
    ap.add_argument("--page-size", type=int, default=None, help="rollout.kv.page_size (paged; default: the config's)")
    ap.add_argument("--round-steps", type=int, default=None,
                    help="rollout.kv.round_steps (paged; default: the config's)")
    ap.add_argument("--tail-slots", type=int, default=None,
                    help="rollout.kv.tail_slots (paged; 0 = never shrink; default: the config's)")
    ap.add_argument("--slots", type=int, default=0, help="rollout.kv.slots (paged; 0 = every row)")
    ap.add_argument("--slot-buckets", type=int, default=None,
                    help="rollout.kv.slot_buckets (paged: slot counts per doubling; default: the config's)")
    ap.add_argument("--pages", type=int, default=0, help="rollout.kv.pages (paged; 0 = enough for every slot)")
    ap.add_argument("--kv-dtype", default="model", help="rollout.kv.dtype (paged: model or float8_e4m3fn)")
    ap.add_argument("--carried", type=int, default=0,
                    help="paged: rows that continue earlier tokens besides --rows new ones (a partial rollout's carry)")
    ap.add_argument("--carried-mean", type=int, default=2500, help="mean length of the carried rows' earlier tokens")
    ap.add_argument("--groups-needed", type=int, default=None,
                    help="paged: stop once this many groups are finished (a partial rollout; default every group)")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--bandwidth-tbs", type=float, default=3.35, help="HBM bandwidth in TB/s (H100 SXM: 3.35)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="jrl: also trace one more call into DIR and report its GPU kernel time by category")
    ap.add_argument("--out", default=None, help="append one JSON line here")
    args = ap.parse_args()

    import numpy as np

    from jrl.models.config import ModelConfig

    shape = SHAPES[args.shape]
    cfg = ModelConfig(**shape, dtype="bfloat16", param_dtype="bfloat16", scan_layers=args.scan_layers)
    rng = np.random.default_rng(0)
    if args.rows % args.generations:
        raise SystemExit(f"--rows {args.rows} is not a multiple of --generations {args.generations}")
    prompts = [rng.integers(1, cfg.vocab_size, args.prompt).tolist() for _ in range(args.rows // args.generations)]
    stop_ids = tuple(range(1, 1 + round(args.stop_fraction * cfg.vocab_size)))
    if args.backend == "jrl":
        import jax

        times, mean_len, profile = run_jrl(args, cfg, prompts, stop_ids)
        device, versions = jax.local_devices()[0].device_kind, f"jax {jax.__version__}"
    else:
        import torch
        import transformers

        times, mean_len = run_transformers(args, shape, [p for p in prompts for _ in range(args.generations)])
        profile = None
        device = torch.cuda.get_device_name()
        versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    med = statistics.median(times[1:])
    limit = bandwidth_limit_s(cfg, args.rows, args.prompt, args.new, args.bandwidth_tbs)
    bound = dict(limit_s=round(limit, 4), fraction_of_limit=round(limit / med, 3)) if not args.stop_fraction else {}
    report(dict(bench="sampler", backend=args.backend, shape=args.shape, rows=args.rows, prompt=args.prompt,
                new=args.new, generations=args.generations, carried=args.carried, groups_needed=args.groups_needed,
                lora=args.lora, stop_fraction=args.stop_fraction,
                kv=args.kv, **(dict(page_size=args.page_size, round_steps=args.round_steps, tail_slots=args.tail_slots,
                                    slot_buckets=args.slot_buckets, slots=args.slots, pages=args.pages,
                                    kv_dtype=args.kv_dtype, **args.paged_stats)
                               if args.kv == "paged" else {}),
                mean_length=round(mean_len, 1),
                scan_layers=args.scan_layers, time_s=round(med, 4),
                tokens_per_s=round((args.rows + args.carried) * mean_len / med), **bound,
                compile_s=round(times[0] - med, 2),
                device=device, versions=versions, date=time.strftime("%Y-%m-%d"),
                **({"profile": profile} if profile else {})), args.out)


if __name__ == "__main__":
    main()
