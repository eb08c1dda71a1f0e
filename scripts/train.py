"""Train with GRPO from a Python config file, with command-line overrides.

    python scripts/train.py --config configs/grpo.py [--max-steps 3] [--output-dir runs/x]
                            [--rollout.temperature 0.8] [--resume] ...
    python scripts/train.py --config configs/grpo.py --help     # every field, with its documentation

``--config FILE`` names a Python file defining ``config()`` that returns a ``jrl.train.TrainConfig``;
the remaining arguments override its fields (tyro, dotted names for nested sections).
"""

from __future__ import annotations

import argparse
import logging
import sys


def parse_config(argv: list[str]):
    """(TrainConfig) from ``--config FILE`` plus tyro overrides in ``argv``."""
    import tyro

    from jrl.train.config import TrainConfig, load_config_file

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    default = load_config_file(known.config) if known.config else None
    prog = "train.py --config " + known.config if known.config else "train.py"
    return tyro.cli(TrainConfig, default=default, args=rest, prog=prog,
                    description="GRPO training. Pass --config FILE (a Python file with config()) first.")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_config(argv)
    from jrl.sharding import initialize

    initialize()  # joins a multi-host run (TPU pod, JRL_* variables); a no-op for one process
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("jrl").setLevel(logging.INFO)
    from jrl.train.grpo import train

    history = train(cfg)
    if history:
        last = history[-1]
        print(f"done: {len(history)} steps logged in {cfg.output_dir}/metrics.jsonl; last reward/mean "
              f"{last.get('reward/mean', float('nan')):.4f}; plot {cfg.output_dir}/curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
