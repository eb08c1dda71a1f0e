"""Train with GRPO or EBFT from a Python config file (``jrl train``); see :mod:`jrl.cli.train`."""

import sys

from jrl.cli.train import SUMMARY_METRICS, main, parse_config, summary  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
