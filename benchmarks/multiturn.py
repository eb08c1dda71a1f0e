"""Multi-turn episodes on the embedded sampler: continuing each turn on the KV cache against prefilling the whole
conversation again at every turn (``env.reuse_kv_cache``), same model, prompts, environment and seeds.

    python benchmarks/multiturn.py [--turns 8] [--rows 16] [--prompt-tokens 256] [--new-tokens 16] [--obs-tokens 16]

A random-weight Llama-shaped model (``--hidden``, ``--layers``, ``--dtype``), an environment that answers every turn
with ``--obs-tokens`` tokens and ends the episode after ``--turns`` turns (no stop token: every turn writes
``--new-tokens``). Each mode runs once to compile, then ``--repeats`` times timed; prints one JSON line per mode and
the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_common import report  # noqa: E402


class FixedTurns:
    """Every turn answered with the same observation; done after ``turns`` turns."""

    def __init__(self, turns: int, observation: list[int]):
        self.turns, self.observation = turns, observation

    def reset(self, row):
        return FixedTurnsEpisode(self)


class FixedTurnsEpisode:
    def __init__(self, env: FixedTurns):
        self.env, self.turn = env, 0

    def step(self, text, token_ids):
        from jrl.envs import StepResult

        self.turn += 1
        return StepResult(observation=self.env.observation, done=self.turn >= self.env.turns)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--rows", type=int, default=16, help="episodes (prompts x 2 generations)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--obs-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="float32", help="the model's compute and parameter dtype (bfloat16 on a GPU)")
    ap.add_argument("--out", default=None, help="append the JSON lines here")
    args = ap.parse_args()

    import jax

    from jrl.data.pipeline import PromptBatch
    from jrl.envs import EnvConfig, EnvSteps, run_episodes
    from jrl.models import ModelConfig, create_model
    from jrl.rollout import SamplingParams
    from jrl.rollout.jax_engine import JaxRolloutEngine

    vocab = 512
    model = create_model(ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=args.hidden,
                                     intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                                     num_attention_heads=args.hidden // 64,
                                     num_key_value_heads=max(1, args.hidden // 128),
                                     max_position_embeddings=8192, dtype=args.dtype, param_dtype=args.dtype), seed=0)
    engine = JaxRolloutEngine(model, pad_id=0, prompt_bucket=32)
    rng = np.random.default_rng(0)
    n = args.rows // 2
    prompts = PromptBatch(prompt_ids=rng.integers(1, vocab, (n, args.prompt_tokens)).tolist(), prompt_texts=[""] * n,
                          prompts=[""] * n, columns={}, indices=list(range(n)))
    env = FixedTurns(args.turns, rng.integers(1, vocab, args.obs_tokens).tolist())
    sampling = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0)
    budget = args.turns * (args.new_tokens + args.obs_tokens)
    rows = []
    for reuse in (True, False):
        cfg = EnvConfig(name="bench", max_turns=args.turns, max_episode_tokens=budget, reuse_kv_cache=reuse)
        steps = EnvSteps(60.0)
        times = []
        try:
            for k in range(args.repeats + 1):
                t0 = time.perf_counter()
                out = run_episodes(engine, env, prompts, sampling, num_generations=2, seed=k, cfg=cfg,
                                   encode=lambda t: [], decode=lambda ids: "", pad_id=0, steps=steps)
                times.append(time.perf_counter() - t0)
        finally:
            steps.close()
        assert (out.turns == args.turns).all(), out.turns
        row = dict(bench="multiturn", reuse_kv_cache=reuse, turns=args.turns, rows=args.rows,
                   prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens, obs_tokens=args.obs_tokens,
                   hidden=args.hidden, layers=args.layers, dtype=args.dtype,
                   episode_s=round(statistics.median(times[1:]), 4),
                   first_s=round(times[0], 2), device=jax.devices()[0].device_kind, jax=jax.__version__)
        rows.append(row)
        report(row, args.out)
    print(f"KV reuse: {rows[1]['episode_s'] / rows[0]['episode_s']:.2f}x faster than prefilling every turn")


if __name__ == "__main__":
    main()
