"""scripts/launch_tpu_pod.py --dry-run prints the gcloud commands it would run."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "launch_tpu_pod.py"


def launch(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO,
                          env=env, timeout=60)


def test_dry_run_runs_train_on_every_worker():
    proc = launch("--name", "my-v5p-64", "--zone", "us-east5-a", "--project", "proj", "--dry-run",
                  "--", "--config", "configs/grpo.py", "--mesh.fsdp", "-1", "--run-name", "a b")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    argv = shlex.split(lines[0])
    assert argv[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-v5p-64"]
    assert argv[argv.index("--zone") + 1] == "us-east5-a"
    assert argv[argv.index("--project") + 1] == "proj"
    assert "--worker=all" in argv
    remote = argv[argv.index("--command") + 1]
    assert remote.startswith("cd ~/jrl && ")
    # The remote command re-parses to exactly the script and its arguments.
    assert shlex.split(remote.split(" && ")[-1]) == [
        "python3", "scripts/train.py", "--config", "configs/grpo.py", "--mesh.fsdp", "-1", "--run-name", "a b"]


def test_dry_run_env_sync_setup_and_logs(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "MY_TOKEN": "s3cr et"}
    (tmp_path / "jrl").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / ".venv").mkdir()
    proc = launch("--name", "pod", "--zone", "z", "--workdir", "/opt/jrl", "--python", "/opt/venv/bin/python",
                  "--env", "MY_TOKEN", "--env", "JRL_LOG=info", "--sync", "--source", str(tmp_path), "--setup",
                  "--log-dir", "/tmp/jrl-logs", "--worker", "0", "--dry-run", "--", "--config", "c.py", env=env)
    assert proc.returncode == 0, proc.stderr
    mkdir, scp, run = (shlex.split(line) for line in proc.stdout.strip().splitlines())
    assert mkdir[-2:] == ["--command", "mkdir -p /opt/jrl"]
    assert scp[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse"]
    assert scp[6:8] == [str(tmp_path / "jrl"), str(tmp_path / "pyproject.toml")]  # .venv is not copied
    assert scp[8] == "pod:/opt/jrl" and "--worker=0" in scp
    remote = run[run.index("--command") + 1]
    assert remote.startswith("cd /opt/jrl && python3 -m pip install")
    assert "MY_TOKEN='s3cr et' JRL_LOG=info /opt/venv/bin/python scripts/train.py --config c.py" in remote
    assert "tee /tmp/jrl-logs/worker-$(hostname).log" in remote
    assert "--project" not in run


def test_env_passthrough_of_unset_variable_fails_clearly():
    proc = launch("--name", "pod", "--zone", "z", "--env", "JRL_SURELY_UNSET_VAR", "--dry-run",
                  env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0
    assert "JRL_SURELY_UNSET_VAR: not set here" in proc.stderr


def test_help_lists_the_options():
    proc = launch("--help")
    assert proc.returncode == 0
    for opt in ("--name", "--zone", "--project", "--workdir", "--env", "--dry-run", "--sync", "--setup"):
        assert opt in proc.stdout
