"""Prompt data pipeline: records -> rendered, tokenized prompts -> deterministic grain batches.

Flow (:func:`make_prompt_loader`)::

    load_records(cfg)                    # builtin task, JSONL/JSON, Parquet, datasets.save_to_disk dir
      -> first cfg.max_examples rows
      -> render (chat template through the tokenizer, or plain text) and tokenize
      -> drop prompts longer than cfg.max_prompt_length tokens (counted and logged)
      -> grain.MapDataset: shard -> shuffle(seed) -> repeat(num_epochs) -> batch(prompts_per_batch)
      -> PromptLoader (iterator of PromptBatch, with get_state / set_state)

Every record is loaded and tokenized once, eagerly, so the filter counts are exact and the dataset
length is known; this suits prompt datasets (up to a few hundred thousand rows) that fit in host
memory.

Determinism: the batch sequence is a pure function of the data, the tokenizer and the config
(``seed``, ``shuffle``, ``num_epochs``, ``prompts_per_batch``, ``drop_remainder``, shard). Each epoch
is reshuffled with a seed derived from ``seed`` (grain's ``reseed_each_epoch``).
:meth:`PromptLoader.get_state` returns a small JSON-serialisable dict; a fresh loader built from
the same inputs and given that state by :meth:`PromptLoader.set_state` yields exactly the batches
the saved one would have yielded next.

Padding is the trainer's job; :func:`left_pad` is a helper that returns ``(ids, mask)`` arrays.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from jrl.data.tasks import BUILTIN_TASKS
from jrl.data.tasks.arithmetic import ArithmeticConfig
from jrl.validation import check_int, invalid

logger = logging.getLogger(__name__)

BUILTIN_PREFIX = "builtin:"
#: File extensions the loader reads (a directory is read with ``datasets.load_from_disk``).
SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")
#: Version of the dict returned by :meth:`PromptLoader.get_state`.
STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where prompts come from, how they are formatted, and how they are batched."""

    source: str = "builtin:arithmetic"
    """``builtin:arithmetic`` (generated, see ``arithmetic``), a path to a ``.jsonl`` / ``.json``
    file (a list of objects, or JSON lines), a ``.parquet`` file, a directory written by
    ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, or a Hugging Face Hub dataset id
    (``owner/name``, loaded by ``datasets.load_dataset``: downloaded once, then read from the local cache;
    with ``HF_HUB_OFFLINE=1`` only the cache is asked)."""
    split: str | None = None
    """Split to read from a saved ``DatasetDict`` directory or a hub dataset (default: ``train``, or the only
    split); set for a file or a built-in task, an error."""
    hub_config: str | None = None
    """Configuration (subset) of a hub dataset, e.g. ``main`` for ``openai/gsm8k``; only for hub ids."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string, or a list of ``{"role", "content"}`` chat messages
    (the latter needs ``use_chat_template``). Every column is kept and passed to the rewards."""
    use_chat_template: bool = True
    """Render prompts with the tokenizer's chat template (a string prompt becomes one user turn)
    and ``add_generation_prompt=True``; if false the prompt string is tokenized as plain text
    with the tokenizer's default special tokens (a BOS for jrl's byte tokenizer)."""
    system_prompt: str | None = None
    """System turn put in front of every prompt that does not start with one (chat template only)."""
    max_prompt_length: int | None = 256
    """Drop prompts longer than this many tokens (after the chat template); counted and logged.
    ``None`` keeps every prompt."""
    max_examples: int | None = None
    """Use only the first this-many records of the source (before filtering); ``None`` = all."""
    shuffle: bool = True
    """Shuffle the prompts (deterministically, from ``seed``), reshuffled every epoch."""
    seed: int = 0
    """Seed of the shuffle."""
    num_epochs: int | None = None
    """Passes over the data; ``None`` repeats forever (the trainer stops by step count)."""
    prompts_per_batch: int = 8
    """Prompts (not completions) per batch; the trainer samples several completions per prompt."""
    drop_remainder: bool = True
    """Drop the last, smaller batch of a finite run so every batch has ``prompts_per_batch``."""
    arithmetic: ArithmeticConfig = dataclasses.field(default_factory=ArithmeticConfig)
    """Options of ``builtin:arithmetic`` (set for another source, an error)."""

    def __post_init__(self):
        if not isinstance(self.source, str) or not self.source.strip():
            raise invalid("DataConfig", "source", self.source,
                          "give 'builtin:<task>' or a path to a .jsonl/.json/.parquet file or a save_to_disk dir")
        builtin = self.source.startswith(BUILTIN_PREFIX)
        if builtin:
            name = self.source[len(BUILTIN_PREFIX) :]
            if name not in BUILTIN_TASKS:
                raise invalid("DataConfig", "source", self.source,
                              f"unknown built-in task {name!r}; built-in tasks: {sorted(BUILTIN_TASKS)}")
        elif self.arithmetic != ArithmeticConfig():
            raise invalid("DataConfig", "arithmetic", self.arithmetic,
                          f"it configures source='builtin:arithmetic' and source={self.source!r} does not read it")
        if self.split is not None and (builtin or Path(self.source).suffix.lower() in SUPPORTED_EXTENSIONS):
            raise invalid("DataConfig", "split", self.split,
                          f"it picks a split of a saved DatasetDict directory or a hub dataset; source={self.source!r} "
                          "has none")
        if self.hub_config is not None and (builtin or not is_hub_id(self.source)):
            raise invalid("DataConfig", "hub_config", self.hub_config,
                          f"it picks a configuration of a hub dataset (source='owner/name'); source={self.source!r} "
                          "is not one")
        if not isinstance(self.prompt_column, str) or not self.prompt_column:
            raise invalid("DataConfig", "prompt_column", self.prompt_column,
                          "give the name of the column holding the prompts")
        if self.system_prompt is not None and not self.use_chat_template:
            raise invalid("DataConfig", "system_prompt", self.system_prompt,
                          "a system prompt needs use_chat_template=True (or drop it)")
        check_int(self, "max_prompt_length", lo=1, optional=True, fix="use a positive int, or None for no limit")
        check_int(self, "max_examples", lo=1, optional=True, fix="use a positive int, or None for all records")
        check_int(self, "seed", lo=-2**63, fix="use an int")
        check_int(self, "num_epochs", lo=1, optional=True, fix="use a positive int, or None to repeat forever")
        check_int(self, "prompts_per_batch", lo=1)


# ---------------------------------------------------------------------------------------------
# Reading records


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
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_hub_id(source: str) -> bool:
    """Whether ``source`` reads as a hub dataset id (``owner/name``) rather than a file: no supported file
    extension, no leading ``.``/``/``/``~``, and nothing on disk by that name."""
    return (_HUB_ID.fullmatch(source) is not None and Path(source).suffix.lower() not in SUPPORTED_EXTENSIONS
            and not Path(os.path.expanduser(source)).exists())


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


# ---------------------------------------------------------------------------------------------
# Rendering and tokenizing


def render_prompt(prompt: Any, cfg: DataConfig, tokenizer, *, row: int | None = None) -> str:
    """Text of one prompt: through the chat template (with the generation prompt) or as is."""
    where = f"row {row}" if row is not None else "prompt"
    if cfg.use_chat_template:
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, (list, tuple)) and all(
            isinstance(m, dict) and "role" in m and "content" in m for m in prompt
        ):
            messages = [dict(m) for m in prompt]
            if not messages:
                raise ValueError(f"{where}: column {cfg.prompt_column!r} holds an empty message list")
        else:
            raise ValueError(
                f"{where}: column {cfg.prompt_column!r} must hold a string or a list of {{'role', 'content'}} "
                f"messages, got {type(prompt).__name__}: {prompt!r:.100}"
            )
        if cfg.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": cfg.system_prompt})
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:
            raise ValueError(f"{where}: the tokenizer's chat template failed: {type(e).__name__}: {e}") from e
        return text
    if not isinstance(prompt, str):
        raise ValueError(
            f"{where}: column {cfg.prompt_column!r} holds {type(prompt).__name__}, but use_chat_template=False needs "
            f"plain-text prompts; set use_chat_template=True for chat messages"
        )
    return prompt


@dataclasses.dataclass
class PromptDataset:
    """Loaded, rendered, tokenized and length-filtered prompts (in source order)."""

    columns: dict[str, list]
    """Every raw dataset column (including the prompt column), one value per kept prompt."""
    prompt_texts: list[str]
    """Prompt text fed to the tokenizer (after the chat template)."""
    prompt_ids: list[list[int]]
    """Token ids of each prompt."""
    source_rows: list[int]
    """Row of each kept prompt in the source."""
    num_loaded: int
    """Records read (after ``max_examples``), before filtering."""
    num_filtered: int
    """Prompts dropped by ``max_prompt_length``."""
    prompt_column: str

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def batch(self, idx: Sequence[int]) -> PromptBatch:
        """The prompts at dataset indices ``idx`` as one :class:`PromptBatch`."""
        idx = [int(i) for i in idx]
        return PromptBatch(
            prompt_ids=[list(self.prompt_ids[i]) for i in idx],
            prompt_texts=[self.prompt_texts[i] for i in idx],
            prompts=[self.columns[self.prompt_column][i] for i in idx],
            columns={k: [v[i] for i in idx] for k, v in self.columns.items()},
            indices=idx,
        )

    def hold_out(self, n: int) -> tuple[PromptDataset, PromptDataset]:
        """(the first ``len - n`` prompts, the last ``n``): a training set and a held-out set that share no row."""
        if not 0 < n < len(self):
            raise ValueError(f"cannot hold out {n} of the {len(self)} prompts: keep at least one for training")

        def part(sl: slice) -> PromptDataset:
            return dataclasses.replace(self, columns={k: v[sl] for k, v in self.columns.items()},
                                       prompt_texts=self.prompt_texts[sl], prompt_ids=self.prompt_ids[sl],
                                       source_rows=self.source_rows[sl])

        return part(slice(0, len(self) - n)), part(slice(len(self) - n, None))

    @functools.cached_property
    def fingerprint(self) -> str:
        """SHA-256 of the tokenized prompts and their order (identifies the data for resumption)."""
        h = hashlib.sha256()
        for p in self.prompt_ids:
            h.update(len(p).to_bytes(8, "little"))
            h.update(np.asarray(p, dtype=np.int64).tobytes())
        return h.hexdigest()


def build_prompt_dataset(cfg: DataConfig, tokenizer) -> PromptDataset:
    """Load ``cfg.source``, render and tokenize every prompt, drop over-long ones."""
    records = load_records(cfg)
    if cfg.max_examples is not None:
        records = records[: cfg.max_examples]
    if not records:
        raise ValueError(f"DataConfig.source {cfg.source!r} holds no records")
    names = _columns_of(records)
    if cfg.prompt_column not in names:
        raise ValueError(
            f"DataConfig.prompt_column={cfg.prompt_column!r} is not a column of {cfg.source!r}; available columns: {names}"
        )
    missing = [i for i, r in enumerate(records) if r.get(cfg.prompt_column) is None]
    if missing:
        raise ValueError(
            f"{cfg.source!r}: {len(missing)} record(s) have no value in prompt column {cfg.prompt_column!r} "
            f"(first rows: {missing[:5]})"
        )
    if cfg.use_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "DataConfig.use_chat_template=True but the tokenizer has no chat template; "
            "set use_chat_template=False or use a tokenizer with one"
        )
    texts = [render_prompt(r[cfg.prompt_column], cfg, tokenizer, row=i) for i, r in enumerate(records)]
    # A chat template writes its own special tokens (BOS); plain text gets the tokenizer's defaults.
    ids = tokenizer(texts, add_special_tokens=not cfg.use_chat_template)["input_ids"]
    ids = [list(map(int, x)) for x in ids]

    keep = list(range(len(records)))
    num_filtered = 0
    if cfg.max_prompt_length is not None:
        keep = [i for i in keep if len(ids[i]) <= cfg.max_prompt_length]
        num_filtered = len(records) - len(keep)
        if num_filtered:
            dropped = [i for i in range(len(records)) if len(ids[i]) > cfg.max_prompt_length]
            logger.warning(
                "jrl.data: dropped %d of %d prompts longer than max_prompt_length=%d tokens (longest %d; first rows %s)",
                num_filtered,
                len(records),
                cfg.max_prompt_length,
                max(len(ids[i]) for i in dropped),
                dropped[:5],
            )
        if not keep:
            raise ValueError(
                f"every one of the {len(records)} prompts of {cfg.source!r} is longer than "
                f"DataConfig.max_prompt_length={cfg.max_prompt_length} tokens (shortest: {min(map(len, ids))}); raise it"
            )
    columns = {c: [records[i].get(c) for i in keep] for c in names}
    return PromptDataset(
        columns=columns,
        prompt_texts=[texts[i] for i in keep],
        prompt_ids=[ids[i] for i in keep],
        source_rows=keep,
        num_loaded=len(records),
        num_filtered=num_filtered,
        prompt_column=cfg.prompt_column,
    )


# ---------------------------------------------------------------------------------------------
# Batches


def left_pad(
    seqs: Sequence[Sequence[int]], pad_id: int, *, length: int | None = None, multiple_of: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Left-pad token id lists into ``(ids int32 [B, L], mask int32 [B, L])``.

    ``L`` is ``length`` if given (an error if a sequence is longer), else the longest sequence
    rounded up to a multiple of ``multiple_of``. ``mask`` is 1 on real tokens, 0 on padding.
    """
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}")
    longest = max((len(s) for s in seqs), default=0)
    if length is None:
        length = -(-longest // multiple_of) * multiple_of
    elif longest > length:
        raise ValueError(f"a sequence has {longest} tokens, more than length={length}")
    ids = np.full((len(seqs), length), pad_id, dtype=np.int32)
    mask = np.zeros((len(seqs), length), dtype=np.int32)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, length - len(s) :] = s
            mask[i, length - len(s) :] = 1
    return ids, mask


@dataclasses.dataclass
class PromptBatch:
    """One batch of prompts."""

    prompt_ids: list[list[int]]
    """Token ids of each prompt (unpadded)."""
    prompt_texts: list[str]
    """Rendered prompt text (what was tokenized)."""
    prompts: list
    """Raw values of the prompt column (what TRL-style rewards receive as ``prompts``)."""
    columns: dict[str, list]
    """Every raw dataset column, one value per prompt (the rewards' keyword arguments)."""
    indices: list[int]
    """Index of each prompt in the :class:`PromptDataset` (stable across runs)."""

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def left_pad(self, pad_id: int, *, length: int | None = None, multiple_of: int = 1):
        """``(ids, mask)`` of the prompts, left-padded (see :func:`left_pad`)."""
        return left_pad(self.prompt_ids, pad_id, length=length, multiple_of=multiple_of)

    def rows(self, sl: slice) -> PromptBatch:
        """The prompts ``sl`` of this batch."""
        return PromptBatch(prompt_ids=self.prompt_ids[sl], prompt_texts=self.prompt_texts[sl], prompts=self.prompts[sl],
                           columns={k: v[sl] for k, v in self.columns.items()}, indices=self.indices[sl])

    def with_last(self, other: PromptBatch) -> PromptBatch:
        """This batch with its last ``len(other)`` prompts replaced by ``other``'s (e.g. re-rolled prompts)."""
        n = len(other)
        if n > len(self):
            raise ValueError(f"cannot put {n} prompts in place of the last ones of a batch of {len(self)}")
        if set(other.columns) != set(self.columns):
            raise ValueError(f"the prompts put into the batch have columns {sorted(other.columns)}, the batch "
                             f"{sorted(self.columns)}")
        keep = len(self) - n
        return PromptBatch(
            prompt_ids=self.prompt_ids[:keep] + other.prompt_ids,
            prompt_texts=self.prompt_texts[:keep] + other.prompt_texts,
            prompts=self.prompts[:keep] + other.prompts,
            columns={k: v[:keep] + other.columns[k] for k, v in self.columns.items()},
            indices=self.indices[:keep] + other.indices,
        )

    def repeat(self, num_generations: int) -> PromptBatch:
        """Every prompt repeated ``num_generations`` times consecutively (one group per prompt),
        e.g. to line the columns up with the completions for the rewards."""
        g = int(num_generations)
        if g < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}")

        def rep(xs):
            return [x for x in xs for _ in range(g)]

        return PromptBatch(
            prompt_ids=rep(self.prompt_ids),
            prompt_texts=rep(self.prompt_texts),
            prompts=rep(self.prompts),
            columns={k: rep(v) for k, v in self.columns.items()},
            indices=rep(self.indices),
        )


class PromptLoader:
    """Iterator of :class:`PromptBatch` over a :class:`PromptDataset`, checkpointable.

    Built by :func:`make_prompt_loader`. ``get_state()`` / ``set_state(state)`` save and restore the
    position (a JSON-serialisable dict, also holding fingerprints of the data and the batching
    config so that a state is never applied to a different pipeline by mistake).
    """

    def __init__(self, dataset: PromptDataset, cfg: DataConfig, *, shard_index: int = 0, shard_count: int = 1):
        import grain

        if not (isinstance(shard_count, int) and shard_count >= 1 and 0 <= shard_index < shard_count):
            raise ValueError(
                f"need 0 <= shard_index < shard_count, got shard_index={shard_index}, shard_count={shard_count}"
            )
        self.dataset = dataset
        self.cfg = cfg
        self.shard_index = shard_index
        self.shard_count = shard_count
        ds = grain.MapDataset.range(len(dataset))
        if shard_count > 1:
            ds = ds.slice(slice(shard_index, None, shard_count))
        self.num_prompts = len(ds)
        if self.num_prompts == 0:
            raise ValueError(
                f"shard {shard_index} of {shard_count} is empty: the dataset has only {len(dataset)} prompts"
            )
        if (
            cfg.num_epochs is not None
            and cfg.drop_remainder
            and self.num_prompts * cfg.num_epochs < cfg.prompts_per_batch
        ):
            raise ValueError(
                f"{self.num_prompts} prompts x num_epochs={cfg.num_epochs} is fewer than DataConfig.prompts_per_batch="
                f"{cfg.prompts_per_batch}, so drop_remainder=True leaves no batch; lower prompts_per_batch or raise num_epochs"
            )
        if cfg.shuffle:
            ds = ds.shuffle(seed=cfg.seed)
        ds = ds.repeat(cfg.num_epochs)  # reseeds the shuffle each epoch
        ds = ds.batch(cfg.prompts_per_batch, drop_remainder=cfg.drop_remainder, batch_fn=self.dataset.batch)
        # No worker threads: batches are cheap list look-ups, and this keeps iteration deterministic.
        self._iter_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        self._it = iter(self._iter_ds)
        self._fingerprint = self._compute_fingerprint()

    @property
    def batches_per_epoch(self) -> int:
        """Full batches in one pass over this shard (the last partial one not counted)."""
        return self.num_prompts // self.cfg.prompts_per_batch

    def _compute_fingerprint(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "data": self.dataset.fingerprint,
            "pipeline": {
                "shuffle": c.shuffle,
                "seed": c.seed,
                "num_epochs": c.num_epochs,
                "prompts_per_batch": c.prompts_per_batch,
                "drop_remainder": c.drop_remainder,
                "shard_index": self.shard_index,
                "shard_count": self.shard_count,
            },
        }

    def __iter__(self):
        return self

    def __next__(self) -> PromptBatch:
        return next(self._it)

    def get_state(self) -> dict[str, Any]:
        """Position of the iterator, as a JSON-serialisable dict."""
        return {"version": STATE_VERSION, "grain": self._it.get_state(), **self._fingerprint}

    def set_state(self, state: dict[str, Any], *, strict: bool = True) -> None:
        """Restore a position saved by :meth:`get_state`.

        With ``strict`` (the default) a state saved for different data or batching settings is an
        error; with ``strict=False`` it is applied anyway, with a warning.
        """
        if not isinstance(state, dict) or "grain" not in state:
            raise ValueError(f"not a PromptLoader state (expected a dict from get_state()), got {state!r:.200}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"PromptLoader state version {state.get('version')!r} is not supported (expected {STATE_VERSION})"
            )
        problems = []
        if state.get("data") != self._fingerprint["data"]:
            problems.append("the prompts (dataset content, tokenizer, template or length filter) differ")
        saved = state.get("pipeline", {})
        for k, v in self._fingerprint["pipeline"].items():
            if saved.get(k) != v:
                problems.append(f"{k} was {saved.get(k)!r}, now {v!r}")
        if problems:
            msg = "the data-loader state was saved for a different pipeline: " + "; ".join(problems)
            if strict:
                raise ValueError(msg + " (pass strict=False to apply it anyway)")
            logger.warning("jrl.data: %s; applying it anyway (strict=False)", msg)
        self._it.set_state(state["grain"])


def make_prompt_loader(cfg: DataConfig, tokenizer, *, shard_index: int = 0, shard_count: int = 1) -> PromptLoader:
    """Build the dataset of ``cfg`` with ``tokenizer`` and return its :class:`PromptLoader`.

    ``shard_index`` / ``shard_count`` give each data-parallel process its own disjoint part of the
    prompts (every shard shuffles its part with the same seed).
    """
    return PromptLoader(build_prompt_dataset(cfg, tokenizer), cfg, shard_index=shard_index, shard_count=shard_count)
