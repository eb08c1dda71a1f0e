"""Run observability: ``metrics.jsonl``, TensorBoard events (tensorboardX), optional Weights & Biases logging and
the final reward/loss plot.

In a run of several processes every process computes the same metrics and only the main one (process 0) writes
files: a :class:`MetricsWriter` built elsewhere keeps its records in memory.
"""

from __future__ import annotations

import html
import json
import math
import shutil
from pathlib import Path
from typing import Any

from jrl.sharding import is_main_process
from jrl.train.wandb_config import WandbConfig  # noqa: F401 (public name)

RUN_OUTPUTS = ("metrics.jsonl", "eval.jsonl", "eval_samples.jsonl", "tensorboard", "wandb", "curves.png",
               "checkpoints", "experience.jsonl", "published", "explorers", "experience.db", "experience.db-wal",
               "experience.db-shm")


class WandbSink:
    """The W&B run of a training run: scalars per step, text (sample tables) as HTML."""

    def __init__(self, cfg: WandbConfig, output_dir: str | Path, run_config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ImportError("WandbConfig.project is set but the wandb package is not installed: pip install wandb "
                              "(or jrl[wandb]), or leave wandb.project unset") from None
        self._wandb = wandb
        self.run = wandb.init(project=cfg.project, entity=cfg.entity, name=cfg.name or Path(output_dir).resolve().name,
                              mode=cfg.mode, dir=str(output_dir), config=run_config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log({k: float(v) for k, v in metrics.items() if math.isfinite(float(v))}, step=int(step))

    def text(self, tag: str, text: str, step: int) -> None:
        self.run.log({tag: self._wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=int(step))

    def close(self) -> None:
        self.run.finish()


def claim_output_dir(output_dir: str | Path, *, overwrite: bool) -> None:
    """Make sure a fresh run does not mix with an earlier one in ``output_dir``.

    An earlier run's outputs are an error (nothing is deleted by surprise) unless ``overwrite`` is set,
    in which case they are removed.
    """
    out = Path(output_dir)
    found = [name for name in RUN_OUTPUTS if (out / name).exists()]
    if not found:
        return
    if not overwrite:
        raise FileExistsError(
            f"output_dir {out} already holds a run ({', '.join(found)}); pass --resume to continue it, "
            "--overwrite to start afresh there (deleting it), or choose another --output-dir")
    for name in found:
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def _json_number(value) -> float | None:
    """``value`` as a float, or None where strict JSON has no number (NaN, ±inf)."""
    value = float(value)
    return value if math.isfinite(value) else None


def truncate_jsonl_after(path: Path, step: int) -> None:
    """Drop the lines of a JSON-lines log whose ``step`` is > ``step`` (written after the checkpoint a resumed run
    restarts from)."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    path.write_text("".join(ln + "\n" for ln in lines))


class MetricsWriter:
    """Append one JSON object per step to ``<dir>/<name>.jsonl`` and the same scalars to TensorBoard
    (``<dir>/tensorboard``, a ``name`` other than ``metrics`` in its own subdirectory, a run of its own there) and
    to ``wandb`` when given (the caller closes it). On a process other than the main one it writes nothing and
    :meth:`history` holds the records written since it was built."""

    def __init__(self, output_dir: str | Path, *, name: str = "metrics", tensorboard: bool = True,
                 wandb: WandbSink | None = None):
        self.wandb = wandb
        self.dir = Path(output_dir)
        self.path = self.dir / f"{name}.jsonl"
        self._tb = None
        self._records: list[dict] | None = None if is_main_process() else []
        if self._records is not None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard" / ("" if name == "metrics" else name)))

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps > ``step`` (written after the checkpoint a resumed run restarts from)."""
        if self._records is None:
            truncate_jsonl_after(self.path, step)

    def write_text(self, tag: str, text: str, step: int) -> None:
        """A Markdown text (e.g. a table of sample completions) to TensorBoard's text tab."""
        if self._tb is not None:
            self._tb.add_text(tag, text, int(step))
            self._tb.flush()
        if self.wandb is not None:
            self.wandb.text(tag, text, step)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """One line of strict JSON (a NaN or infinite value is written as null) and the finite scalars to
        TensorBoard."""
        record = {"step": int(step), **{k: _json_number(v) for k, v in metrics.items()}}
        if self._records is not None:
            self._records.append(record)
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record, allow_nan=False) + "\n")
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(float(v)):
                    self._tb.add_scalar(k, float(v), int(step))
            self._tb.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step)

    def history(self) -> list[dict]:
        if self._records is not None:
            return list(self._records)
        if not self.path.exists():
            return []
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def smooth(values: list[float]) -> list[float]:
    """An exponential moving average of ``values`` with a span of about a tenth of them (2 to 50 points),
    bias-corrected so that the first points are not pulled towards 0."""
    span = min(50, max(2, len(values) // 10))
    alpha, avg, weight, out = 2.0 / (span + 1), 0.0, 0.0, []
    for v in values:
        avg, weight = (1 - alpha) * avg + alpha * v, (1 - alpha) * weight + alpha
        out.append(avg / weight)
    return out


def plot_curves(history: list[dict], out_file: str | Path, keys: tuple[str, ...] = ("reward/mean", "loss"), *,
                eval_history: list[dict] = (), best_reward: float | None = None) -> Path:
    """A PNG with one panel per metric in ``keys`` against ``step``: each step's value as faint points under a smoothed
    line (:func:`smooth`); a panel of the held-out ``eval/<decoding>/reward/mean`` when ``eval_history`` has any; the
    reward's best possible value (``best_reward``, see :func:`jrl.rewards.functions.best_total`) as a dashed line on the
    reward panels. matplotlib, Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eval_keys = sorted({k for h in eval_history for k in h if k.startswith("eval/") and k.endswith("/reward/mean")})
    panels = [*keys, *(["eval"] if eval_keys else [])]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "eval":
            for k in eval_keys:
                pts = [(h["step"], h[k]) for h in eval_history if h.get(k) is not None]
                ax.plot(*zip(*pts), marker="o", label=k.split("/")[1])
            ax.legend(loc="best", fontsize="small")
            ax.set_title("held-out reward/mean")
        else:
            pts = [(h["step"], h[key]) for h in history if h.get(key) is not None]
            if pts:
                steps, values = zip(*pts)
                ax.plot(steps, values, ".", color="tab:blue", alpha=0.25, markersize=4)
                ax.plot(steps, smooth(list(values)), color="tab:blue", linewidth=1.8)
            ax.set_title(key)
        if best_reward is not None and (key == "eval" or key.startswith("reward/mean")):
            ax.axhline(best_reward, color="tab:green", linestyle="--", linewidth=1)
            ax.annotate(f"best {best_reward:g}", (0.01, best_reward), xycoords=("axes fraction", "data"),
                        va="bottom", fontsize="small", color="tab:green")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_file = Path(out_file)
    fig.savefig(out_file, dpi=100)
    plt.close(fig)
    return out_file
