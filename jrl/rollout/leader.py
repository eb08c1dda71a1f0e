"""An engine that process 0 drives for a run of several processes, with its batches shared by all of them.

Every trainer process needs every completion (each scores its share and places its rows of the update), but an
external server should see each request once and load each weight version once. So for a backend whose engine
lives on the host (the vLLM servers), a multi-process run builds it on process 0 only (:class:`LeaderEngine`):

- ``generate``: process 0 sends the requests; the batch is then broadcast to every process (one small header with
  the array widths and the policy version, then the arrays).
- ``sync_weights``: every process takes part in gathering the weights the transport reads to host memory (the
  LoRA adapters for an adapter sync, else every array: a collective), and process 0 delivers them.

A failure on process 0 (a server that does not answer, a refused adapter) is raised there and, as an error
naming process 0, on every other process in the same call, so no process waits for a broadcast that never comes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jrl.models.lora import LoRAParam
from jrl.rollout.base import RolloutBatch, RolloutEngine, SamplingParams
from jrl.sharding import any_process, is_main_process
from jrl.sharding.placement import host_copy


def _broadcast(tree: Any) -> Any:
    from jax.experimental import multihost_utils

    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(tree))


def broadcast_batch(batch: RolloutBatch | None, rows: int) -> RolloutBatch:
    """Process 0's ``batch`` (of ``rows`` rows) on every process; the others pass None."""
    header = np.zeros(3, np.int64)
    if batch is not None:
        header[:] = (batch.prompt_ids.shape[1], batch.completion_ids.shape[1], batch.policy_version)
    prompt_len, length, version = (int(v) for v in _broadcast(header))
    if batch is None:
        prompt, completion = np.zeros((rows, prompt_len), np.int32), np.zeros((rows, length), np.int32)
        arrays = dict(prompt_ids=prompt, prompt_mask=prompt, completion_ids=completion, completion_mask=completion,
                      sampling_logprobs=np.zeros((rows, length), np.float32), truncated=np.zeros(rows, np.int32))
    else:
        arrays = {k: np.asarray(getattr(batch, k), np.float32 if k == "sampling_logprobs" else np.int32)
                  for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "sampling_logprobs",
                            "truncated")}
    arrays = _broadcast(arrays)
    return RolloutBatch(**{**arrays, "truncated": arrays["truncated"].astype(bool)}, policy_version=version)


class LeaderEngine:
    """A :class:`~jrl.rollout.base.RolloutEngine` that process 0 builds with ``make_engine(host_model)`` and
    drives; every process calls every method in the same order (see the module docstring). ``adapters_only``:
    the engine reads only the LoRA adapters of the models it is given (an adapter sync)."""

    #: The weights are copied to host memory at each sync; nothing runs on the trainer's devices between calls.
    shares_trainer_devices = False
    capabilities = frozenset()

    def __init__(self, make_engine: Callable[[Any], RolloutEngine], model, *, adapters_only: bool):
        self.adapters_only = adapters_only
        host = self._host(model)
        self.inner: RolloutEngine | None = self._on_leader("build its rollout engine", lambda: make_engine(host))

    def _on_leader(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()`` on process 0, then the same outcome everywhere: its value there (None elsewhere), or its
        exception there and an error naming process 0 on the others."""
        value, failure = None, None
        if is_main_process():
            try:
                value = fn()
            except Exception as e:  # raised below, after every process knows
                failure = e
        if any_process(failure is not None):
            if failure is not None:
                raise failure
            raise RuntimeError(f"process 0 could not {what} (its log has the error); this process stops with it")
        return value

    def _host(self, model):
        """``model`` with the arrays the engine reads gathered to host memory (a collective)."""
        return host_copy(model, LoRAParam if self.adapters_only else None)

    def sync_weights(self, model, version: int) -> None:
        host = self._host(model)
        self._on_leader(f"deliver weight version {version}", lambda: self.inner.sync_weights(host, version))

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, num_generations: int,
                 seed: int) -> RolloutBatch:
        batch = self._on_leader("generate a rollout batch", lambda: self.inner.generate(
            prompt_ids, params, num_generations=num_generations, seed=seed))
        return broadcast_batch(batch, len(prompt_ids) * num_generations)

    def close(self) -> None:
        if self.inner is not None:  # only process 0 holds the engine
            self.inner.close()
