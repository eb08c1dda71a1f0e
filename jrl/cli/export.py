"""Export a jrl training checkpoint as a Hugging Face model directory.

    python scripts/export.py CHECKPOINT OUT_DIR [--merge-lora | --adapter-only] [--dtype bfloat16]

CHECKPOINT is a run's output directory (the latest checkpoint is used), its ``checkpoints``
directory, or one step inside it. LoRA runs are merged into the base weights (``--merge-lora``, the
default), or written as a PEFT adapter directory with ``--adapter-only`` (bfloat16 unless ``--dtype``).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="run output dir, its checkpoints/ dir, or checkpoints/<step>")
    parser.add_argument("out_dir", help="Hugging Face directory to write")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--merge-lora", action="store_true", help="fold LoRA adapters into the weights (default)")
    mode.add_argument("--adapter-only", action="store_true",
                      help="write a LoRA run's adapters as a PEFT adapter directory")
    parser.add_argument("--dtype", default=None,
                        help="dtype of the written weights (default: parameter dtype; bfloat16 with --adapter-only)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty out_dir that is not an earlier export (its contents are lost)")
    args = parser.parse_args(argv)
    from jrl.train.export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out_dir, adapter_only=args.adapter_only, dtype=args.dtype,
                            overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
