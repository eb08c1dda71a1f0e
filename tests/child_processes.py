"""Helpers for tests that run JAX in child processes (fake CPU devices, several processes joined by
``jax.distributed``): their environment, a free port, and their JSON results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: XLA:CPU flags every CPU test process compiles with (conftest.py sets them for the pytest processes where JAX can
#: only run on the CPU). The tests' programs are tiny, so compiling them is most of the suite's time: LLVM at
#: optimisation level 0 without its expensive passes, and the elemental emitters instead of the MLIR fusion emitters,
#: compile them 2-3x faster. HLO optimisation, the SPMD partitioning under test and the float32 semantics are
#: unchanged.
FAST_COMPILE_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                          "--xla_cpu_use_fusion_emitters=false")


def worker_env(num_devices: int, **extra: str) -> dict[str, str]:
    """Environment for a child JAX process on ``num_devices`` fake CPU devices (a crash in native code prints every
    thread's Python stack)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JRL_", "JAX_", "XLA_"))}
    env.update(
        PYTHONFAULTHANDLER="1",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={num_devices} {FAST_COMPILE_XLA_FLAGS}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    env.update(extra)
    return env


def parse_json_tail(stdout: str) -> dict:
    """The JSON object a worker printed on its last line starting with ``{``."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise AssertionError(f"worker printed no JSON result; stdout tail:\n{stdout[-3000:]}")


def json_results(procs: list[subprocess.Popen], timeout: float) -> list[dict]:
    """The JSON result of each of the started workers ``procs`` (a non-zero exit fails with its output); any still
    running when this ends is killed."""
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            if p.returncode:
                raise AssertionError(
                    f"worker exited {p.returncode}\nstdout:\n{stdout[-2000:]}\nstderr:\n{stderr[-6000:]}")
            outs.append(parse_json_tail(stdout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
