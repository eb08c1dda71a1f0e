"""``TrainConfig.compile_cache_dir``: a program compiled by one process is read back by the next from JAX's
persistent compilation cache (real processes, real cache files), with the same result; a process keeps the first
directory it was given; a directory that cannot be created is a warning, not an error; a run's log says what the
cache did; an empty name is refused naming the field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import child_processes as helpers
from train_testlib import run_worker

from jrl.train.config import TrainConfig


def _run(cache: Path, other: Path) -> dict:
    return run_worker("compile_cache_worker.py", str(cache), str(other), num_devices=1, timeout=120)


def test_a_program_compiled_by_one_process_is_read_back_by_the_next(tmp_path):
    cache, other = tmp_path / "cache", tmp_path / "other"
    first = _run(cache, other)
    assert first["loaded"] == 0 and first["written"] >= 1, first
    assert any(p.name.endswith("-cache") for p in cache.iterdir())
    second = _run(cache, other)
    assert second["loaded"] >= 1 and second["written"] == 0, second
    assert second["value"] == first["value"]


def test_a_process_keeps_the_first_directory_and_says_so(tmp_path):
    out = _run(tmp_path / "cache", tmp_path / "other")
    assert out["same"] and out["jax_dir"] == str(tmp_path / "cache")
    assert len(out["warnings"]) == 1 and str(tmp_path / "cache") in out["warnings"][0], out
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("bad", ["", "  "])
def test_an_empty_directory_name_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="compile_cache_dir"):
        TrainConfig(compile_cache_dir=bad)


def test_a_directory_that_cannot_be_created_leaves_the_cache_off_with_a_warning(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code = ("import logging; from jrl.train import compile_cache; logging.basicConfig(); "
            f"print('result', compile_cache.enable({str(blocker / 'cache')!r}))")
    proc = subprocess.run([sys.executable, "-c", code], env=helpers.worker_env(1), capture_output=True, text=True,
                          timeout=120, cwd=helpers.REPO)
    assert proc.returncode == 0 and "result None" in proc.stdout, proc.stderr[-3000:]
    assert "cannot be created" in proc.stderr and "--compile-cache-dir" in proc.stderr, proc.stderr


def test_the_compile_clock_counts_a_new_programs_compile_and_not_its_reruns():
    """``time/compile`` of a step: the seconds of backend compiles, from any thread; a program run again adds none."""
    import threading

    import jax
    import jax.numpy as jnp

    from jrl.train.compile_clock import compiled_seconds

    before = compiled_seconds()
    fn = jax.jit(lambda x: jnp.sin(x) * 3.25 + jnp.cos(x) ** 2)  # a program no other test compiles
    fn(jnp.arange(7.0)).block_until_ready()
    after_first = compiled_seconds()
    assert after_first > before
    fn(jnp.arange(7.0)).block_until_ready()
    assert compiled_seconds() == after_first
    other = threading.Thread(target=lambda: jax.jit(lambda x: jnp.tanh(x) - 0.125)(jnp.ones(5)).block_until_ready())
    other.start()
    other.join()
    assert compiled_seconds() > after_first
