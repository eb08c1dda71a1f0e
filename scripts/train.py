"""Train with GRPO or EBFT from a Python config file (``jrl train``); see :mod:`jrl.cli.train`."""

import sys

from jrl.cli.train import main, parse_config, summary  # noqa: F401
from jrl.errors import report

if __name__ == "__main__":
    sys.exit(report(main))
