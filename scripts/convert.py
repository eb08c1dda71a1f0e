"""Convert a Hugging Face checkpoint through jrl and back, or run the demo (``jrl convert``); see
:mod:`jrl.cli.convert`."""

import sys

from jrl.cli.convert import convert, demo, main, verify  # noqa: F401
from jrl.errors import report

if __name__ == "__main__":
    sys.exit(report(main))
