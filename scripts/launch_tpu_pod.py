#!/usr/bin/env python3
"""Run the same jrl command on every worker of a Cloud TPU pod slice.

Each worker runs ``cd WORKDIR && ENV... PYTHON scripts/train.py ARGS`` through
``gcloud compute tpus tpu-vm ssh NAME --zone ZONE --worker=all --command ...``; inside,
``jrl.sharding.initialize()`` finds the other workers by itself (JAX's TPU cluster detection), so
the training script is the one you run on a laptop, with a pod-sized ``--mesh``.

Examples::

    # what would run (prints the gcloud commands, runs nothing)
    python scripts/launch_tpu_pod.py --name my-v5p-64 --zone us-east5-a --project my-proj --dry-run \\
        -- --config configs/grpo.py --mesh.fsdp -1

    # copy this checkout to every worker, install it, then train
    python scripts/launch_tpu_pod.py --name my-v5p-64 --zone us-east5-a --sync --setup \\
        --env WANDB_API_KEY --env JRL_LOG_LEVEL=info -- --config configs/grpo.py

Everything after ``--`` is passed to the script unchanged. Uses only the standard library.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from collections.abc import Sequence

DEFAULT_SETUP = "python3 -m pip install -q -e '.[tpu]'"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="launch_tpu_pod.py",
        description="Run scripts/train.py (or another script) on every worker of a TPU pod slice via gcloud.",
        epilog="Arguments after '--' go to the script unchanged.",
    )
    p.add_argument("--name", required=True, help="TPU VM (pod slice) name")
    p.add_argument("--zone", required=True, help="zone of the TPU, e.g. us-central2-b")
    p.add_argument("--project", default=None, help="GCP project (default: gcloud's configured project)")
    p.add_argument("--worker", default="all", help="worker(s) to run on: 'all' (default), or e.g. '0' or '0,1'")
    p.add_argument("--workdir", default="~/jrl", help="directory of the jrl checkout on the workers (default ~/jrl)")
    p.add_argument("--script", default="scripts/train.py", help="script to run, relative to --workdir")
    p.add_argument("--python", default="python3", help="python executable on the workers (e.g. a venv's)")
    p.add_argument(
        "--env", action="append", default=[], metavar="NAME[=VALUE]",
        help="environment variable for the remote command; NAME alone passes this machine's value through "
             "(repeatable)",
    )
    p.add_argument("--sync", action="store_true",
                   help="first copy the local checkout (--source) to --workdir on every worker with "
                        "'gcloud compute tpus tpu-vm scp --recurse'")
    p.add_argument("--source", default=".", help="local checkout copied by --sync (default: current directory)")
    p.add_argument("--setup", nargs="?", const=DEFAULT_SETUP, default=None, metavar="CMD",
                   help=f"run CMD in --workdir on every worker before the script (bare --setup: {DEFAULT_SETUP!r})")
    p.add_argument("--log-dir", default=None,
                   help="also write each worker's output to LOG_DIR/worker-$(hostname).log on that worker")
    p.add_argument("--internal-ip", action="store_true", help="ssh over internal IPs (launching from inside the VPC)")
    p.add_argument("--ssh-flag", action="append", default=[],
                   help="extra flag passed to gcloud as --ssh-flag (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the gcloud commands instead of running them")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script (after '--')")
    return p


def _env_assignments(specs: Sequence[str], environ: dict[str, str]) -> list[str]:
    out = []
    for spec in specs:
        name, sep, value = spec.partition("=")
        if not name.isidentifier():
            raise SystemExit(f"--env {spec!r}: {name!r} is not a valid environment variable name")
        if not sep:
            if name not in environ:
                raise SystemExit(
                    f"--env {name}: not set here, so there is nothing to pass through; use --env {name}=VALUE")
            value = environ[name]
        out.append(f"{name}={shlex.quote(value)}")
    return out


def _cd(workdir: str) -> str:
    # Leave a leading ~ unquoted so the remote shell expands it.
    if workdir == "~" or workdir.startswith("~/"):
        return "cd ~" + (shlex.quote(workdir[1:]) if len(workdir) > 1 else "")
    return "cd " + shlex.quote(workdir)


def remote_command(args: argparse.Namespace, environ: dict[str, str] | None = None) -> str:
    """The shell command every worker runs."""
    environ = dict(os.environ) if environ is None else environ
    script_args = list(args.script_args)
    if script_args and script_args[0] == "--":
        script_args = script_args[1:]
    env = _env_assignments(args.env, environ)
    run = " ".join([*env, shlex.quote(args.python), shlex.quote(args.script), *map(shlex.quote, script_args)])
    if args.log_dir:
        log_dir = args.log_dir if args.log_dir.startswith("~") else shlex.quote(args.log_dir)
        run = f"mkdir -p {log_dir} && {run} 2>&1 | tee {log_dir}/worker-$(hostname).log; exit ${{PIPESTATUS[0]}}"
    steps = [_cd(args.workdir)]
    if args.setup:
        steps.append(args.setup)
    steps.append(run)
    return " && ".join(steps)


def _gcloud_common(args: argparse.Namespace) -> list[str]:
    common = ["--zone", args.zone, f"--worker={args.worker}"]
    if args.project:
        common += ["--project", args.project]
    if args.internal_ip:
        common.append("--internal-ip")
    return common


#: Not copied by --sync (nor any hidden entry): environments, caches and run outputs of this machine.
SYNC_EXCLUDE = {".git", ".venv", ".vllm-venv", "__pycache__", ".pytest_cache", ".hypothesis", "runs", "build",
                ".whl", "jrl.egg-info"}


def sync_sources(source: str) -> list[str]:
    """The top-level entries of ``source`` that --sync copies (sorted; see :data:`SYNC_EXCLUDE`)."""
    if not os.path.isdir(source):
        raise SystemExit(f"--source {source!r} is not a directory")
    entries = sorted(
        e for e in os.listdir(source) if e not in SYNC_EXCLUDE and not e.startswith(".") and not e.endswith(".egg-info")
    )
    if not entries:
        raise SystemExit(f"--source {source!r}: nothing to copy")
    return [os.path.join(source, e) for e in entries]


def _remote_path(workdir: str, quote: bool = False) -> str:
    # scp and a remote shell both start in the home directory: drop a leading "~/".
    path = workdir[2:] if workdir.startswith("~/") else ("." if workdir == "~" else workdir)
    return shlex.quote(path) if quote else path


def gcloud_commands(args: argparse.Namespace, environ: dict[str, str] | None = None) -> list[list[str]]:
    """The gcloud invocations, in order (optional sync, then the run)."""
    cmds = []
    if args.sync:
        cmds.append(["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.name, *_gcloud_common(args),
                     "--command", f"mkdir -p {_remote_path(args.workdir, quote=True)}"])
        sources = sync_sources(args.source)
        cmds.append(["gcloud", "compute", "tpus", "tpu-vm", "scp", "--recurse", *sources,
                     f"{args.name}:{_remote_path(args.workdir)}", *_gcloud_common(args)])
    ssh = ["gcloud", "compute", "tpus", "tpu-vm", "ssh", args.name, *_gcloud_common(args)]
    for flag in args.ssh_flag:
        ssh.append(f"--ssh-flag={flag}")
    ssh += ["--command", remote_command(args, environ)]
    cmds.append(ssh)
    return cmds


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cmds = gcloud_commands(args)
    for cmd in cmds:
        if args.dry_run:
            print(shlex.join(cmd))
            continue
        print("+ " + shlex.join(cmd), file=sys.stderr, flush=True)
        rc = subprocess.call(cmd)
        if rc:
            print(f"launch_tpu_pod: command failed with exit code {rc}", file=sys.stderr)
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
