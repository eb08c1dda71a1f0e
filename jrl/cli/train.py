"""Train with GRPO or EBFT from a Python config file, with command-line overrides.

    python scripts/train.py --config configs/grpo.py [--max-steps 3] [--output-dir runs/x]
                            [--rollout.temperature 0.8] [--resume] ...
    python scripts/train.py --config configs/ebft.py          # EBFT structured mode
    python scripts/train.py --config configs/ebft_strided.py  # EBFT strided mode
    python scripts/train.py --config configs/grpo.py --help     # every field, with its documentation
    python scripts/train.py --config configs/grpo.py --mode train    # trainer fed by explorer processes
    python scripts/train.py --config configs/grpo.py --mode explore  # one explorer (= jrl explore)

``--config FILE`` names a Python file defining ``config()`` that returns a ``jrl.train.TrainConfig``;
the remaining arguments override its fields (tyro, dotted names for nested sections). ``--algorithm``
picks the training method (``grpo``, ``ebft_structured``, ``ebft_strided``).
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
from pathlib import Path
from typing import Annotated

def parse_config(argv: list[str]):
    """(TrainConfig) from ``--config FILE`` plus tyro overrides in ``argv``; ``--algorithm`` (or the file's) picks the
    type of the ``algo`` section, so its flags are that algorithm's."""
    import tyro

    from jrl.train.algorithms import ALGORITHMS
    from jrl.train.config import TrainConfig, load_config_file

    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, rest = pre.parse_known_args(argv)
    picked = argparse.ArgumentParser(add_help=False)
    picked.add_argument("--algorithm", default=None)
    algorithm = picked.parse_known_args(rest)[0].algorithm
    default = load_config_file(known.config) if known.config else TrainConfig()
    if algorithm in ALGORITHMS and algorithm != default.algorithm:
        default = _switched(default, algorithm, ALGORITHMS.get(algorithm).config_type)
    own = ALGORITHMS.get(default.algorithm).config_type
    section = own if own is not None else Annotated[type(None), tyro.conf.Suppress]
    name = Path(sys.argv[0]).name  # train.py, explore.py, or "jrl train" / "jrl explore" (jrl.cli)
    prog = f"{name} --config {known.config}" if known.config else name
    return tyro.cli(TrainConfig[section], default=default, args=rest, prog=prog,
                    description=f"GRPO or EBFT training (--algorithm {' | '.join(ALGORITHMS.names())}). "
                                "Pass --config FILE (a Python file with config()) first.")


def _switched(cfg, algorithm: str, own: type | None):
    """``cfg`` with ``algorithm`` and an ``algo`` section of that algorithm's type (its defaults unless ``cfg``'s is
    one): the unchecked starting point of the overrides; tyro builds (and checks) the final config from it."""
    draft = copy.copy(cfg)
    object.__setattr__(draft, "algorithm", algorithm)
    if own is None or not isinstance(cfg.algo, own):
        object.__setattr__(draft, "algo", None if own is None else own())
    return draft


def summary(cfg, history: list[dict]) -> str:
    """The closing line of a run: steps logged, the algorithm's ``summary_keys`` of the last step (those it logged),
    and where the log and the plot are."""
    from jrl.train.algorithms import ALGORITHMS

    keys = ALGORITHMS.get(cfg.algorithm).summary_keys
    last = history[-1]
    values = ", ".join(f"{k} {last[k]:.4f}" for k in keys if last.get(k) is not None)
    return (f"done: {len(history)} steps logged in {cfg.output_dir}/metrics.jsonl; "
            + (f"last {values}; " if values else "") + f"plot {cfg.output_dir}/curves.png")


def exit_if_peers_lost(watch, error: Exception) -> None:
    """When ``error`` came from a process of the run that died (the collective this one waited in failed), say
    which one and exit 1 at once, instead of a traceback and a wait for the dead process at shutdown. A user's error
    this process raised itself (a setting several processes cannot run: every process stops on it) is told as such,
    exit 2, also at once."""
    from jrl.errors import describe, is_expected

    lost = watch.lost()
    if not lost:
        return
    if is_expected(error):
        print(f"error: {describe(error)}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(2)
    first = (str(error).strip().splitlines() or [""])[0][:300]
    logging.getLogger("jrl").error(
        "lost process %s of %d (it stopped answering: killed, out of memory, or its host is gone), so this run "
        "cannot go on; restart every process with --resume to continue from the last checkpoint. (%s: %s)",
        ", ".join(map(str, lost)), watch.count, type(error).__name__, first)
    logging.shutdown()
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse_config(argv)
    from jrl.sharding import initialize, is_main_process, launched_processes
    from jrl.sharding.liveness import PeerWatch

    launched = launched_processes()
    if launched is not None:
        from jrl.train.trainer import check_processes

        # Before joining: a setting every process refuses ends each one alone, not in JAX's distributed shutdown.
        check_processes(cfg, launched)
    multi = initialize()  # joins a multi-host run (TPU pod, JRL_* variables); a no-op for one process
    import jax

    main_process = is_main_process()
    prefix = f"[process {jax.process_index()}] " if multi else ""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {prefix}%(name)s: %(message)s")
    logging.getLogger("jrl").setLevel(logging.INFO if main_process else logging.WARNING)
    if cfg.mode == "explore":
        from jrl.train.exploration import explore

        explore(cfg)
        return 0
    from jrl.train.trainer import train

    watch = PeerWatch()  # does nothing with one process
    try:
        history = train(cfg)
    except Exception as e:  # noqa: BLE001 - a dead peer is told apart from any other error
        exit_if_peers_lost(watch, e)
        raise
    watch.close()
    if history and main_process:
        print(summary(cfg, history))
    return 0


if __name__ == "__main__":
    sys.exit(main())
