"""The ``data`` section of a training config (:class:`DataConfig`): where prompts come from, how they are formatted
and batched. Read by :mod:`jrl.data.records` (the records) and :mod:`jrl.data.pipeline` (prompts and batches)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from jrl.data.tasks import BUILTIN_TASKS
from jrl.data.tasks.arithmetic import ArithmeticConfig
from jrl.validation import check_int, invalid

BUILTIN_PREFIX = "builtin:"
#: File extensions the loader reads (a directory is read with ``datasets.load_from_disk``).
SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_hub_id(source: str) -> bool:
    """Whether ``source`` reads as a hub dataset id (``owner/name``) rather than a file: no supported file
    extension, no leading ``.``/``/``/``~``, and nothing on disk by that name."""
    return (_HUB_ID.fullmatch(source) is not None and Path(source).suffix.lower() not in SUPPORTED_EXTENSIONS
            and not Path(os.path.expanduser(source)).exists())



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
