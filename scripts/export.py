"""Export a jrl training checkpoint as a Hugging Face directory (``jrl export``); see :mod:`jrl.cli.export`."""

import sys

from jrl.cli.export import main  # noqa: F401
from jrl.errors import report

if __name__ == "__main__":
    sys.exit(report(main))
