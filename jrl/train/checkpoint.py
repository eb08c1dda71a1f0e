"""Training checkpoints with orbax: trainable params, optimizer state and a JSON of everything else.

Layout: ``<output_dir>/checkpoints/<step>/{params,opt_state,meta}``. ``meta`` holds the step, the
optimizer update count, the data-loader state (:meth:`jrl.data.PromptLoader.get_state`), the seed
and the model and LoRA settings (written by :meth:`jrl.train.trainer.Trainer.save`).

Atomicity: orbax writes each step into a temporary directory and renames it into place when it is
complete, and :meth:`CheckpointManager.latest_step` only lists finalised steps; a crash mid-save
leaves the previous checkpoint as the latest.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


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
        """Write checkpoint ``step`` and wait until it is finalised on disk."""
        self.manager.save(step, args=ocp.args.Composite(
            params=ocp.args.StandardSave(params),
            opt_state=ocp.args.StandardSave(opt_state),
            meta=ocp.args.JsonSave(meta)))
        self.manager.wait_until_finished()

    def restore(self, params_like: Any, opt_state_like: Any, step: int | None = None):
        """(params, opt_state, meta) of ``step`` (default: the latest), placed like the given trees."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}; run without --resume to start fresh")

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
