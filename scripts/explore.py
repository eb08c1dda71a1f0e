"""Sample and score for a trainer started with ``--mode train`` (``jrl explore``); see :mod:`jrl.cli.explore`."""

import sys

from jrl.cli.explore import main

if __name__ == "__main__":
    sys.exit(main())
