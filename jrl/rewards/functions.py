"""Reward functions: loading them by import path, and running them on a batch of completions.

A reward function has TRL's signature::

    fn(prompts, completions, completion_ids, **columns) -> list[float | None]

It is called with keyword arguments: ``prompts`` (the raw prompt-column values, one per
completion), ``completions`` (decoded completion strings, or chat message lists), ``completion_ids``
(token-id lists), and every dataset column except ``prompt`` / ``completion`` / ``completion_ids``
as a keyword (one value per completion), so a function should accept ``**kwargs``. It returns one
value per completion; ``None`` (or NaN) means "no reward for this one" and becomes NaN, which every
later aggregation skips (docs/algorithms/grpo.md §1.1).

Functions are named by import path in configs (:class:`RewardSpec`):

- ``package.module:function`` (e.g. ``jrl.data.tasks.arithmetic:exact_match``), or a dotted
  attribute ``package.module:obj.method``;
- ``path/to/file.py:function`` (the file is imported as a module of its own).

:func:`run_call` runs one function on one block of completions and reports a failure instead of raising;
:func:`compute_rewards` (the library call, in this process) returns the per-function reward matrix
``[N, F]`` (float32, NaN for None) and raises :class:`RewardError` on the first failure. A training run
scores through :class:`jrl.rewards.pool.RewardScorer` instead: worker processes, per-call timeouts,
failed calls counted and given no reward. Weights are applied by the advantage code
(``jrl.losses.advantages``), which takes the matrix as is.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from jrl.rewards.config import RewardSpec  # noqa: F401 (public name)

#: Column names that are never passed as keyword arguments (they are the positional inputs).
RESERVED_COLUMNS = frozenset({"prompt", "prompts", "completion", "completions", "completion_ids"})


class RewardLoadError(ValueError):
    """A reward function could not be loaded from its import path."""


class RewardError(RuntimeError):
    """A reward function failed on a batch, or returned something other than one number per
    completion. The message names the function and the batch."""

    def __init__(self, message: str, *, function: str, batch: Any = None):
        super().__init__(message)
        self.function = function
        self.batch = batch


@dataclasses.dataclass(frozen=True)
class RewardFunction:
    """A loaded reward function with its name, weight and (if loaded by path) import path."""

    fn: Callable
    name: str
    weight: float = 1.0
    path: str | None = None

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __reduce__(self):
        # Functions loaded from a file path are not importable by module name in another process;
        # ship the path instead and load it there.
        if self.path is not None:
            return (_rebuild_reward_function, (self.path, self.name, self.weight))
        return (RewardFunction, (self.fn, self.name, self.weight, None))


def _rebuild_reward_function(path: str, name: str, weight: float) -> RewardFunction:
    return RewardFunction(fn=load_reward_function(path), name=name, weight=weight, path=path)


def _is_file_path(module_part: str) -> bool:
    return module_part.endswith(".py") or "/" in module_part or os.sep in module_part


@functools.lru_cache(maxsize=None)
def _import_file(file: str):
    resolved = Path(file).expanduser().resolve()
    digest = hashlib.sha256(str(resolved).encode()).hexdigest()[:12]
    mod_name = f"jrl_reward_file_{resolved.stem}_{digest}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, resolved)
    if spec is None or spec.loader is None:
        raise RewardLoadError(f"cannot import reward file {str(resolved)!r} as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # so its functions pickle by reference within this process
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[mod_name]
        raise
    return module


def load_reward_function(path: str) -> Callable:
    """The callable at ``path`` (``package.module:attr`` or ``file.py:attr``); clear errors."""
    if not isinstance(path, str) or ":" not in path:
        raise RewardLoadError(
            f"reward function path {path!r} must look like 'package.module:function' or 'path/to/file.py:function'"
        )
    module_part, attr = path.rsplit(":", 1)
    if not module_part or not attr:
        raise RewardLoadError(f"reward function path {path!r} has an empty module or function part")
    if _is_file_path(module_part):
        file = Path(module_part).expanduser()
        if not file.is_file():
            raise RewardLoadError(
                f"reward file {module_part!r} (from {path!r}) does not exist (resolved: {file.resolve()})"
            )
        try:
            module = _import_file(str(file))
        except RewardLoadError:
            raise
        except Exception as e:
            raise RewardLoadError(
                f"importing reward file {module_part!r} (from {path!r}) failed: {type(e).__name__}: {e}"
            ) from e
    else:
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if module_part == missing or module_part.startswith(missing + "."):
                raise RewardLoadError(
                    f"reward module {module_part!r} (from {path!r}) not found: no module named {missing!r}; "
                    f"check the spelling, or give a file path 'path/to/file.py:{attr}'"
                ) from None
            raise RewardLoadError(f"importing reward module {module_part!r} (from {path!r}) failed: {e}") from e
        except Exception as e:
            raise RewardLoadError(
                f"importing reward module {module_part!r} (from {path!r}) failed: {type(e).__name__}: {e}"
            ) from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            public = sorted(
                n
                for n, v in vars(module).items()
                if not n.startswith("_") and callable(v) and getattr(v, "__module__", None) == module.__name__
            )
            raise RewardLoadError(
                f"reward function {attr!r} not found in {module_part!r} (from {path!r}); callables there: {public}"
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardLoadError(f"{path!r} is a {type(obj).__name__}, not a callable reward function")
    return obj


def load_reward_functions(specs: Sequence[RewardSpec | str]) -> list[RewardFunction]:
    """Load every spec (a :class:`RewardSpec`, or a bare path string with weight 1)."""
    out: list[RewardFunction] = []
    for spec in specs:
        if isinstance(spec, str):
            spec = RewardSpec(path=spec)
        elif not isinstance(spec, RewardSpec):
            raise TypeError(f"expected a RewardSpec or an import-path string, got {type(spec).__name__}: {spec!r}")
        fn = load_reward_function(spec.path)
        name = spec.name or spec.path.rsplit(":", 1)[1].rsplit(".", 1)[-1]
        out.append(RewardFunction(fn=fn, name=name, weight=float(spec.weight), path=spec.path))
    return out


def reward_name(fn: Callable) -> str:
    """Name of a reward function: ``RewardFunction.name``, else ``__name__`` (also through
    ``functools.partial``), else the class name."""
    if isinstance(fn, RewardFunction):
        return fn.name
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def unique_names(fns: Sequence[Callable]) -> list[str]:
    """The functions' names, a repeated one suffixed ``_1``, ``_2``..."""
    names, seen = [], {}
    for fn in fns:
        base = reward_name(fn)
        k = seen.get(base, 0)
        seen[base] = k + 1
        names.append(base if k == 0 else f"{base}_{k}")
    return names


def describe(name: str, fn: Callable) -> str:
    """``reward function 'name' (path)`` for messages."""
    path = fn.path if isinstance(fn, RewardFunction) else None
    return f"reward function {name!r}" + (f" ({path})" if path else "")


def _batch_desc(batch: Any, n: int) -> str:
    return f"batch {batch!r} ({n} completions)" if batch is not None else f"a batch of {n} completions"


def _to_rewards(out: Any, n: int) -> np.ndarray:
    """Convert one function's output to float32 [n]; raise ValueError describing the problem."""
    if hasattr(out, "__array__") and not isinstance(out, (list, tuple)):
        arr = np.asarray(out)
        if arr.ndim != 1:
            raise ValueError(f"returned an array of shape {arr.shape}; expected a 1-D list of {n} numbers")
        out = arr.tolist()
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        raise ValueError(
            f"returned {type(out).__name__} ({out!r:.80}); expected a list of {n} numbers (one per completion)"
        )
    if len(out) != n:
        raise ValueError(f"returned {len(out)} values for {n} completions; expected exactly one per completion")
    res = np.empty(n, dtype=np.float32)
    for i, v in enumerate(out):
        if v is None:
            res[i] = np.nan
            continue
        if isinstance(v, (bool, np.bool_, int, float, np.integer, np.floating)):
            f = float(v)
        elif isinstance(v, np.ndarray) and v.ndim == 0 and np.issubdtype(v.dtype, np.number):
            f = float(v)
        else:
            raise ValueError(f"returned {type(v).__name__} ({v!r:.80}) at index {i}; expected a number or None")
        if math.isinf(f):
            raise ValueError(f"returned {f} at index {i}; rewards must be finite (or None/NaN for 'no reward')")
        res[i] = f
    return res


def check_inputs(prompts, completions, completion_ids, columns) -> tuple[int, dict[str, list]]:
    """(N, the columns passed as keywords): one prompt, id list and column value per completion, or an error."""
    n = len(completions)
    if len(prompts) != n:
        raise ValueError(f"compute_rewards: {len(prompts)} prompts for {n} completions; give one prompt per completion")
    if completion_ids is not None and len(completion_ids) != n:
        raise ValueError(f"compute_rewards: {len(completion_ids)} completion_ids for {n} completions")
    kwargs = {}
    for k, v in (columns or {}).items():
        if k in RESERVED_COLUMNS:
            continue
        if len(v) != n:
            raise ValueError(
                f"compute_rewards: column {k!r} has {len(v)} values for {n} completions; give one value per "
                f"completion (repeat each prompt's columns num_generations times, e.g. PromptBatch.repeat)"
            )
        kwargs[k] = list(v)
    return n, kwargs


class RewardCall(NamedTuple):
    """The inputs of one call of a reward function: a block of ``n`` completions and their columns."""

    prompts: list
    completions: list
    completion_ids: list | None
    columns: dict[str, list]


class CallResult(NamedTuple):
    """What one call gave: ``values`` (float32 ``[n]``, NaN for None) or ``error`` (what went wrong, a
    phrase such as ``raised ValueError: ...``); ``timed_out`` when the call was stopped at its timeout."""

    values: np.ndarray | None
    error: str | None = None
    timed_out: bool = False
    exception: Exception | None = None


def run_call(fn: Callable, call: RewardCall) -> CallResult:
    """Call ``fn`` on ``call`` and check its output; an exception or malformed output is returned as the
    result's ``error`` (the exception itself in ``exception`` when it can be kept)."""
    n = len(call.completions)
    try:
        out = fn(prompts=call.prompts, completions=call.completions, completion_ids=call.completion_ids,
                 **call.columns)
    except Exception as e:
        return CallResult(None, f"raised {type(e).__name__}: {e}", exception=e)
    try:
        return CallResult(_to_rewards(out, n))
    except ValueError as e:
        return CallResult(None, str(e))


def split_call(prompts, completions, completion_ids, columns: Mapping[str, Sequence[Any]] | None, a: int,
               b: int) -> RewardCall:
    """The :class:`RewardCall` of completions ``a:b`` of a batch (columns already checked by ``check_inputs``)."""
    return RewardCall(list(prompts[a:b]), list(completions[a:b]),
                      None if completion_ids is None else [list(c) for c in completion_ids[a:b]],
                      {k: list(v[a:b]) for k, v in (columns or {}).items()})


def compute_rewards(
    fns: Sequence[Callable],
    weights: Sequence[float] | None,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]] | None,
    columns: Mapping[str, Sequence[Any]] | None,
    *,
    batch: Any = None,
) -> tuple[np.ndarray, list[str]]:
    """Run every reward function on a batch of ``N`` completions, in this process.

    Args:
      fns: reward callables (:class:`RewardFunction` from :func:`load_reward_functions`, or plain
        functions).
      weights: one weight per function, validated here (length, finite) but not applied; ``None``
        takes ``RewardFunction.weight`` (or 1). The advantage code applies them (:func:`resolve_weights`).
      prompts, completions, completion_ids: one entry per completion.
      columns: dataset columns, each with one value per completion; all except ``prompt`` /
        ``completion`` / ``completion_ids`` are passed as keyword arguments.
      batch: a label for error messages (e.g. the step number).

    Returns:
      ``(rewards, names)``: float32 ``[N, F]`` with NaN where a function returned None/NaN, and the
      function names (made unique by suffixing ``_1``, ``_2``... on collision).

    Raises:
      RewardError: a function raised, or did not return one number (or None) per completion; the
        message names the function and the batch.
    """
    fns = list(fns)
    if not fns:
        raise ValueError("compute_rewards: no reward functions given")
    resolve_weights(fns, weights)
    n, kwargs = check_inputs(prompts, completions, completion_ids, columns)
    names = unique_names(fns)
    call = split_call(prompts, completions, completion_ids, kwargs, 0, n)
    out = np.empty((n, len(fns)), dtype=np.float32)
    for j, (fn, name) in enumerate(zip(fns, names)):
        res = run_call(fn, call)
        if res.error is not None:
            raise RewardError(f"{describe(name, fn)} {res.error} on {_batch_desc(batch, n)}", function=name,
                              batch=batch) from res.exception
        out[:, j] = res.values
    return out, names


def best_total(fns: Sequence[Callable], weights: Sequence[float] | None = None) -> float | None:
    """The best possible weighted reward sum, when every function declares its best value as a ``max_reward``
    attribute (e.g. ``exact_match.max_reward = 1.0``); None when one does not."""
    best = [getattr(fn.fn if isinstance(fn, RewardFunction) else fn, "max_reward", None) for fn in fns]
    if not fns or any(not isinstance(b, (int, float)) or isinstance(b, bool) for b in best):
        return None
    return float(np.dot(resolve_weights(fns, weights).astype(np.float64), best))


def resolve_weights(fns: Sequence[Callable], weights: Sequence[float] | None) -> np.ndarray:
    """Weights as float32 ``[F]``: ``weights`` if given (checked), else each function's own."""
    if weights is None:
        return np.asarray([fn.weight if isinstance(fn, RewardFunction) else 1.0 for fn in fns], dtype=np.float32)
    w = list(weights)
    if len(w) != len(fns):
        raise ValueError(f"{len(w)} reward weights for {len(fns)} reward functions ({unique_names(fns)})")
    for name, x in zip(unique_names(fns), w):
        if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)) or not math.isfinite(x):
            raise ValueError(f"weight {x!r} of reward function {name!r} is not a finite number")
    return np.asarray(w, dtype=np.float32)
