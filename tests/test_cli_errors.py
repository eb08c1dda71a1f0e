"""Errors a user causes and can fix end a command with exit code 2 and one or two lines naming what and how to fix
it, no traceback (``--debug`` shows one); a full disk during a checkpoint leaves the previous checkpoint the latest,
no partial directory, and ``--resume`` afterwards continues exactly. Real processes, real file systems (tmpfs mounts
for a read-only and a full disk)."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jrl.errors import describe, is_expected

ROOT = Path(__file__).resolve().parents[1]
TRAIN = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", "configs/grpo.py"]


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _error_lines(proc: subprocess.CompletedProcess) -> list[str]:
    """stderr without the run's own log lines and progress bars."""
    lines = proc.stderr.replace("\r", "\n").splitlines()
    return [ln for ln in lines if ln.strip() and not ln.startswith(("grpo:", "20")) and "it/s" not in ln]


def _assert_user_error(proc, *needles: str) -> None:
    lines = _error_lines(proc)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) <= 3 and lines[0].startswith("error: "), lines
    for needle in needles:
        assert needle in lines[0], (needle, lines)


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    path.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, text=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def test_a_bad_value_in_a_config_file_names_the_field(tmp_path):
    config = tmp_path / "bad.py"
    config.write_text("from jrl.train import TrainConfig\n\n\ndef config():\n    return TrainConfig(max_steps=-3)\n")
    _assert_user_error(_run(sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(config)),
                       "TrainConfig.max_steps=-3")


def test_a_bad_value_on_the_command_line_is_refused_by_the_parser(tmp_path):
    """tyro reports values given on the command line in its own box (a few lines): exit 2, the field, no traceback."""
    proc = _run(*TRAIN, "--rollout.temperature", "-1", "--output-dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "temperature=-1.0 must be > 0" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("args, needles", [
    (["--config", "no_such_config.py"], ["no_such_config.py"]),
    (["--config", "configs/grpo.py", "--model.path", "/no/such/model"], ["ModelSpec.path='/no/such/model'"]),
])
def test_missing_files_are_named(args, needles):
    _assert_user_error(_run(sys.executable, str(ROOT / "scripts" / "train.py"), *args), *needles)


def test_malformed_data_names_the_file_and_line(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1 + 1"}\n{"prompt": oops}\n')
    _assert_user_error(_run(*TRAIN, "--data.source", str(data), "--output-dir", str(tmp_path / "run")),
                       str(data), "line 2")


def test_export_without_a_checkpoint(tmp_path):
    (tmp_path / "run").mkdir()
    _assert_user_error(_run(sys.executable, str(ROOT / "scripts" / "export.py"), str(tmp_path / "run"),
                            str(tmp_path / "out")), "no checkpoint", str(tmp_path / "run"))


def test_debug_shows_the_traceback():
    proc = _run(sys.executable, str(ROOT / "scripts" / "train.py"), "--config", "no_such_config.py", "--debug")
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "no_such_config.py" in proc.stderr


def test_a_read_only_output_directory(tmp_path):
    with _tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        _assert_user_error(_run(*TRAIN, "--max-steps", "2", "--output-dir", str(ro / "run")), "Read-only",
                           str(ro / "run"))


def _metrics(path: Path) -> list[dict]:
    keep = ("reward/mean", "loss", "grad_norm", "completions/mean_length")
    return [{k: row.get(k) for k in ("step", *keep)} for row in map(json.loads, path.read_text().splitlines())]


def test_disk_full_at_a_checkpoint_keeps_the_last_one_and_resume_continues_exactly(tmp_path):
    """A checkpoint is ~5.3 MiB: on an 8 MiB disk the one of step 2 fits and the one of step 4 does not."""
    steps = ["--max-steps", "4", "--save-every", "2"]
    with _tmpfs(tmp_path / "small", "size=8m") as small:
        run = small / "run"
        proc = _run(*TRAIN, *steps, "--output-dir", str(run))
        _assert_user_error(proc, "no space for checkpoint 4", str(run / "checkpoints"), "free there",
                           "checkpoint 2 is intact")
        left = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert left == ["2"], left  # no partial directory of step 4
        shutil.copytree(run, tmp_path / "moved")  # the user frees space: here, the run moves to a larger disk
    resumed = _run(*TRAIN, *steps, "--output-dir", str(tmp_path / "moved"), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = _run(*TRAIN, *steps, "--output-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert _metrics(tmp_path / "moved" / "metrics.jsonl") == _metrics(tmp_path / "whole" / "metrics.jsonl")
    assert sorted(p.name for p in (tmp_path / "moved" / "checkpoints").iterdir()) == ["2", "4"]


def test_library_errors_are_bugs_and_file_system_errors_are_not(tmp_path):
    try:
        np.reshape(np.zeros(3), (2, 2))  # a ValueError raised inside a library: a bug
    except ValueError as e:
        library = e
    try:
        open(tmp_path / "missing" / "file")  # noqa: SIM115
    except OSError as e:
        missing = e
    from jrl.train.config import load_config_file

    try:
        load_config_file(str(tmp_path / "nope.py"))
    except Exception as e:  # noqa: BLE001
        ours = e
    assert not is_expected(library)
    assert is_expected(missing) and str(tmp_path / "missing" / "file") in describe(missing)
    assert is_expected(ours)


#: A run whose device runs out of memory (a real XLA allocation of 4 TiB) while another thread never ends, as the
#: other devices of a program wait in a collective for the one that failed.
OUT_OF_MEMORY_RUN = """
import threading
import jax.numpy as jnp
from jrl.errors import report

def main(argv):
    threading.Thread(target=threading.Event().wait, name="waiting-peer").start()
    jnp.zeros((2**40,), jnp.float32).block_until_ready()
    return 0

raise SystemExit(report(main, []))
"""


def test_an_autotuner_that_ran_out_of_memory_is_told_as_out_of_memory():
    """On a GPU XLA's autotuner reports a program whose every candidate ran out of memory as NOT_FOUND (the message
    of an H100 run, in JAX's own error type): it is the user's out-of-memory, with the knobs."""
    import jax

    from jrl.errors import describe, is_expected

    error = jax.errors.JaxRuntimeError(
        "NOT_FOUND: All configs failed during profiling or were excluded from selection.\nFailures (3):\n"
        "EXECUTION FAILED: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 8.02GiB with allocator "
        "GPU_0_bfc on device 0.")
    text = describe(error)
    assert is_expected(error) and text.startswith("a device ran out of memory (EXECUTION FAILED: RESOURCE_EXHAUSTED")
    assert "--optim.micro-batch-size" in text.splitlines()[1]
    assert "--rollout.kv.dtype float8_e4m3fn" in text.splitlines()[1] and len(text.splitlines()) == 2
    other = jax.errors.JaxRuntimeError("NOT_FOUND: All configs failed during profiling (a kernel did not compile)")
    assert not is_expected(other)


def test_a_device_out_of_memory_names_the_knobs_and_the_process_leaves_at_once():
    proc = _run(sys.executable, "-c", OUT_OF_MEMORY_RUN, timeout=120)
    _assert_user_error(proc, "a device ran out of memory", "RESOURCE_EXHAUSTED")
    assert "--optim.micro-batch-size" in _error_lines(proc)[1], proc.stderr
    assert "--rollout.kv.layout paged" in _error_lines(proc)[1], proc.stderr


#: A command whose worker thread crashes the process in native code (a segmentation fault).
NATIVE_CRASH_RUN = """
import ctypes
import threading
from jrl.errors import report

def crash_in_native_code():
    ctypes.string_at(0)

def main(argv):
    worker = threading.Thread(target=crash_in_native_code, name="crashing-worker")
    worker.start()
    worker.join()
    return 0

raise SystemExit(report(main, []))
"""


def test_a_crash_in_native_code_prints_every_threads_stack():
    proc = _run(sys.executable, "-c", NATIVE_CRASH_RUN, timeout=120)
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stderr)
    assert "Fatal Python error: Segmentation fault" in proc.stderr, proc.stderr
    assert "in crash_in_native_code" in proc.stderr and "in main" in proc.stderr, proc.stderr
