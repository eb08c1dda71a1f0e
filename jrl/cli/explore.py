"""An explorer process for a trainer started with ``--mode train`` (``jrl train --mode explore``): the same config
file and overrides as the trainer's, plus ``--explore.name``.

    python scripts/explore.py --config configs/grpo.py --explore.name e1
"""

from __future__ import annotations

import sys

from jrl.cli.train import main as train_main


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    return train_main([*argv, "--mode", "explore"])


if __name__ == "__main__":
    sys.exit(main())
