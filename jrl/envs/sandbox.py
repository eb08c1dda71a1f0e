"""Run untrusted Python (a model's tool call) in a child process with limits: wall time, CPU time, memory, output
size, no network, files written only under a fresh temporary directory, no child processes; the process group is
killed on any limit.

Layers, each a test in ``tests/envs/test_sandbox.py``:

- the child runs ``python -I`` (no site, no user paths, no ``PYTHON*`` variables) with an empty environment, in a new
  session (its whole process group is killed at the wall-time limit);
- ``setrlimit``: address space (``memory_mb``), CPU seconds, size of any file it writes;
- a new network namespace where the kernel allows one (root, or unprivileged user namespaces): no interface but a
  down loopback;
- an audit hook installed before the code runs (it cannot be removed from Python): opening a file for writing outside
  the temporary directory, removing or renaming files there, sockets, ``subprocess``/``os.system``/``fork``/``exec``
  and ``ctypes`` raise ``PermissionError``.

It is a guard against a model's mistakes and casual escapes in RL rollouts, not a boundary for hostile code: run
those in a container or a VM.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

#: The child's prelude: reads the job (code and limits, JSON on stdin), sets the limits, leaves the network namespace
#: where it may, installs the audit hook, then runs the code.
_PRELUDE = r'''
import ctypes, json, os, resource, sys
_job = json.loads(sys.stdin.read())
for _name, _value in _job["limits"].items():
    resource.setrlimit(getattr(resource, _name), (_value, _value))
_libc = ctypes.CDLL(None, use_errno=True) if _job["isolate_network"] else None
_job["network_isolated"] = _libc is not None and (_libc.unshare(0x40000000) == 0
                                                  or _libc.unshare(0x10000000 | 0x40000000) == 0)
_root = os.path.realpath(os.getcwd())
_blocked = {"socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo", "subprocess.Popen",
            "os.system", "os.fork", "os.forkpty", "os.posix_spawn", "os.exec", "os.spawn", "os.kill", "os.killpg",
            "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "pty.spawn", "os.putenv", "os.unsetenv"}
_paths = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
          "os.truncate", "os.utime", "shutil.rmtree", "shutil.copyfile", "shutil.move"}
_write = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
def _inside(path):
    try:
        p = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return p == _root or p.startswith(_root + os.sep)
def _hook(event, args):
    if event in _blocked:
        raise PermissionError("sandbox: %s is not allowed" % event)
    if event == "open":
        path, mode, flags = args
        writing = (mode is not None and any(c in mode for c in "wax+")) or bool(flags & _write)
        if writing and (isinstance(path, int) or not _inside(path)):
            raise PermissionError("sandbox: writing %r outside the working directory" % (path,))
    elif event in _paths:
        if not all(_inside(a) for a in args if isinstance(a, (str, bytes, os.PathLike))):
            raise PermissionError("sandbox: %s outside the working directory" % event)
    elif event == "os.chdir" and not _inside(args[0]):
        raise PermissionError("sandbox: leaving the working directory")
if _job["report_isolation"]:
    print(json.dumps({"network_isolated": _job["network_isolated"]}))
_code = _job["code"]
del _job, _libc
sys.addaudithook(_hook)
exec(compile(_code, "<tool>", "exec"), {"__name__": "__main__"})
'''


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What a run gave: its stdout and stderr (each cut to ``max_output_bytes``), exit code (negative: killed by
    that signal), whether the wall-time limit killed it, and its wall seconds."""

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 512, cpu_s: int | None = None,
               file_mb: int = 16, max_output_bytes: int = 16384, isolate_network: bool = True,
               report_isolation: bool = False) -> SandboxResult:
    """Run ``code`` in a sandboxed child Python (module docstring) in a fresh temporary directory, removed after.
    ``report_isolation`` prints ``{"network_isolated": bool}`` as the first line of stdout (for tests)."""
    cpu = int(cpu_s if cpu_s is not None else math.ceil(timeout_s) + 1)  # the wall-time limit comes first
    with tempfile.TemporaryDirectory(prefix="jrl-sandbox-") as work:
        t0 = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-I", "-c", _PRELUDE], cwd=work, env={"PATH": "/usr/bin:/bin"},
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        job = dict(code=code, isolate_network=isolate_network, report_isolation=report_isolation,
                   limits=dict(RLIMIT_AS=memory_mb << 20, RLIMIT_CPU=cpu, RLIMIT_FSIZE=file_mb << 20, RLIMIT_CORE=0))
        timed_out = False
        try:
            out, err = proc.communicate(json.dumps(job).encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            out, err = proc.communicate()
        finally:
            _kill_group(proc)  # whatever it left behind in its group
        seconds = time.monotonic() - t0
    cut = lambda b: b[:max_output_bytes].decode("utf-8", "replace")  # noqa: E731
    return SandboxResult(cut(out), cut(err), proc.returncode, timed_out, seconds)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
