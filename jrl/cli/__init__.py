"""The ``jrl`` command: ``jrl train``, ``jrl explore``, ``jrl export``, ``jrl convert``, ``jrl serve-vllm`` (the same
programs as ``scripts/<name>.py``; ``jrl <command> --help`` documents each)."""

from __future__ import annotations

import importlib
import sys

from jrl.errors import report

#: Subcommand → module whose ``main(argv)`` runs it, and what it does.
COMMANDS = {
    "train": ("jrl.cli.train", "train with GRPO or EBFT from a config file (--config FILE, tyro overrides)"),
    "explore": ("jrl.cli.explore", "sample and score for a trainer started with --mode train (= train --mode explore)"),
    "export": ("jrl.cli.export", "export a training checkpoint as a Hugging Face directory or a PEFT adapter"),
    "convert": ("jrl.cli.convert", "convert a Hugging Face checkpoint through jrl and back (or --demo)"),
    "serve-vllm": ("jrl.cli.serve_vllm", "start the vLLM server a config's vllm rollout backend talks to"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return ("usage: jrl COMMAND [ARGS...] [--debug]\n\ncommands:\n" + "\n".join(lines)
            + "\n\n'jrl COMMAND --help' for its options; --debug prints the traceback of any error")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"jrl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    sys.argv = [f"jrl {name}", *rest]  # what the command's --help and errors call it
    return report(importlib.import_module(COMMANDS[name][0]).main, rest)
