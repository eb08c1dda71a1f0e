"""Start the vLLM server a jrl config talks to (``jrl serve-vllm``); see :mod:`jrl.cli.serve_vllm`."""

import sys

from jrl.cli.serve_vllm import command_for, main, parse  # noqa: F401
from jrl.errors import report

if __name__ == "__main__":
    sys.exit(report(main))
