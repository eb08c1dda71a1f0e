"""The embedded sampler (``JaxRolloutEngine.generate``) against the memory-bandwidth limit of the GPU.

Random-weight model of a benchmark shape (``train_step_vs_torch.SHAPES``) in bf16; ``--rows`` rows of
``--prompt`` left-padded prompt tokens, ``--new`` new tokens each (no stop token, so every row runs to the
end), temperature 1. Reported: median wall time of a ``generate`` call after a compiling one, generated
tokens/s, and the bandwidth limit: every decode step reads all weights once plus the KV cache written so
far, at ``--bandwidth-tbs``.

    python benchmarks/sampler.py --shape llama1b --rows 64 --prompt 128 --new 256 --out results.jsonl
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
    kv_per_token = 2 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * rows
    cache = sum(kv_per_token * (prompt + i) for i in range(new))
    return (new * weights + cache) / (tbs * 1e12)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lora", action="store_true", help="rank-16 LoRA on every projection")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--bandwidth-tbs", type=float, default=3.35, help="HBM bandwidth in TB/s (H100 SXM: 3.35)")
    ap.add_argument("--out", default=None, help="append one JSON line here")
    args = ap.parse_args()

    import jax
    import numpy as np

    from jrl.models.config import ModelConfig
    from jrl.models.lora import LoraConfig, apply_lora
    from jrl.models.transformer import create_model
    from jrl.rollout.base import SamplingParams
    from jrl.rollout.jax_engine import JaxRolloutEngine

    cfg = ModelConfig(**SHAPES[args.shape], dtype="bfloat16", param_dtype="bfloat16", scan_layers=args.scan_layers)
    model = create_model(cfg, seed=0)
    if args.lora:
        apply_lora(model, LoraConfig(rank=16, alpha=32.0, target_modules=LORA_TARGETS))
    engine = JaxRolloutEngine(model, pad_id=0, prompt_bucket=args.prompt)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, args.prompt).tolist() for _ in range(args.rows)]
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0)
    times = []
    for rep in range(args.reps + 1):
        t0 = time.perf_counter()
        out = engine.generate(prompts, params, num_generations=1, seed=rep)
        jax.block_until_ready(out.completion_ids)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times[1:])
    limit = bandwidth_limit_s(cfg, args.rows, args.prompt, args.new, args.bandwidth_tbs)
    report(dict(bench="sampler", shape=args.shape, rows=args.rows, prompt=args.prompt, new=args.new, lora=args.lora,
                scan_layers=args.scan_layers, time_s=round(med, 4), tokens_per_s=round(args.rows * args.new / med),
                limit_s=round(limit, 4), fraction_of_limit=round(limit / med, 3),
                compile_s=round(times[0] - med, 2), device=jax.local_devices()[0].device_kind,
                versions=f"jax {jax.__version__}", date=time.strftime("%Y-%m-%d")), args.out)


if __name__ == "__main__":
    main()
