"""Helpers for the sharding tests: multi-device work runs in child processes with fake CPU devices
(``--xla_force_host_platform_device_count``), so the main test session keeps its single device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from child_processes import REPO, free_port, json_results, parse_json_tail, worker_env

WORKERS = Path(__file__).parent / "workers"


def run_worker(script: str, *args: str, num_devices: int = 8, timeout: float = 240, **env: str) -> dict:
    """Run ``workers/<script>`` with ``num_devices`` fake CPU devices; return its JSON result."""
    proc = subprocess.run(
        [sys.executable, str(WORKERS / script), *args],
        env=worker_env(num_devices, **env), capture_output=True, text=True, timeout=timeout, cwd=REPO,
    )
    if proc.returncode:
        raise AssertionError(
            f"{script} exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return parse_json_tail(proc.stdout)


@pytest.fixture(scope="session")
def helpers():
    """The helpers above, for test modules (conftest modules are not importable by name)."""
    import types

    return types.SimpleNamespace(run_worker=run_worker, worker_env=worker_env, parse_json_tail=parse_json_tail,
                                 json_results=json_results,
                                 free_port=free_port, workers=WORKERS, repo=REPO)
