"""Versioned weights a trainer publishes for its explorer processes (``mode='train'`` / ``'explore'``).

Layout of ``explore.weights_dir``::

    v00000012/weights.safetensors   # the trainable weights after 12 steps (the LoRA adapters, or every param)
    v00000012/meta.json             # {"version": 12, "lora": true, "tensors": 24, "run": "<RUN>"}
    RUN                             # a random id of the run, made when a trainer starts afresh
    FINISHED                        # the last version, once the run is done

A version appears whole or not at all: it is written to a hidden directory and renamed into place. The trainer
keeps the newest ``keep`` versions; an explorer that finds the version it chose deleted before it read it takes the
newest again. Tensors are named by their path in the model's state (``layers.0.attn.q_proj.lora_a``), so a model
built from the same config (the explorer's) takes them back with :func:`load_weights`. The run id tells an explorer
that a trainer has started a new run in the same directory (its versions are not the ones it was exploring for).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from jrl.models.checkpoint_writer import atomic_replace
from jrl.models.lora import trainable_params
from jrl.sharding import is_main_process
from jrl.sharding.placement import iter_to_host, path_str

_VERSION = re.compile(r"v(\d{8})")
FINISHED = "FINISHED"
RUN = "RUN"


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{int(version):08d}"


def published_versions(root: str | Path) -> list[int]:
    """The complete versions in ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _VERSION.fullmatch(p.name)))


def finished_version(root: str | Path) -> int | None:
    """The last version of a finished run, or None while it runs."""
    path = Path(root) / FINISHED
    return int(path.read_text()) if path.exists() else None


def trainable(model: nnx.Module):
    """(graphdef, trainable state, the rest) of ``model``: its LoRA adapters when it has them, else every param
    (the learner's split)."""
    return nnx.split(model, trainable_params(model), ...)


class WeightPublisher:
    """The trainer's side: :meth:`publish` after sync steps, :meth:`finish` at the end. Every process of the
    trainer calls them (gathering a sharded tensor is a collective); process 0 writes."""

    def __init__(self, root: str | Path, *, keep: int):
        self.root, self.keep = Path(root), int(keep)

    def reset(self) -> None:
        """A fresh run: no versions, not finished, a new run id."""
        if is_main_process():
            shutil.rmtree(self.root, ignore_errors=True)
            self.root.mkdir(parents=True)
            _write_atomic(self.root / RUN, uuid.uuid4().hex)

    def run_id(self) -> str:
        """The run id (made now when a resumed run's directory has none)."""
        path = self.root / RUN
        if not path.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            _write_atomic(path, uuid.uuid4().hex)
        return path.read_text()

    def publish(self, params, version: int, *, lora: bool) -> Path:
        """Write the trainable ``params`` (an ``nnx.State``) as ``version``; delete all but the newest ``keep``."""
        from safetensors.numpy import save_file

        tensors = dict(iter_to_host(params))  # every process gathers, in the same order
        final = version_dir(self.root, version)
        if not is_main_process():
            return final
        tmp = self.root / f".{final.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / "weights.safetensors"))
            (tmp / "meta.json").write_text(json.dumps({"version": int(version), "lora": bool(lora),
                                                       "tensors": len(tensors), "run": self.run_id()}))
            atomic_replace(tmp, final)  # a resumed run publishes a restored version again: the old one is replaced
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (self.root / FINISHED).unlink(missing_ok=True)
        for old in published_versions(self.root)[:-self.keep]:
            shutil.rmtree(version_dir(self.root, old), ignore_errors=True)
        return final

    def withdraw_after(self, version: int) -> None:
        """Delete the versions after ``version`` (published by a run that crashed before its next checkpoint)."""
        if is_main_process():
            for later in published_versions(self.root):
                if later > version:
                    shutil.rmtree(version_dir(self.root, later), ignore_errors=True)

    def finish(self, version: int) -> None:
        """Mark the run done at ``version`` (explorers exit when they see it)."""
        if is_main_process():
            _write_atomic(self.root / FINISHED, str(int(version)))


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_meta(root: str | Path, version: int) -> dict:
    """``meta.json`` of ``version`` (``FileNotFoundError`` when it was deleted meanwhile)."""
    return json.loads((version_dir(Path(root), version) / "meta.json").read_text())


def read_weights(root: str | Path, version: int) -> dict[str, np.ndarray]:
    """The tensors of ``version`` (``FileNotFoundError`` when it was deleted meanwhile)."""
    from safetensors.numpy import load_file

    return load_file(str(version_dir(Path(root), version) / "weights.safetensors"))


def load_weights(model: nnx.Module, tensors: dict[str, np.ndarray], *, where: str) -> nnx.Module:
    """``model`` with its trainable weights replaced by ``tensors`` (placed like the ones they replace); an error
    naming the difference when they are not this model's (another model or LoRA config)."""
    graphdef, state, rest = trainable(model)
    paths = {path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(state)}
    if set(paths) != set(tensors):
        missing, extra = sorted(set(paths) - set(tensors)), sorted(set(tensors) - set(paths))
        raise ValueError(f"the weights in {where} do not fit this model (missing {missing[:3]}, unexpected "
                         f"{extra[:3]}): start the explorer with the trainer's config (model.path, lora)")

    def put(path, x):
        new = tensors[path_str(path)]
        if new.shape != x.shape:
            raise ValueError(f"the weights in {where}: {path_str(path)} has shape {new.shape}, this model "
                             f"{x.shape}; start the explorer with the trainer's config")
        return jax.device_put(new.astype(x.dtype), x.sharding)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(put, state), rest)
