"""The ``vllm`` rollout backend: completions from an external vLLM server's OpenAI-compatible API.

Generation: one ``POST /v1/completions`` per prompt (token-id prompt, ``n`` = num_generations, a seed
derived from the call's seed and the prompt index), sent concurrently; ``return_token_ids`` makes the
server return the sampled token ids, so nothing is re-tokenised, and ``logprobs=0`` returns each sampled
token's log-probability. The server must run with ``--logprobs-mode processed_logprobs`` (as
``scripts/serve_vllm.py`` starts it) so that log-probability is taken under the distribution actually
sampled from (temperature, top-k, top-p applied), the same quantity :mod:`jrl.rollout.sampling` reports.

Weight sync (``sync``):

- ``lora``: the model's adapters are written as a PEFT directory ``<sync_dir>/lora-v{N}``
  (:func:`jrl.models.save_peft_adapter`), loaded with ``POST /v1/load_lora_adapter`` under a name of
  this engine and version, the prefix cache is reset, and new requests go to that name. The newest
  ``keep_versions`` adapters stay loaded (requests still running finish under their own version); older
  ones are unloaded and their directories deleted.
- ``full``: the model is written as a Hugging Face checkpoint ``<sync_dir>/full-v{N}`` and the server
  reloads it in place (``POST /collective_rpc`` ``reload_weights``; the server needs
  ``VLLM_SERVER_DEV_MODE=1``), then the prefix cache is reset; the previous checkpoint is deleted.

If the server goes away mid-run (connection refused) the engine waits for ``/health`` (at most
``restart_timeout``), restores the current weights on it (reloads the adapter, or the full checkpoint)
and retries the request, so no step is lost.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from jrl.data.pipeline import left_pad
from jrl.models import save_peft_adapter, save_pretrained
from jrl.models.lora import has_lora
from jrl.rollout.base import RolloutBatch, SamplingParams, check_generate_args
from jrl.rollout.vllm_config import VLLMConfig
from jrl.rollout.vllm_http import VLLMClient, VLLMError, VLLMRequestError

SYNC_MODES = ("lora", "full")


def resolve_sync_mode(sync: str, model) -> str:
    """``auto`` -> ``lora`` when the model has LoRA adapters, else ``full``; checks an explicit choice."""
    lora = has_lora(model)
    if sync == "auto":
        return "lora" if lora else "full"
    if sync not in SYNC_MODES:
        raise ValueError(f"RolloutConfig.sync={sync!r} is invalid: use 'auto', 'lora' or 'full'")
    if sync == "lora" and not lora:
        raise ValueError("RolloutConfig.sync='lora' needs a LoRA run (set TrainConfig.lora), or use sync='full'")
    return sync


def prompt_seed(seed: int, index: int) -> int:
    """Sampling seed of prompt ``index`` of a call with ``seed`` (independent streams per prompt)."""
    return int(np.random.SeedSequence([int(seed) % 2**63, int(index)]).generate_state(1)[0] % 2**31)


def completion_request(model_name: str, prompt: list[int], params: SamplingParams, *, n: int, seed: int) -> dict:
    """The ``/v1/completions`` body for ``n`` samples of one token-id prompt."""
    body = {
        "model": model_name,
        "prompt": [int(t) for t in prompt],
        "n": int(n),
        "max_tokens": int(params.max_new_tokens),
        "temperature": float(params.temperature),
        "top_p": float(params.top_p),
        "stop_token_ids": [int(t) for t in params.stop_token_ids],
        "logprobs": 0,  # the sampled token's log-probability only
        "return_token_ids": True,
        "skip_special_tokens": False,
        "seed": int(seed),
    }
    if params.top_k > 0:
        body["top_k"] = int(params.top_k)
    return body


def parse_choices(response: dict, *, n: int, url: str) -> list[tuple[list[int], list[float], bool]]:
    """(token ids, sampled-token logprobs, stopped) of the ``n`` choices of one completions answer."""
    choices = sorted(response.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise VLLMError(f"{url} returned {len(choices)} choices for n={n}")
    out = []
    for c in choices:
        ids = c.get("token_ids")
        logprobs = (c.get("logprobs") or {}).get("token_logprobs")
        if ids is None:
            raise VLLMError(f"{url} returned no token_ids; the server must support return_token_ids (vLLM >= 0.10)")
        if logprobs is None or len(logprobs) != len(ids):
            raise VLLMError(f"{url} returned {0 if logprobs is None else len(logprobs)} logprobs for "
                            f"{len(ids)} tokens; it must honour logprobs=0")
        stopped = c.get("finish_reason") == "stop"
        out.append(([int(t) for t in ids], [np.nan if v is None else float(v) for v in logprobs], stopped))
    return out


class VLLMRolloutEngine:
    """:class:`~jrl.rollout.base.RolloutEngine` over a running vLLM server.

    ``model``: the policy being trained (its LoRA adapters or full weights are pushed on
    :meth:`sync_weights`; the constructor pushes them once as version 0). ``config``: server address,
    timeouts, retries (:class:`VLLMConfig`). ``sync``: ``auto``, ``lora`` or ``full``. ``sync_dir``: where
    adapters/checkpoints are written (the server must be able to read it). ``keep_versions``: adapter
    versions kept loaded. ``pad_id``: the id filling prompt and completion padding.

    The constructor waits for ``/health`` (``startup_timeout``) and checks that ``/v1/models`` serves the
    trained base model; both fail with errors naming the URL and the fix.
    """

    def __init__(self, model, *, config: VLLMConfig, sync: str = "auto", sync_dir: str | os.PathLike,
                 keep_versions: int = 2, pad_id: int):
        self.config = config
        self.sync_mode = resolve_sync_mode(sync, model)
        if keep_versions < 1:
            raise ValueError(f"VLLMRolloutEngine keep_versions={keep_versions} must be >= 1")
        self.keep_versions = int(keep_versions)
        self.sync_dir = Path(sync_dir).resolve()
        self.pad_id = int(pad_id)
        self.client = VLLMClient(config.base_url, api_key=config.api_key, connect_timeout=config.connect_timeout,
                                 read_timeout=config.read_timeout, max_retries=config.max_retries,
                                 backoff_seconds=config.backoff_seconds, restart_timeout=config.restart_timeout,
                                 on_reconnect=self._restore)
        # _sync_lock serialises syncs (held across their HTTP calls); _state_lock guards the served names and
        # version and is never held across a request, so a restore triggered from any thread cannot deadlock.
        self._sync_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(config.max_concurrent_requests, thread_name_prefix="jrl-vllm")
        self.tag = f"jrl-{uuid.uuid4().hex[:8]}"  # adapter names of this engine never clash with another run's
        self._adapters: list[tuple[int, str, Path]] = []  # (version, served name, dir), oldest first
        self._full_dir: Path | None = None
        self.version = 0
        self.last_sync_seconds = float("nan")
        self.client.wait_healthy(config.startup_timeout)
        self.base_name = self._check_base_model(model)
        self.current_name = self.base_name
        self.sync_weights(model, 0)

    # ------------------------------------------------------------------ startup checks
    def _check_base_model(self, model) -> str:
        """The name the server serves the trained base model under (an error if it serves another)."""
        served = self.client.get("/v1/models").get("data") or []
        bases = [m for m in served if not m.get("parent")]
        url = f"{self.config.base_url}/v1/models"
        listing = ", ".join(f"{m.get('id')!r} (root {m.get('root')!r})" for m in bases) or "nothing"
        want = self.config.served_model_name
        if want is not None:
            if any(m.get("id") == want for m in bases):
                return want
            raise VLLMError(f"{url} serves {listing}, not rollout.vllm.served_model_name={want!r}; start the server "
                            f"with --served-model-name {want} (or fix the config)")
        source = getattr(model, "source_dir", None)
        if source is None:
            raise VLLMError("the trained model was not loaded from a directory, so the base model vLLM must serve "
                            "cannot be checked; set rollout.vllm.served_model_name")
        source = Path(source).resolve()
        for m in bases:
            root = m.get("root") or m.get("id")
            if root and Path(root).resolve() == source:
                return m["id"]
        raise VLLMError(f"{url} serves {listing}, but this run trains {str(source)!r}: the server must serve the "
                        f"same base model (restart it with --model {source}, e.g. via scripts/serve_vllm.py), or set "
                        f"rollout.vllm.served_model_name if it loads the same weights under another name")

    # ------------------------------------------------------------------ weight sync
    def sync_weights(self, model, version: int) -> None:
        """Push ``model``'s weights to the server as ``version`` (see the module docstring); records the
        wall time in :attr:`last_sync_seconds`."""
        t0 = time.perf_counter()
        version = int(version)
        with self._sync_lock:
            if self.sync_mode == "lora":
                name = self._sync_lora(model, version)
            else:
                name = self._sync_full(model, version)
            self._reset_prefix_cache()
            with self._state_lock:  # new requests go to the new weights, tagged with their version
                self.current_name, self.version = name, version
            if self.sync_mode == "lora":
                self._unload_old_adapters()
        self.last_sync_seconds = time.perf_counter() - t0

    @property
    def sync_metrics(self) -> dict[str, float]:
        """``time/sync`` (seconds of the last sync) and ``sync/version`` (the version served now)."""
        return {"time/sync": float(self.last_sync_seconds), "sync/version": float(self.version)}

    def adapter_name(self, version: int) -> str:
        """The name version ``version`` of this engine's adapter is served under."""
        return f"{self.tag}-v{version}"

    def _load_adapter(self, name: str, path: Path) -> None:
        body = {"lora_name": name, "lora_path": str(path)}
        try:
            self.client.post("/v1/load_lora_adapter", body)
        except VLLMRequestError as e:
            if e.status == 404:
                raise VLLMError(
                    f"{self.config.base_url} has no /v1/load_lora_adapter route: start the server with --enable-lora "
                    f"and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (scripts/serve_vllm.py does both)") from e
            if e.status == 400 and "already been loaded" in e.detail:
                self.client.post("/v1/load_lora_adapter", {**body, "load_inplace": True})
            else:
                raise VLLMError(f"vLLM could not load the adapter {path} as {name!r}: {e.detail}; check "
                                f"--max-lora-rank (>= lora.rank) and --max-loras (>= keep_versions="
                                f"{self.keep_versions})") from e

    def _sync_lora(self, model, version: int) -> str:
        """Export and load the adapter of ``version``; returns its served name."""
        path = self.sync_dir / f"lora-v{version}"
        save_peft_adapter(model, path, dtype=self.config.adapter_dtype)
        name = self.adapter_name(version)
        self._load_adapter(name, path)
        with self._state_lock:
            self._adapters = [a for a in self._adapters if a[0] != version] + [(version, name, path)]
        return name

    def _unload_old_adapters(self) -> None:
        """Unload and delete all but the newest ``keep_versions`` adapters."""
        with self._state_lock:
            old = self._adapters[:-self.keep_versions]
            self._adapters = self._adapters[-self.keep_versions:]
        for _, old_name, old_path in old:
            try:
                self.client.post("/v1/unload_lora_adapter", {"lora_name": old_name})
            except VLLMRequestError as e:
                if e.status != 404:  # 404: already gone (e.g. the server restarted)
                    raise
            shutil.rmtree(old_path, ignore_errors=True)

    def _reload_full(self, path: Path) -> None:
        try:
            self.client.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        except VLLMRequestError as e:
            hint = ("start the server with VLLM_SERVER_DEV_MODE=1 (scripts/serve_vllm.py does)" if e.status == 404
                    else "check the server log")
            raise VLLMError(f"vLLM could not reload the weights from {path}: {e.detail}; {hint}") from e

    def _sync_full(self, model, version: int) -> str:
        """Export the checkpoint of ``version`` and reload the server's weights from it; returns the base name."""
        path = self.sync_dir / f"full-v{version}"
        dtype = self.config.dtype if self.config.dtype != "auto" else None
        save_pretrained(model, path, dtype=dtype, progress=False)
        self._reload_full(path)
        with self._state_lock:
            old, self._full_dir = self._full_dir, path
        if old is not None and old != path:
            shutil.rmtree(old, ignore_errors=True)
        return self.base_name

    def _restore(self) -> None:
        """Put the current weights back on a server that restarted (called after a reconnect)."""
        with self._state_lock:
            full_dir, adapters = self._full_dir, list(self._adapters)
        if self.sync_mode == "full":
            if full_dir is not None:
                self._reload_full(full_dir)
        else:
            served = {m.get("id") for m in self.client.get("/v1/models", retry=False).get("data") or []}
            for _, name, path in adapters:
                if name not in served:
                    self._load_adapter(name, path)
        self._reset_prefix_cache(retry=False)

    def _reset_prefix_cache(self, *, retry: bool = True) -> None:
        """Drop KV blocks computed with earlier weights (vLLM serves this route only in dev mode)."""
        try:
            self.client.post("/reset_prefix_cache", retry=retry)
        except VLLMRequestError as e:
            if e.status == 404:
                raise VLLMError(f"{self.config.base_url} has no /reset_prefix_cache route: start the server with "
                                f"VLLM_SERVER_DEV_MODE=1 (scripts/serve_vllm.py does)") from e
            raise

    # ------------------------------------------------------------------ generation
    def _complete(self, body: dict) -> dict:
        try:
            return self.client.post("/v1/completions", body)
        except VLLMRequestError as e:
            if e.status != 404 or body["model"] == self.base_name:
                raise
        # The adapter is not served (a server restarted between requests): restore it, then retry once.
        self._restore()
        return self.client.post("/v1/completions", body)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, num_generations: int,
                 seed: int) -> RolloutBatch:
        """``num_generations`` completions per prompt (rows ``p*G .. p*G+G-1``) with the server's sampled-token
        logprobs; reproducible for a ``seed`` on the same server and weights."""
        check_generate_args(prompt_ids, num_generations)
        g = int(num_generations)
        with self._state_lock:
            name, version = self.current_name, self.version
        bodies = [completion_request(name, p, params, n=g, seed=prompt_seed(seed, i)) for i, p in enumerate(prompt_ids)]
        url = f"{self.config.base_url}/v1/completions"
        answers = list(self._pool.map(self._complete, bodies))
        rows = [row for answer in answers for row in parse_choices(answer, n=g, url=url)]
        t = max(max((len(ids) for ids, _, _ in rows), default=0), 1)
        if t > params.max_new_tokens:
            raise VLLMError(f"{url} returned {t} tokens, more than max_tokens={params.max_new_tokens}")
        n = len(rows)
        completion_ids = np.full((n, t), self.pad_id, np.int32)
        completion_mask = np.zeros((n, t), np.int32)
        logprobs = np.zeros((n, t), np.float32)
        truncated = np.zeros((n,), bool)
        for r, (ids, lps, stopped) in enumerate(rows):
            completion_ids[r, :len(ids)] = ids
            completion_mask[r, :len(ids)] = 1
            logprobs[r, :len(ids)] = lps
            truncated[r] = not stopped
        p_ids, p_mask = left_pad([list(p) for p in prompt_ids for _ in range(g)], self.pad_id)
        return RolloutBatch(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=completion_ids,
                            completion_mask=completion_mask, sampling_logprobs=logprobs, truncated=truncated,
                            policy_version=version)

    def close(self) -> None:
        """Stop the request threads (the server keeps running; it is not this engine's process)."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def make_vllm_engine(model, *, tokenizer=None, mesh=None, rules=None, rollout, output_dir) -> VLLMRolloutEngine:
    """The ``vllm`` entry of the trainer's backend registry: an engine for ``rollout`` (a
    :class:`jrl.train.config.RolloutConfig`), writing syncs under ``rollout.vllm.sync_dir`` or
    ``<output_dir>/vllm_sync``."""
    cfg: VLLMConfig = rollout.vllm
    keep = cfg.keep_versions if cfg.keep_versions is not None else rollout.max_staleness + 1
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        pad = model.config.pad_token_id
    sync_dir = cfg.sync_dir if cfg.sync_dir is not None else Path(output_dir) / "vllm_sync"
    return VLLMRolloutEngine(model, config=cfg, sync=rollout.sync, sync_dir=sync_dir, keep_versions=keep,
                             pad_id=int(pad))
