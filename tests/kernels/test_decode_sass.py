"""The paged decode kernel's compiled form, without a GPU (``benchmarks/kernel_sass.py``: the kernel's Triton IR
compiled for sm_90 by the installed Triton): its block loop stays short. The loop's length is what bounds a float8
pool's step (benchmarks/RESULTS.md, twenty-eighth session: issue-bound at 1,362 instructions a block); these
bounds catch what would lengthen it again, e.g. libdevice's accurate exp (~250 more) or signed division of the slot
by the page size (~45)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_sass.py"


def _compiled(tmp_path, *flags) -> dict:
    out = tmp_path / "sass.jsonl"
    subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), *flags], check=True, capture_output=True,
                   timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    return json.loads(out.read_text().splitlines()[-1])


@pytest.mark.parametrize("dtype,block_k,warps,most", [("float8_e4m3fn", 64, 1, 1100), ("bfloat16", 64, 2, 400)])
def test_the_paged_kernels_block_loop_stays_short(tmp_path, dtype, block_k, warps, most):
    r = _compiled(tmp_path, "--kv-dtype", dtype, "--block-k", str(block_k), "--warps", str(warps))
    ops = r["loop_opcodes"]
    assert r["stack"] == 0, r  # no spills
    products = sum(n for op, n in ops.items() if op.startswith("HMMA.16816"))
    assert products == 64 // warps, ops  # the two [16, 64] x [64, 64] products of a block, over the warps
    assert ops.get("MUFU.EX2", 0) <= 34 // warps + 2, ops  # one exp2 per score (and the rescale), nothing around it
    assert r["loop_instructions"] <= most, r
