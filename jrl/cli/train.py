"""Train with GRPO or EBFT from a Python config file, with command-line overrides.

    python scripts/train.py --config configs/grpo.py [--max-steps 3] [--output-dir runs/x]
                            [--rollout.temperature 0.8] [--resume] ...
    python scripts/train.py --config configs/ebft.py          # EBFT structured mode
    python scripts/train.py --config configs/ebft_strided.py  # EBFT strided mode
    python scripts/train.py --config configs/grpo.py --help     # every field, with its documentation

``--config FILE`` names a Python file defining ``config()`` that returns a ``jrl.train.TrainConfig``;
the remaining arguments override its fields (tyro, dotted names for nested sections). ``--algorithm``
picks the training method (``grpo``, ``ebft_structured``, ``ebft_strided``).
"""

from __future__ import annotations

import argparse
import logging
import sys

#: Metrics of the last logged step that the closing summary prints, per kind of run.
SUMMARY_METRICS = {"grpo": ("reward/mean",), "ebft_structured": ("ebft/alignment", "ebft/cfm_loss", "ebft/reward"),
                   "ebft_strided": ("ebft/alignment", "ebft/cfm_loss", "ebft/reward")}


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
                    description="GRPO or EBFT training (--algorithm grpo | ebft_structured | ebft_strided). "
                                "Pass --config FILE (a Python file with config()) first.")


def summary(cfg, history: list[dict]) -> str:
    """The closing line of a run: steps logged, the run kind's :data:`SUMMARY_METRICS` of the last step
    (those it logged), and where the log and the plot are."""
    keys = SUMMARY_METRICS[cfg.algorithm]
    last = history[-1]
    values = ", ".join(f"{k} {last[k]:.4f}" for k in keys if last.get(k) is not None)
    return (f"done: {len(history)} steps logged in {cfg.output_dir}/metrics.jsonl; "
            + (f"last {values}; " if values else "") + f"plot {cfg.output_dir}/curves.png")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_config(argv)
    from jrl.sharding import initialize

    initialize()  # joins a multi-host run (TPU pod, JRL_* variables); a no-op for one process
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("jrl").setLevel(logging.INFO)
    from jrl.train.trainer import train

    history = train(cfg)
    if history:
        print(summary(cfg, history))
    return 0


if __name__ == "__main__":
    sys.exit(main())
