"""Export a training checkpoint as a Hugging Face model directory (LoRA merged into the weights) or,
for a LoRA run, as a PEFT adapter directory."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from jrl.models import from_pretrained, save_pretrained
from jrl.models.lora import LoraConfig, apply_lora, merge_lora, trainable_params
from jrl.models.peft import save_peft_adapter
from jrl.train.checkpoint import TrainCheckpointer


def _checkpoint_dir(path: Path) -> tuple[Path, int | None]:
    """(orbax manager directory, step or None for the latest) from a run dir, its ``checkpoints``
    dir, or one step's dir."""
    if (path / "checkpoints").is_dir():
        return path / "checkpoints", None
    if path.name.isdigit() and (path / "params").exists():
        return path.parent, int(path.name)
    return path, None


#: Written into every export directory; a directory holding it may be exported into again.
EXPORT_MARKER = ".jrl-export"


def check_export_target(out_dir: Path, *, overwrite: bool) -> None:
    """Refuse a non-empty ``out_dir`` that is not an earlier export (it would be replaced, with whatever a user
    keeps there) unless ``overwrite``."""
    if overwrite or not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise FileExistsError(f"export target {str(out_dir)!r} is a file; choose a directory path")
    entries = sorted(p.name for p in out_dir.iterdir())
    if entries and EXPORT_MARKER not in entries:
        shown = ", ".join(entries[:5]) + (" ..." if len(entries) > 5 else "")
        raise FileExistsError(f"export target {str(out_dir)!r} is not empty and not an earlier export (it holds "
                              f"{shown}); exporting would replace it. Choose an empty or new directory, or pass "
                              "--overwrite to replace it")


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, *, adapter_only: bool = False,
                      dtype: str | None = None, overwrite: bool = False) -> Path:
    """Write the checkpoint's model to ``out_dir`` (HF safetensors + config + tokenizer of the base).

    ``checkpoint`` is a run's ``output_dir``, its ``checkpoints`` directory or one step inside it.
    A LoRA run is merged (``W + s·A@B``), or with ``adapter_only`` written as a PEFT adapter directory
    (``adapter_config.json`` + ``adapter_model.safetensors``, ``dtype`` default bfloat16) for the base
    model the run started from. A non-empty ``out_dir`` that is not an earlier export is refused unless
    ``overwrite`` (:func:`check_export_target`).
    """
    out_dir = Path(out_dir)
    check_export_target(out_dir, overwrite=overwrite)
    directory, step = _checkpoint_dir(Path(checkpoint))
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint {str(checkpoint)!r} does not exist")
    ckpt = TrainCheckpointer(directory)
    try:
        meta = ckpt.restore_meta(step)
        spec = meta["model"]
        model = from_pretrained(spec["path"], dtype=spec["dtype"], param_dtype=spec["param_dtype"])
        lora = None if meta.get("lora") is None else LoraConfig(**meta["lora"])
        if adapter_only and lora is None:
            raise ValueError(f"--adapter-only: the checkpoint {str(checkpoint)!r} is from a full fine-tuning run "
                             f"(no LoRA adapters); export it without --adapter-only")
        if lora is not None:
            apply_lora(model, lora, seed=meta["seed"])
        params = ckpt.restore_params(nnx.state(model, trainable_params(model)), step)
        nnx.update(model, params)
    finally:
        ckpt.close()
    if adapter_only:
        out = save_peft_adapter(model, out_dir, dtype=dtype or "bfloat16", base_model_name_or_path=spec["path"],
                                config=lora)
    else:
        if lora is not None:
            model = merge_lora(model)
        out = save_pretrained(model, out_dir, dtype=None if dtype is None else jnp.dtype(dtype), source_dir=spec["path"])
    (Path(out) / EXPORT_MARKER).write_text(f"exported from {Path(checkpoint).resolve()}\n")
    return Path(out)
