"""Launch a vLLM server for a jrl run: the command and environment a config needs, a child process in
its own process group, a bounded wait for ``/health``, and a stop by that process's id.

The server runs from its own Python environment (``VLLMConfig.python``); vLLM is never imported here.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from jrl.rollout.vllm_config import VLLMConfig
from jrl.rollout.vllm_http import VLLMClient, VLLMUnavailableError

#: ``--max-lora-rank`` values vLLM accepts.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds adapters of ``rank``."""
    for r in VLLM_LORA_RANKS:
        if r >= rank:
            return r
    raise ValueError(f"LoRA rank {rank} is larger than vLLM's largest --max-lora-rank {VLLM_LORA_RANKS[-1]}")


def server_command(cfg: VLLMConfig, *, model: str | os.PathLike, lora_rank: int | None,
                   max_loras: int = 2, index: int = 0) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of a vLLM OpenAI server for ``model`` as ``cfg`` describes it, serving on the
    address of ``cfg.base_urls[index]``.

    ``lora_rank``: the run's LoRA rank (None = no LoRA: no adapter flags). ``max_loras``: adapters held at
    once, at least ``max_staleness + 1``. ``VLLM_SERVER_DEV_MODE=1`` is always set: vLLM 0.32 serves
    ``/reset_prefix_cache`` (needed after every sync) and ``/collective_rpc`` (full-weight reload) only in
    that mode, so the server's port must not be exposed beyond the trainer. Sampled-token logprobs are
    taken after temperature/top-k/top-p (``--logprobs-mode processed_logprobs``), the quantity the
    trainer's importance ratios need.
    """
    host, port = cfg.address(index)
    argv = [cfg.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--host", host, "--port", str(port), "--dtype", cfg.dtype,
            "--max-model-len", str(cfg.max_model_len), "--logprobs-mode", "processed_logprobs"]
    if cfg.served_model_name is not None:
        argv += ["--served-model-name", cfg.served_model_name]
    if cfg.api_key is not None:
        argv += ["--api-key", cfg.api_key]
    env: dict[str, str] = {"VLLM_SERVER_DEV_MODE": "1"}
    if lora_rank is not None:
        rank = cfg.max_lora_rank if cfg.max_lora_rank is not None else vllm_lora_rank(lora_rank)
        if rank < lora_rank:
            raise ValueError(f"VLLMConfig.max_lora_rank={rank} is smaller than the run's lora.rank={lora_rank}; "
                             f"raise it (vLLM accepts {VLLM_LORA_RANKS})")
        argv += ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", str(max(1, int(max_loras)))]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if cfg.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.cpu_kvcache_gib)
    else:
        argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
    argv += list(cfg.extra_args)
    return argv, env


class VLLMServer:
    """A vLLM server child process (own process group), stopped by its process id.

    ``start()`` launches it with its output going to ``log_file`` (None: this process's stdout) and waits
    until ``/health`` answers (at most ``startup_timeout``; an early exit raises with the log's tail).
    ``stop()`` sends SIGTERM to the server's process group, then SIGKILL after ``stop_timeout`` seconds, and returns
    once no process of the group is left running. Usable as a context manager.
    """

    def __init__(self, argv: list[str], env: dict[str, str], *, base_url: str, log_file: str | os.PathLike | None,
                 startup_timeout: float = 300.0, stop_timeout: float = 30.0):
        self.argv, self.env = list(argv), dict(env)
        self.base_url = base_url
        self.log_file = None if log_file is None else Path(log_file)
        self.startup_timeout = float(startup_timeout)
        self.stop_timeout = float(stop_timeout)
        self.process: subprocess.Popen | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    def log_tail(self, lines: int = 30) -> str:
        if self.log_file is None:
            return "(the server's output is above)"
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def start(self) -> VLLMServer:
        if self.process is not None and self.process.poll() is None:
            raise RuntimeError(f"the vLLM server (pid {self.pid}) is already running")
        python = self.argv[0]
        if shutil.which(python) is None:
            raise FileNotFoundError(
                f"the vLLM python {python!r} (rollout.vllm.python) does not exist or is not executable; install "
                "vLLM in its own venv (scripts/install_vllm_cpu.sh for CPU, see README) or pass "
                "--rollout.vllm.python PATH")
        env = {**os.environ, **self.env}
        if self.log_file is None:
            self.process = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        else:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_file, "ab") as log:
                self.process = subprocess.Popen(self.argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, start_new_session=True)
        client = VLLMClient(self.base_url, connect_timeout=2.0, read_timeout=10.0)
        try:
            self._wait_healthy(client)
        finally:
            client.close()
        return self

    def _wait_healthy(self, client: VLLMClient) -> None:
        t0 = time.monotonic()
        while not client.healthy():
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise RuntimeError(f"the vLLM server exited with code {code} before {self.base_url}/health answered; "
                                   f"last lines of its log:\n{self.log_tail()}")
            if time.monotonic() - t0 > self.startup_timeout:
                self.stop()
                raise VLLMUnavailableError(f"the vLLM server did not answer {self.base_url}/health within "
                                           f"{self.startup_timeout:g} s (stopped it); its log:\n"
                                           f"{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> int | None:
        """Stop the server and its workers; returns its exit code (None if it was not started)."""
        proc, self.process = self.process, None
        if proc is None:
            return None
        if proc.poll() is None:
            _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                pass  # the SIGKILL below ends it
        self._kill_group(proc)  # and the workers it left behind in its group, if any
        return proc.returncode

    def kill(self) -> None:
        """Kill the server and its workers at once (SIGKILL to its process group), as a crash would."""
        proc, self.process = self.process, None
        if proc is not None:
            self._kill_group(proc)

    def _kill_group(self, proc: subprocess.Popen) -> None:
        """SIGKILL the server's process group, reap the server, and return once no live process is left in the group
        (a worker still holding its GPU memory would make the next server's start fail); raise after
        ``stop_timeout`` seconds."""
        pgid = proc.pid
        _signal_group(pgid, signal.SIGKILL)
        proc.wait(self.stop_timeout)
        deadline = time.monotonic() + self.stop_timeout
        while (left := _live_group_members(pgid)):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {left} of the vLLM server's group {pgid} are still running "
                                   f"{self.stop_timeout:g} s after SIGKILL")
            time.sleep(0.01)

    def __enter__(self) -> VLLMServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def _live_group_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` still running (a zombie holds no memory; its parent or init reaps it).

    Reads ``/proc`` where there is one; elsewhere any group member, zombie or not, counts (``killpg(pgid, 0)``).
    """
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return []
        return [pgid]
    live = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended while we looked
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):  # zombie, or dead and being removed
            live.append(int(stat.parent.name))
    return live


def _signal_group(pid: int, sig: int) -> None:
    """Signal the process group led by ``pid`` (the server was started as a session leader)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
