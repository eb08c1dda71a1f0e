"""A benchmark run as several processes of one host, joined as the processes of a multi-host run are
(:func:`jrl.sharding.initialize`'s ``JRL_*`` variables): each process sees its own share of the devices
(``CUDA_VISIBLE_DEVICES`` on a GPU host, that many fake devices on CPU), so a one-host run times the path a pod
takes (every collective between processes, host all-gathers included)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

from jrl.sharding.distributed import ENV_PROCESS_ID


def is_worker() -> bool:
    """Whether this process was started by :func:`launch` (the launcher itself runs nothing of the benchmark)."""
    return ENV_PROCESS_ID in os.environ


def _on_cpu() -> bool:
    return os.environ.get("JAX_PLATFORMS", "") == "cpu"


def host_device_count() -> int:
    """The devices the launched processes share, counted without starting JAX (which would take GPU memory):
    ``XLA_FLAGS``'s fake device count on CPU (``JAX_PLATFORMS=cpu``), else the visible GPUs."""
    if _on_cpu():
        found = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
        return int(found.group(1)) if found else 1
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    return sum(line.startswith("GPU ") for line in listing.splitlines())


def launch(script: str, argv: list[str], processes: int, devices: int, timeout_s: float) -> int:
    """Run ``script argv`` as ``processes`` processes over ``devices`` devices (process ``i`` gets devices
    ``i x devices / processes`` onwards); returns the worst exit code. A process that outlives ``timeout_s`` is
    killed with the others (exit code 124), so a hung collective ends the run instead of blocking it."""
    if processes < 1 or devices % processes:
        raise SystemExit(f"--processes {processes} does not divide the {devices} devices")
    per = devices // processes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gpus = (os.environ.get("CUDA_VISIBLE_DEVICES") or ",".join(map(str, range(devices)))).split(",")
    procs = []
    for i in range(processes):
        env = dict(os.environ, JRL_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JRL_NUM_PROCESSES=str(processes),
                   JRL_PROCESS_ID=str(i))
        if _on_cpu():
            flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
            env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={per}".strip()
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[i * per:(i + 1) * per])
        procs.append(subprocess.Popen([sys.executable, script, *argv], env=env))
    deadline = time.monotonic() + timeout_s  # one limit for the run, not a fresh one per process waited for
    try:
        return max(p.wait(timeout=max(deadline - time.monotonic(), 0.0)) for p in procs)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
            p.wait()
        return 124
