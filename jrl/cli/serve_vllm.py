"""Start the vLLM server a jrl config's ``vllm`` rollout backend talks to, with the flags it needs.

    python scripts/serve_vllm.py --config configs/grpo.py --device cpu [--rollout.vllm.python PY]
        [lora:lora-config --lora.rank 16] [--server-index I] [--dry-run]

Prints the command (and the environment it adds) first. The server serves ``model.path`` on the host and
port of ``rollout.vllm.base_urls[I]`` (``--server-index``, default 0; start one per listed server) with:
``--enable-lora --max-lora-rank R --max-loras K`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` for a LoRA run (K = ``rollout.vllm.keep_versions`` or
``rollout.max_staleness + 1``), ``VLLM_SERVER_DEV_MODE=1`` (the prefix-cache reset and full-weight reload
routes exist only in that mode: keep the port private), ``--logprobs-mode
processed_logprobs``, ``--max-model-len``, ``--dtype``, and on CPU ``VLLM_CPU_KVCACHE_SPACE``. It runs
until Ctrl-C (or SIGTERM), then stops the server by its process id. Every other argument is a tyro override of the
config (``--help`` lists them).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import signal
import sys
from pathlib import Path


def parse(argv: list[str]):
    """(TrainConfig, options) from ``--config FILE``, ``--device``, ``--dry-run``, ``--log-file`` plus tyro
    overrides of the config in ``argv``."""
    import tyro

    from jrl.train.config import TrainConfig, load_config_file

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    pre.add_argument("--device", choices=("cpu", "gpu"), default=None,
                     help="where the server runs (default: rollout.vllm.device)")
    pre.add_argument("--server-index", type=int, default=0,
                     help="serve on the address of rollout.vllm.base_urls[I] (default 0)")
    pre.add_argument("--dry-run", action="store_true", help="print the command and exit")
    pre.add_argument("--log-file", default=None, help="write the server's output there (default: this terminal)")
    opts, rest = pre.parse_known_args(argv)
    default = load_config_file(opts.config) if opts.config else TrainConfig()
    # The server is for the run's ``vllm`` backend, whatever backend the file names (its rollout.vllm flags apply).
    default = dataclasses.replace(default, rollout=dataclasses.replace(default.rollout, backend="vllm"))
    prog = "serve_vllm.py --config " + opts.config if opts.config else "serve_vllm.py"
    cfg = tyro.cli(TrainConfig, default=default, args=rest, prog=prog,
                   description="Start a vLLM server for a jrl config. Also: --device cpu|gpu, --dry-run, --log-file.")
    if opts.device is not None:
        vllm = dataclasses.replace(cfg.rollout.vllm, device=opts.device)
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, vllm=vllm))
    return cfg, opts


def command_for(cfg, index: int = 0) -> tuple[list[str], dict[str, str]]:
    """The server command of a TrainConfig (see the module docstring)."""
    from jrl.rollout.vllm_server import server_command
    from jrl.rollout.weight_sync import resolve_transport

    r = cfg.rollout
    keep = r.vllm.keep_versions if r.vllm.keep_versions is not None else r.max_staleness + 1
    transport = resolve_transport(r.sync, lora=cfg.lora is not None,
                                  moe_lora=cfg.lora is not None and bool(cfg.lora.target_parameters))
    return server_command(r.vllm, model=cfg.model.path, lora_rank=cfg.lora.rank if transport == "lora" else None,
                          max_loras=keep, index=index)


def check_model(cfg) -> None:
    """Refuse what the trainer would refuse of this server before starting it: a MoE ``model.path`` (its
    config.json, when it is a local directory) on a CPU server."""
    from jrl.models import read_config
    from jrl.rollout.vllm_engine import refuse_cpu_moe

    if cfg.rollout.vllm.device == "cpu" and (Path(cfg.model.path) / "config.json").is_file():
        refuse_cpu_moe("cpu", read_config(cfg.model.path))


def main(argv: list[str] | None = None) -> int:
    cfg, opts = parse(sys.argv[1:] if argv is None else argv)
    try:
        check_model(cfg)
    except ValueError as e:
        print(f"serve_vllm: {e}", file=sys.stderr)
        return 2
    argv_server, env = command_for(cfg, opts.server_index)
    url = cfg.rollout.vllm.base_urls[opts.server_index]
    print(" ".join([f"{k}={shlex.quote(v)}" for k, v in sorted(env.items())] + [shlex.quote(a) for a in argv_server]),
          flush=True)
    if opts.dry_run:
        return 0
    from jrl.rollout.vllm_server import VLLMServer

    server = VLLMServer(argv_server, env, base_url=url, log_file=opts.log_file,
                        startup_timeout=cfg.rollout.vllm.startup_timeout)

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for sig in (signal.SIGINT, signal.SIGTERM):  # also when started without a terminal (SIGINT ignored)
        signal.signal(sig, interrupt)
    try:
        server.start()
        print(f"vLLM server ready at {url} (pid {server.pid}); Ctrl-C stops it", flush=True)
        server.process.wait()
        print(f"the vLLM server exited with code {server.process.returncode}", flush=True)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
