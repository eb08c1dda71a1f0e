"""The installed ``jrl`` command dispatches to the same programs as ``scripts/*.py``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
JRL = Path(sys.executable).parent / "jrl"


def _run(*args: str) -> subprocess.CompletedProcess:
    if not JRL.exists():
        pytest.skip(f"the jrl console script is not installed next to {sys.executable} (pip install -e .)")
    return subprocess.run([str(JRL), *args], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_jrl_lists_its_commands_and_refuses_unknown_ones():
    out = _run()
    assert out.returncode == 0 and all(c in out.stdout for c in ("train", "export", "convert", "serve-vllm"))
    bad = _run("nope")
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr


def test_jrl_subcommands_are_the_scripts():
    export = _run("export", "--help")
    assert export.returncode == 0 and "usage: jrl export" in export.stdout and "--adapter-only" in export.stdout
    serve = _run("serve-vllm", "--config", "configs/grpo.py", "--dry-run")
    assert serve.returncode == 0 and "-m vllm" in serve.stdout and "--model models/tiny-arithmetic" in serve.stdout
    train = _run("train", "--config", "configs/grpo.py", "--max-steps", "0")
    assert train.returncode != 0 and "TrainConfig.max_steps=0" in train.stdout + train.stderr
