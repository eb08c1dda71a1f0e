"""Sample and score for a trainer started with ``--mode train`` (``jrl explore``); see :mod:`jrl.cli.explore`."""

import sys

from jrl.cli.explore import main
from jrl.errors import report

if __name__ == "__main__":
    sys.exit(report(main))
