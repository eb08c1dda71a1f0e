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

Padding is the trainer's job; :func:`left_pad` is a helper that returns ``(ids, mask)`` arrays. The config section
is :mod:`jrl.data.config`, the readers :mod:`jrl.data.records` (both names are importable from here too).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from jrl.data.config import BUILTIN_PREFIX, SUPPORTED_EXTENSIONS, DataConfig, is_hub_id  # noqa: F401 (public names)
from jrl.data.records import _columns_of, load_records  # noqa: F401 (public name)

logger = logging.getLogger(__name__)

#: Version of the dict returned by :meth:`PromptLoader.get_state`.
STATE_VERSION = 1


# ---------------------------------------------------------------------------------------------
# Rendering and tokenizing


def render_prompt(prompt: Any, cfg: DataConfig, tokenizer, *, row: int | None = None,
                  tools: list[dict] | None = None) -> str:
    """Text of one prompt: through the chat template (with the generation prompt; ``tools``: the tools it declares,
    as ``apply_chat_template(tools=...)`` takes them) or as is."""
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
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 **({"tools": tools} if tools else {}))
        except Exception as e:
            raise ValueError(f"{where}: the tokenizer's chat template failed: {type(e).__name__}: {e}") from e
        return text
    if not isinstance(prompt, str):
        raise ValueError(
            f"{where}: column {cfg.prompt_column!r} holds {type(prompt).__name__}, but use_chat_template=False needs "
            f"plain-text prompts; set use_chat_template=True for chat messages"
        )
    return prompt


def _check_tools_rendered(cfg: DataConfig, tokenizer, tools: list[dict]) -> None:
    """A warning when the prompts cannot declare ``tools``: plain-text prompts, or a chat template that renders
    the same text with and without them."""
    names = [t.get("function", t).get("name") for t in tools]
    if not cfg.use_chat_template:
        why = "use_chat_template=False: plain-text prompts declare no tools"
    else:
        probe = [{"role": "user", "content": "1+1"}]
        plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        if tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, tools=tools) != plain:
            return
        why = "the tokenizer's chat template ignores tools= (it renders no tool declarations)"
    logger.warning("jrl.data: the model may call tools %s, but %s; describe them in data.system_prompt, or use a "
                   "tokenizer whose template declares tools (Qwen's, Llama 3.1's)", names, why)


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


def build_prompt_dataset(cfg: DataConfig, tokenizer, *, tools: list[dict] | None = None) -> PromptDataset:
    """Load ``cfg.source``, render and tokenize every prompt, drop over-long ones. ``tools``: tools every prompt
    declares through the chat template (a multi-turn environment's, :func:`jrl.envs.prompt_tools`)."""
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
    if tools:
        _check_tools_rendered(cfg, tokenizer, tools)
    texts = [render_prompt(r[cfg.prompt_column], cfg, tokenizer, row=i, tools=tools) for i, r in enumerate(records)]
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
        return PromptBatch.join([self.rows(slice(0, len(self) - n)), other])

    @staticmethod
    def join(batches: Sequence[PromptBatch]) -> PromptBatch:
        """The prompts of ``batches`` in order, as one batch (they must share their columns)."""
        if not batches:
            raise ValueError("PromptBatch.join needs at least one batch")
        names = set(batches[0].columns)
        if any(set(b.columns) != names for b in batches):
            raise ValueError(f"cannot join prompt batches with different columns: "
                             f"{sorted({tuple(sorted(b.columns)) for b in batches})}")
        return PromptBatch(prompt_ids=[x for b in batches for x in b.prompt_ids],
                           prompt_texts=[x for b in batches for x in b.prompt_texts],
                           prompts=[x for b in batches for x in b.prompts],
                           columns={k: [x for b in batches for x in b.columns[k]] for k in batches[0].columns},
                           indices=[x for b in batches for x in b.indices])

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
