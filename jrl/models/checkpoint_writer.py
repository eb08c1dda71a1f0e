"""Writing a jrl :class:`~jrl.models.transformer.Transformer` as a Hugging Face checkpoint.

``save_pretrained`` writes config.json, safetensors shards (+ ``model.safetensors.index.json``) and the
tokenizer files of the source checkpoint into a temp directory that is renamed into place at the end
(:func:`atomic_replace`). The safetensors files are written by a small streaming writer
(:func:`write_safetensors`), so at most one parameter is on the host at a time.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jrl.models.checkpoint import (
    SAFE_INDEX,
    SAFE_WEIGHTS,
    SAFETENSORS_DTYPES,
    TOKENIZER_FILES,
    TensorEntry,
    export_entries,
    np_dtype,
    progress_bar,
    save_dtype_name,
)
from jrl.models.lora import has_lora
from jrl.models.transformer import Transformer, named_params
from jrl.sharding.placement import to_host


def parse_size(size: int | str) -> int:
    """Bytes from ``5GB`` (10^9), ``500MiB`` (2^20), ``"123"`` or an int."""
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "TB": 10**12, "B": 1}
    for unit, mult in units.items():
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    return int(s)


@functools.cache
def _hf_layout_fn(transform, experts: bool, layer: bool, dtype: str):
    """Jitted jrl -> HF layout + cast, run where the parameter lives (transposes are fast on device):
    ``fn(value, index)`` takes layer ``index`` of a stacked-layer value first (``layer``), and maps the
    transform over the experts of a stacked-expert one (``experts``)."""
    fn = jax.vmap(transform.to_hf) if experts else transform.to_hf

    def run(x, index):
        if layer:
            x = jax.lax.dynamic_index_in_dim(x, index, keepdims=False)
        return fn(x).astype(dtype)

    return jax.jit(run)


def write_safetensors(file: Path, tensors: list[tuple[str, tuple[int, ...], str]], arrays: Iterator[np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Stream a safetensors file: header from (name, shape, dtype name) first, then each array in order.

    ``arrays`` yields C-contiguous numpy arrays matching ``tensors`` one at a time.
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape, dtype in tensors:
        n = math.prod(shape) * np_dtype(dtype).itemsize
        header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for (name, shape, dtype), arr in zip(tensors, arrays, strict=True):
            if arr.shape != tuple(shape) or arr.dtype != np_dtype(dtype):
                raise ValueError(f"{name}: got {arr.shape} {arr.dtype}, header says {shape} {dtype}")
            np.ascontiguousarray(arr).tofile(f)


def _hf_config_dict(model: Transformer, save_dtype: str, source_dir: Path | None) -> dict:
    out = model.config.to_hf(dtype=save_dtype)
    if source_dir is not None and (source_dir / "config.json").is_file():
        src = json.loads((source_dir / "config.json").read_text())
        if src.get("model_type") == out["model_type"]:
            # Keep fields jrl does not model (initializer ranges, window sizes, ...); jrl's own fields win.
            src.pop("torch_dtype", None)
            out = {**src, **out}
    return out


def save_pretrained(model: Transformer, out_dir: str | os.PathLike, *, max_shard_size: int | str = "5GB",
                    dtype=None, source_dir: str | os.PathLike | None = None, progress: bool | None = None) -> Path:
    """Write ``model`` as a Hugging Face checkpoint directory that ``AutoModelForCausalLM.from_pretrained`` loads.

    Writes config.json, ``model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards plus
    ``model.safetensors.index.json`` when larger than ``max_shard_size``) in ``dtype`` (default: the parameter
    dtype) and copies the tokenizer files of ``source_dir`` (default: the directory the model was loaded
    from). Everything is written to a temp directory beside ``out_dir`` and renamed into place, so a crash
    never leaves a half-written ``out_dir``. Only process 0 writes in a multi-host run. Returns ``out_dir``.
    """
    if has_lora(model):
        raise ValueError("save_pretrained: the model has LoRA adapters, which a Hugging Face checkpoint does not hold; "
                         "merge them first (jrl.models.merge_lora) or write them as a PEFT adapter "
                         "(jrl.models.save_peft_adapter)")
    out_dir = Path(out_dir)
    cfg = model.config
    save_dtype = save_dtype_name(dtype or cfg.param_dtype, "save_pretrained")
    target = np_dtype(save_dtype)
    src = source_dir if source_dir is not None else getattr(model, "source_dir", None)
    src = Path(src) if src else None
    params = named_params(model)
    entries = export_entries(cfg, params)
    specs = [(e.hf_key, e.hf_shape(params[e.jrl_path].shape)) for e in entries]
    sizes = [math.prod(s) * target.itemsize for _, s in specs]
    # Greedy sharding, as transformers: start a new shard when the next tensor would overflow.
    limit = parse_size(max_shard_size)
    shards: list[list[int]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        if shards[-1] and used + n > limit:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += n
    names = ([SAFE_WEIGHTS] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    writer = jax.process_index() == 0
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    if writer:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    cache: dict[tuple, np.ndarray] = {}

    def host_value(e: TensorEntry) -> np.ndarray:
        """The parameter of ``e`` in HF layout and the save dtype, on the host (one parameter cached)."""
        key = (e.unit, e.rule)
        if key not in cache:
            cache.clear()  # entries are grouped by parameter and layer: keep one gathered unit at a time
            fn = _hf_layout_fn(e.rule.transform, e.expert is not None, e.layer is not None, save_dtype)
            cache[key] = to_host(fn(params[e.jrl_path].get_value(), e.layer or 0))
        return cache[key]

    def arrays(idx: list[int], bar) -> Iterator[np.ndarray]:
        for i in idx:
            e = entries[i]
            value = host_value(e)
            yield value if e.expert is None else value[e.expert]
            if bar is not None:
                bar.update(1)

    try:
        with progress_bar(sum(sizes), len(entries), progress, f"saving {out_dir.name}") as bar:
            for name, idx in zip(names, shards, strict=True):
                tensors = [(specs[i][0], specs[i][1], save_dtype) for i in idx]
                if writer:
                    write_safetensors(tmp / name, tensors, arrays(idx, bar))
                else:  # still take part in the gathers
                    for _ in arrays(idx, bar):
                        pass
        cache.clear()
        if writer:
            if len(shards) > 1:
                index = {"metadata": {"total_size": sum(sizes)},
                         "weight_map": {specs[i][0]: names[s] for s, idx in enumerate(shards) for i in idx}}
                (tmp / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            (tmp / "config.json").write_text(json.dumps(_hf_config_dict(model, save_dtype, src), indent=2) + "\n")
            if src is not None:
                for fname in TOKENIZER_FILES:
                    if (src / fname).is_file():
                        shutil.copy2(src / fname, tmp / fname)
            atomic_replace(tmp, out_dir)
    except BaseException:
        if writer:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def atomic_replace(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``; an existing ``out_dir`` is moved aside first and removed after."""
    old = None
    if out_dir.exists():
        old = out_dir.parent / f".{out_dir.name}.old-{time.time_ns()}"
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
