"""Shared by the learning benchmarks (``grpo_default.py``, ``ebft_curves.py``): run a training config once per
seed as its own ``scripts/train.py`` process, read its ``metrics.jsonl``, compare first and last steps, and
plot smoothed curves."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
#: Steps averaged at each end of a run, and the moving-mean width of the plots.
WINDOW = 10


def run_seed(config: Path, seed: int, out: Path, *, max_steps: int | None = None,
             extra: tuple[str, ...] | list[str] = ()) -> tuple[list[dict], float]:
    """(metrics.jsonl rows, wall seconds) of ``scripts/train.py --config CONFIG --seed S --data.seed S``
    in ``out/seed{S}`` (``extra`` arguments appended)."""
    run_dir = out / f"seed{seed}"
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), "--config", str(config), "--seed", str(seed),
           "--data.seed", str(seed), "--output-dir", str(run_dir), "--overwrite"]
    if max_steps is not None:
        cmd += ["--max-steps", str(max_steps)]
    cmd += list(extra)
    print(f"# seed {seed}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return rows, wall


def first_last(rows: list[dict], key: str) -> tuple[float, float]:
    """Means of ``key`` over the first and the last ``WINDOW`` steps."""
    values = np.array([r[key] for r in rows], dtype=np.float64)
    if len(values) < 2 * WINDOW:
        raise ValueError(f"{len(values)} steps logged; need at least {2 * WINDOW} for first/last-{WINDOW} means")
    return float(values[:WINDOW].mean()), float(values[-WINDOW:].mean())


def plot(curves: dict[int, list[dict]], keys: list[str], path: Path, title: str | None = None) -> None:
    """One panel per metric in ``keys``, one ``WINDOW``-step moving-mean line per seed, saved to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4))
    axes = np.atleast_1d(axes)
    for seed, rows in curves.items():
        steps = np.array([r["step"] for r in rows])
        for ax, key in zip(axes, keys):
            y = np.array([r[key] for r in rows], dtype=np.float64)
            smooth = np.convolve(y, np.ones(WINDOW) / WINDOW, mode="valid")
            ax.plot(steps[WINDOW - 1:], smooth, label=f"seed {seed}")
            ax.set_title(f"{key} ({WINDOW}-step moving mean)")
            ax.set_xlabel("step")
    axes[0].legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
