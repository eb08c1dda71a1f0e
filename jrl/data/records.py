"""The raw records of a :class:`~jrl.data.config.DataConfig` source (:func:`load_records`): a built-in task, a
JSONL / JSON / Parquet file, a ``datasets.save_to_disk`` directory or a hub dataset id, as a list of dicts in source
order, with errors that name the file, the line and the fix."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jrl.data.config import BUILTIN_PREFIX, SUPPORTED_EXTENSIONS, DataConfig, is_hub_id
from jrl.data.tasks import BUILTIN_TASKS

def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}: line {lineno} is not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r}); "
                                 "re-encode the file as UTF-8 or remove that line") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(
                    f"{path}: line {lineno} is a JSON {type(row).__name__}, expected an object (one record per line)"
                )
            rows.append(row)
    return rows


def _read_json(path: Path) -> list[dict]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line} is not UTF-8; re-encode the file as UTF-8") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg.startswith("Extra data"):  # JSON lines in a .json file, as datasets accepts
            return _read_jsonl(path)
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict) and data and all(isinstance(v, list) for v in data.values()):
        lengths = {len(v) for v in data.values()}
        if len(lengths) != 1:
            raise ValueError(f"{path}: column-oriented JSON with columns of different lengths {sorted(lengths)}")
        keys = list(data)
        return [dict(zip(keys, vals)) for vals in zip(*data.values())]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ValueError(
            f"{path}: expected a JSON list of objects (one per record), JSON lines, or an object of equal-length column lists"
        )
    return data


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    return pq.read_table(path).to_pylist()


def _read_saved_dataset(path: Path, split: str | None) -> list[dict]:
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    if not any((path / m).exists() for m in markers):
        raise ValueError(
            f"{path} is a directory but not one written by datasets' save_to_disk (none of {list(markers)} in it); "
            f"point DataConfig.source at a .jsonl/.json/.parquet file or a save_to_disk directory"
        )
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"reading the save_to_disk directory {path} needs the datasets package: pip install datasets"
        ) from None
    return _pick_split(datasets.load_from_disk(str(path)), path, split).to_list()


#: A Hugging Face Hub dataset id: ``name`` or ``owner/name``.
def _read_hub_dataset(source: str, split: str | None, hub_config: str | None) -> list[dict]:
    import datasets

    try:
        ds = datasets.load_dataset(source, hub_config)
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        raise FileNotFoundError(
            f"DataConfig.source={source!r} is neither a local file or directory nor a Hugging Face dataset that "
            f"could be downloaded or found in the local cache ({datasets.config.HF_DATASETS_CACHE}): "
            f"{type(e).__name__}: {e}. Download it once where the hub is reachable (python -c \"import datasets; "
            f"datasets.load_dataset('{source}')\"), or point source at a .jsonl/.json/.parquet file") from None
    except ValueError as e:  # an unknown configuration name, or one needed
        raise ValueError(f"DataConfig.source={source!r}: {e} (set DataConfig.hub_config)") from None
    return _pick_split(ds, source, split).to_list()


def _pick_split(ds, where, split: str | None):
    """The ``split`` of a ``DatasetDict`` (default ``train``, or the only one), or a lone ``Dataset``."""
    import datasets

    if not isinstance(ds, datasets.DatasetDict):
        if split is not None:
            raise ValueError(f"DataConfig.split={split!r} given, but {where} holds a single Dataset, not a "
                             "DatasetDict; drop split")
        return ds
    splits = list(ds)
    if split is None:
        if "train" in ds:
            split = "train"
        elif len(splits) == 1:
            split = splits[0]
        else:
            raise ValueError(f"{where} holds the splits {splits}; choose one with DataConfig.split")
    if split not in ds:
        raise ValueError(f"DataConfig.split={split!r} is not in {where}; its splits are {splits}")
    return ds[split]


def load_records(cfg: DataConfig) -> list[dict[str, Any]]:
    """The raw records of ``cfg.source`` (a list of dicts, in source order; not truncated)."""
    src = cfg.source
    if src.startswith(BUILTIN_PREFIX):
        name = src[len(BUILTIN_PREFIX) :]
        module = importlib.import_module(BUILTIN_TASKS[name])
        if name == "arithmetic":
            return module.generate_arithmetic(cfg.arithmetic)
        raise NotImplementedError(f"built-in task {name!r} has no loader")  # pragma: no cover
    path = Path(os.path.expanduser(src))
    if is_hub_id(src):
        return _read_hub_dataset(src, cfg.split, cfg.hub_config)
    if not path.exists():
        raise FileNotFoundError(
            f"DataConfig.source: dataset path {str(path)!r} does not exist (resolved: {path.resolve()})"
        )
    if path.is_dir():
        return _read_saved_dataset(path, cfg.split)
    ext = path.suffix.lower()
    if cfg.split is not None:
        raise ValueError(
            f"DataConfig.split={cfg.split!r} only applies to a save_to_disk DatasetDict directory, not {path}"
        )
    if ext == ".jsonl":
        return _read_jsonl(path)
    if ext == ".json":
        return _read_json(path)
    if ext == ".parquet":
        return _read_parquet(path)
    raise ValueError(
        f"DataConfig.source: unsupported file extension {ext or '(none)'!r} of {str(path)!r}; "
        f"supported: {', '.join(SUPPORTED_EXTENSIONS)}, or a datasets.save_to_disk directory"
    )


def _columns_of(records: Sequence[dict]) -> list[str]:
    seen: dict[str, None] = {}
    for r in records:
        for k in r:
            seen.setdefault(k, None)
    return list(seen)


