"""Hugging Face safetensors checkpoints <-> jrl :class:`~jrl.models.transformer.Transformer`.

``from_pretrained`` builds the module abstractly (no random weights are ever allocated), checks every key
and shape of the checkpoint against the family's mapping table before reading any data, then streams the
tensors one by one (expert tensors are assembled expert by expert into one preallocated array) and places
each parameter, sharded by its logical axes when a mesh is given. A stacked-layer parameter
(``ModelConfig.stacked_layers``) is placed layer by layer and stacked on the devices, and exported layer by
layer, so the host never holds more than one layer of it.

Writing is :mod:`jrl.models.checkpoint_writer`; the tensor entries of the family's table
(:func:`export_entries`), the dtype names and the progress bar here serve both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.models import hf_mapping
from jrl.models.config import ModelConfig
from jrl.models.hf_mapping import Rule
from jrl.models.transformer import Transformer, named_params, param_units, unit_placer
from jrl.sharding.placement import check_placement

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
#: Files copied verbatim from the source checkpoint on export (when present).
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja", "chat_template.json",
)
SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


def save_dtype_name(dtype, what: str) -> str:
    """The canonical name of ``dtype`` (``"bfloat16"``...), or a ValueError naming ``what`` when safetensors
    files are not written in it."""
    name = jnp.dtype(dtype).name
    if name not in SAFETENSORS_DTYPES:
        raise ValueError(f"{what}: dtype {name!r} is not supported; use one of {', '.join(SAFETENSORS_DTYPES)}")
    return name
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
_ST_NP = {"F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
          "BF16": np.dtype(jnp.bfloat16)}
_PROGRESS_MIN_BYTES = 256 * 2**20


class CheckpointError(ValueError):
    """A checkpoint that does not match the model its config describes."""


class MissingTensorError(CheckpointError):
    """A tensor the model needs is absent from the checkpoint."""


class UnexpectedTensorError(CheckpointError):
    """The checkpoint holds a tensor the model has no place for."""


class ShapeMismatchError(CheckpointError):
    """A checkpoint tensor has a different shape than the model expects."""


# --------------------------------------------------------------------------- helpers
def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a dtype name (``bfloat16`` included, through JAX's)."""
    return np.dtype(jnp.dtype(name))


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One HF tensor <-> (part of) one jrl parameter: layer ``layer`` of a stacked-layer parameter (``None`` for
    an unstacked one), expert ``expert`` of a stacked-expert one."""

    hf_key: str
    jrl_path: str
    rule: Rule
    expert: int | None = None
    layer: int | None = None

    @property
    def unit(self) -> tuple[str, int | None]:
        """(jrl parameter, layer): the part of a parameter one HF layer's tensors fill."""
        return self.jrl_path, self.layer

    def hf_shape(self, jrl_shape) -> tuple[int, ...]:
        inner = jrl_shape[(self.layer is not None) + (self.expert is not None):]
        shape = list(self.rule.transform.hf_shape(inner))
        if self.rule.chunk is not None:
            axis, _, count = self.rule.chunk
            shape[axis] *= count
        return tuple(shape)


def _param_of(rule: Rule, layer: int | None, stacked: bool) -> tuple[str, int | None]:
    """(jrl parameter path, index on its layer axis or ``None``) that ``rule`` fills for decoder layer ``layer``
    (``None`` outside the layers); ``stacked``: the model keeps its layers stacked (``layers.attn...``)."""
    if layer is None or not stacked:
        return rule.jrl.format(**({} if layer is None else {"layer": layer})), None
    return rule.jrl.replace("layers.{layer}.", "layers.", 1), layer


def export_entries(config: ModelConfig, params: Mapping[str, Any]) -> list[TensorEntry]:
    """The canonical HF tensors of a model (the layout transformers writes), grouped by jrl parameter and layer."""
    rules = [r for r in config.family.table if r.export]
    out: list[TensorEntry] = []

    def add(layer):
        for rule in rules:
            if ("{layer}" in rule.hf) != (layer is not None):
                continue
            fmt = {} if layer is None else {"layer": layer}
            path, index = _param_of(rule, layer, config.stacked_layers)
            if path not in params:
                continue
            if rule.per_expert:
                out.extend(TensorEntry(rule.hf.format(expert=e, **fmt), path, rule, e, index)
                           for e in range(config.num_experts))
            else:
                out.append(TensorEntry(rule.hf.format(**fmt), path, rule, layer=index))

    add(None)
    for layer in range(config.num_hidden_layers):
        add(layer)
    return out


# --------------------------------------------------------------------------- reading
def _read_config(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"checkpoint path {str(path)!r} is not a directory")
    cfg = path / "config.json"
    if not cfg.is_file():
        raise FileNotFoundError(f"{str(path)!r} has no config.json (not a Hugging Face checkpoint directory)")
    return json.loads(cfg.read_text())


def read_config(path: str | os.PathLike, **overrides) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face checkpoint directory's config.json (``overrides``: runtime
    fields such as ``dtype``); the weights are not read."""
    return ModelConfig.from_hf(_read_config(Path(path)), **overrides)


def _weight_files(path: Path) -> list[Path]:
    index = path / SAFE_INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        for f in files:
            if not (path / f).is_file():
                raise FileNotFoundError(f"{SAFE_INDEX} in {str(path)!r} names shard {f!r}, which does not exist")
        return [path / f for f in files]
    single = path / SAFE_WEIGHTS
    if single.is_file():
        return [single]
    others = sorted(path.glob("*.safetensors"))
    if others:
        return others
    found = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".h5", ".msgpack"))
    hint = f" (found {', '.join(found)}: only safetensors checkpoints are supported)" if found else ""
    raise FileNotFoundError(f"no weights in {str(path)!r}: expected {SAFE_WEIGHTS} or {SAFE_INDEX}{hint}")


def _tensor_headers(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """key -> (file, shape, safetensors dtype) from the file headers only."""
    from safetensors import safe_open

    out = {}
    for file in files:
        with safe_open(str(file), framework="np") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                out[key] = (file, tuple(sl.get_shape()), sl.get_dtype())
    return out


@dataclasses.dataclass
class _Task:
    entry: TensorEntry
    file: Path
    nbytes: int


def _plan(config: ModelConfig, params: Mapping[str, nnx.Variable], headers) -> list[_Task]:
    """Match every checkpoint tensor to a rule, check shapes and coverage; raise before reading data."""
    rules = [(r, r.regex()) for r in config.family.table]
    tasks: list[_Task] = []
    filled: dict[tuple[str, int | None], list[int | None]] = defaultdict(list)
    for key, (file, shape, st_dtype) in headers.items():
        if any(p.match(key) for p in hf_mapping.IGNORED):
            continue
        if key == "lm_head.weight" and config.tie_word_embeddings:
            continue  # some tied checkpoints store the (identical) head anyway; transformers ignores it too
        if st_dtype not in _ST_NP:
            raise CheckpointError(f"tensor {key!r} has dtype {st_dtype}; only float checkpoints "
                                  f"({', '.join(_ST_NP)}) are supported")
        matched, inactive = False, None
        for rule, regex in rules:
            m = regex.match(key)
            if m is None:
                continue
            groups = m.groupdict()
            layer = int(groups["layer"]) if "layer" in groups else None
            path, index = _param_of(rule, layer, config.stacked_layers)
            if path not in params or (index is not None and index >= params[path].shape[0]):
                inactive = path if index is None else f"{path}[{index}]"
                continue
            expert = int(groups["expert"]) if rule.per_expert else None
            if expert is not None and expert >= config.num_experts:
                continue
            entry = TensorEntry(key, path, rule, expert, index)
            expected = entry.hf_shape(params[path].shape)
            if tuple(shape) != expected:
                raise ShapeMismatchError(
                    f"tensor {key!r} has shape {list(shape)} but the model expects {list(expected)} "
                    f"(jrl parameter {path}, shape {list(params[path].shape)}); does config.json match the weights?")
            nbytes = math.prod(shape) * _ST_ITEMSIZE.get(st_dtype, 4) // (rule.chunk[2] if rule.chunk else 1)
            tasks.append(_Task(entry, file, nbytes))
            filled[entry.unit].append(expert)
            matched = True
        if not matched:
            why = (f" (its jrl parameter {inactive} does not exist for this config: e.g. a bias, an lm_head with "
                   f"tied embeddings, or an MoE tensor in a dense layer)" if inactive else "")
            raise UnexpectedTensorError(
                f"unexpected tensor {key!r} in the checkpoint: no {config.model_type} parameter takes it{why}")
    # Coverage: every parameter (every layer of a stacked one) exactly once (whole) or every expert exactly once.
    canonical: dict[tuple[str, int | None], list[TensorEntry]] = defaultdict(list)
    for e in export_entries(config, params):
        canonical[e.unit].append(e)
    missing: list[str] = []
    for (path, layer), shape in param_units(config, params).items():
        got = filled.get((path, layer), [])
        experts = [e for e in got if e is not None]
        whole = len(got) - len(experts)
        where = path if layer is None else f"{path} (layer {layer})"
        if whole > 1 or len(set(experts)) != len(experts) or (whole and experts):
            raise CheckpointError(f"jrl parameter {where} is given more than once by the checkpoint (both "
                                  f"per-expert and fused expert tensors, or duplicate keys)")
        if whole == 1 or (experts and len(experts) == shape[0] and path.split(".")[-2] == "experts"):
            continue
        have = {e for e in experts}
        missing.extend(e.hf_key for e in canonical[path, layer] if e.expert is None or e.expert not in have)
        if not canonical[path, layer]:
            missing.append(f"<tensor for {where}>")
    if missing:
        shown = ", ".join(repr(k) for k in missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise MissingTensorError(f"missing tensor {shown} in the checkpoint ({len(missing)} missing)")
    return tasks


def progress_bar(total_bytes: int, n: int, enabled: bool | None, desc: str):
    """A bar over ``n`` tensors (loading or saving), shown when ``enabled`` or, for None, when the checkpoint has at
    least 256 MiB; otherwise a context giving None."""
    if enabled is None:
        enabled = total_bytes >= _PROGRESS_MIN_BYTES
    if not enabled:
        return contextlib.nullcontext(None)
    from tqdm.auto import tqdm

    return tqdm(total=n, desc=desc, unit="tensor")


class _ShardReader:
    """Zero-copy numpy views of the tensors of one safetensors file (read-only mmap).

    The keys, shapes and dtypes were already validated through ``safetensors.safe_open``; reading through
    views avoids an intermediate host copy per tensor (the only copy is into the placed array).
    """

    def __init__(self, file: Path):
        import mmap

        with open(file, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            self.header = json.loads(fh.read(n))
            self.base = 8 + n
            self.mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)

    def view(self, key: str) -> np.ndarray:
        info = self.header[key]
        dtype = _ST_NP[info["dtype"]]
        begin, end = info["data_offsets"]
        return np.frombuffer(self.mm, dtype=dtype, count=(end - begin) // dtype.itemsize,
                             offset=self.base + begin).reshape(info["shape"])

    def close(self):
        try:
            self.mm.close()
        except BufferError:  # a view is still referenced somewhere: the GC unmaps it later
            pass


def from_pretrained(path: str | os.PathLike, *, dtype=jnp.bfloat16, param_dtype=None, mesh=None,
                    rules: Mapping | None = None, progress: bool | None = None, attention: str = "auto",
                    remat: str = "auto", scan_layers: bool = True, fsdp_prefetch: bool = True,
                    grad_reduce_dtype: str | None = None, expert_capacity: float = 0.0,
                    expert_chunks: int = 1, fsdp_layers_per_gather: int = 0) -> Transformer:
    """Load a Hugging Face checkpoint directory as a :class:`Transformer`.

    ``dtype`` is the compute dtype, ``param_dtype`` the storage dtype (defaults to ``dtype``). With ``mesh``,
    every parameter is placed with ``logical_sharding(param.logical_axes, mesh, rules, shape)`` and each
    device only receives its shard. ``progress``: tqdm bar (``None``: only for checkpoints >= 256 MiB).
    ``attention`` / ``remat`` / ``scan_layers`` / ``fsdp_prefetch`` / ``grad_reduce_dtype`` / ``expert_capacity`` /
    ``expert_chunks`` / ``fsdp_layers_per_gather``: the runtime :class:`ModelConfig` fields of the same names.
    Raises ``FileNotFoundError`` (directory / config.json / weights), ``UnsupportedModelError``
    (model_type), :class:`MissingTensorError`, :class:`UnexpectedTensorError`, :class:`ShapeMismatchError`.

    Host memory: tensors are read as views of the memory-mapped shard (one shard mapped at a time); a
    stacked expert parameter is assembled expert by expert into one preallocated array in the checkpoint
    dtype, then cast and transposed while it is placed.
    """
    path = Path(path)
    config = read_config(path, dtype=jnp.dtype(dtype).name, param_dtype=jnp.dtype(param_dtype or dtype).name,
                         attention=attention, remat=remat, scan_layers=scan_layers, fsdp_prefetch=fsdp_prefetch,
                         grad_reduce_dtype=grad_reduce_dtype, expert_capacity=expert_capacity,
                         expert_chunks=expert_chunks, fsdp_layers_per_gather=fsdp_layers_per_gather)
    files = _weight_files(path)
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), mesh=mesh, rules=rules))
    if mesh is not None:
        check_placement(model, mesh, rules)
    model.source_dir = str(path.resolve())
    params = named_params(model)
    tasks = _plan(config, params, _tensor_headers(files))
    target = np_dtype(config.param_dtype)
    units = param_units(config, params)
    pending = defaultdict(int)
    for t in tasks:
        pending[t.entry.unit] += 1
    buffers: dict[tuple[str, int | None], np.ndarray] = {}
    place_unit = unit_placer(params, mesh, rules)
    total = sum(t.nbytes for t in tasks)
    by_file: dict[Path, list[_Task]] = defaultdict(list)
    for t in tasks:
        by_file[t.file].append(t)

    def put(unit: tuple[str, int | None], value: np.ndarray):
        place_unit(unit, np.asarray(value).astype(target, order="K", copy=False))

    with progress_bar(total, len(tasks), progress, f"loading {path.name}") as bar:
        for file, file_tasks in by_file.items():
            reader = _ShardReader(file)
            try:  # in on-disk order: sequential reads of the mapped file
                for t in sorted(file_tasks, key=lambda t: reader.header[t.entry.hf_key]["data_offsets"][0]):
                    e, shape = t.entry, units[t.entry.unit]
                    raw = reader.view(e.hf_key)
                    if e.rule.chunk is not None:
                        axis, i, count = e.rule.chunk
                        size = raw.shape[axis] // count
                        raw = raw[(slice(None),) * axis + (slice(i * size, (i + 1) * size),)]
                    if e.expert is None:
                        put(e.unit, e.rule.transform.to_jrl(raw, shape))
                    else:  # assemble [E, *hf_shape] in the checkpoint's layout and dtype (plain copies)
                        buf = buffers.get(e.unit)
                        if buf is None:
                            buf = buffers[e.unit] = np.empty((shape[0],) + raw.shape, raw.dtype)
                        buf[e.expert] = raw
                        pending[e.unit] -= 1
                        if pending[e.unit] == 0:
                            put(e.unit, e.rule.transform.to_jrl(buffers.pop(e.unit), shape))
                    del raw
                    if bar is not None:
                        bar.update(1)
            finally:
                reader.close()
    return model
