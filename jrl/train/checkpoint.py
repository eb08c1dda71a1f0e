"""Training checkpoints with orbax: trainable params, optimizer state and a JSON of everything else.

Layout: ``<output_dir>/checkpoints/<step>/{params,opt_state,meta}``. ``meta`` holds the step, the
optimizer update count, the data-loader state (:meth:`jrl.data.PromptLoader.get_state`), the seed
and the model and LoRA settings (written by :meth:`jrl.train.trainer.Trainer.save`).

Atomicity: orbax writes each step into a temporary directory and renames it into place when it is
complete, and :meth:`CheckpointManager.latest_step` only lists finalised steps; a crash mid-save
leaves the previous checkpoint as the latest; a checkpoint that would not fit on the disk is refused before it is
written, and a failed write's temporary directory is removed. A finalised checkpoint damaged later (a truncated file) is
caught when it is restored: :meth:`TrainCheckpointer.restore` then falls back to the next older one.

Several processes save and restore together (every process calls :meth:`TrainCheckpointer.save` and
:meth:`TrainCheckpointer.restore`; orbax writes each array's shards from the process that holds them, and process 0
the metadata); the directory must be one they all see (a shared file system or a bucket). A checkpoint is a set of
global arrays, so a run of another process count or mesh restores it.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jrl.errors import DiskFullError, UserError, free_bytes
from jrl.sharding import barrier, is_main_process

logger = logging.getLogger(__name__)


class CheckpointRestoreError(UserError, RuntimeError):
    """No checkpoint restores (damaged, or from a run with other model / LoRA settings)."""


def _nbytes(tree: Any) -> int:
    """Bytes of every array in ``tree`` (global arrays: their whole size)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree) if hasattr(x, "shape"))


def _one_line(error: Exception, limit: int = 240) -> str:
    """The first line of ``error``'s message with its type, at most ``limit`` characters."""
    message = str(error).strip()
    text = f"{type(error).__name__}: {message.splitlines()[0] if message else ''}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class TrainCheckpointer:
    """Save / restore :class:`~jrl.train.learner.Learner` state plus a JSON ``meta`` dict."""

    def __init__(self, directory: str | Path, *, max_to_keep: int = 2):
        self.directory = Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("params", "opt_state", "meta"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, params: Any, opt_state: Any, meta: dict[str, Any]) -> None:
        """Write checkpoint ``step`` and wait until it is finalised on disk.

        A checkpoint that does not fit on the disk raises :class:`jrl.errors.DiskFullError` before anything is
        written (the arrays' bytes against the free space); a write that fails anyway leaves no partial directory
        behind. Either way the previous checkpoint stays the latest."""
        needed = _nbytes((params, opt_state)) + len(json.dumps(meta))
        needed += max(2**20, needed // 50)  # the writer's metadata and file-system blocks
        free = free_bytes(self.directory)
        if free is not None and needed > free:
            raise DiskFullError(self.directory, needed, f"checkpoint {step}", after=self._previous_note())
        try:
            self.manager.save(step, args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
                meta=ocp.args.JsonSave(meta)))
            self.manager.wait_until_finished()
        except Exception as e:
            self._discard_partial(step)
            if "No space left on device" in str(e) or getattr(e, "errno", None) == errno.ENOSPC:
                raise DiskFullError(self.directory, needed, f"checkpoint {step}", after=self._previous_note()) from e
            raise

    def _previous_note(self) -> str:
        latest = self.latest_step()
        if latest is None:
            return "; no earlier checkpoint exists"
        return f"; checkpoint {latest} is intact and --resume continues from it"

    def _discard_partial(self, step: int) -> None:
        """Remove what a failed save of ``step`` left (orbax's temporary directories of that step)."""
        if is_main_process():
            for partial in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(partial, ignore_errors=True)
        barrier(f"jrl-checkpoint-discarded-{step}")

    def restore(self, params_like: Any, opt_state_like: Any, step: int | None = None):
        """(params, opt_state, meta) of ``step``, placed like the given trees. Without ``step``: the newest
        checkpoint that restores; each newer one that does not (a truncated or missing file) is named in a
        one-line warning with what is wrong and moved aside. When none restores nothing is moved and the
        error lists every checkpoint's reason."""
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}; run without --resume to start fresh")
        if step is not None and step not in steps:
            raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}; it holds steps "
                                    f"{sorted(steps)}")
        failed: list[tuple[int, str]] = []
        for candidate in [step] if step is not None else steps:
            try:
                restored = self._restore(candidate, params_like, opt_state_like)
            except Exception as e:  # whatever orbax / tensorstore raise on a damaged file
                reason = _one_line(e)
                if step is not None:
                    raise CheckpointRestoreError(f"checkpoint {step} in {self.directory} is damaged: {reason}") from e
                failed.append((candidate, reason))
                continue
            # An older checkpoint restores, so the newer ones are damaged (not a mismatch with this run's
            # config, which would fail them all): move them out of the way of the steps the run writes again.
            for bad, reason in failed:
                logger.warning("checkpoint %d is damaged (%s); moved to %s, resuming from checkpoint %d", bad,
                               reason, self._move_aside(bad), candidate)
            return restored
        raise CheckpointRestoreError(
            f"no checkpoint in {self.directory} restores (a damaged file, or a run whose model / LoRA settings differ "
            "from the checkpoint's): " + "; ".join(f"{s} ({r})" for s, r in failed))

    def _move_aside(self, step: int) -> Path:
        """Rename the damaged checkpoint ``step`` to ``damaged-<step>[-n]`` (kept for inspection, out of the
        way of the step the resumed run will write again)."""
        target = self.directory / f"damaged-{step}"
        n = 1
        while target.exists():
            target, n = self.directory / f"damaged-{step}-{n}", n + 1
        if is_main_process():
            (self.directory / str(step)).rename(target)
        barrier(f"jrl-checkpoint-moved-{step}")
        self.manager.reload()
        return target

    def _restore(self, step: int, params_like: Any, opt_state_like: Any):
        def abstract(tree):
            return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)

        out = self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract(params_like)),
            opt_state=ocp.args.StandardRestore(abstract(opt_state_like)),
            meta=ocp.args.JsonRestore()))
        return out["params"], out["opt_state"], out["meta"]

    def restore_params(self, params_like: Any, step: int | None = None) -> Any:
        """Only the trainable params of ``step`` (default: the latest), e.g. for export."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, params_like)
        return self.manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract)))["params"]

    def restore_meta(self, step: int | None = None) -> dict[str, Any]:
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def close(self) -> None:
        self.manager.close()
