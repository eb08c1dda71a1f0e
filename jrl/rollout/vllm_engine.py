"""The ``vllm`` rollout backend: completions from an external vLLM server's OpenAI-compatible API.

Generation: one ``POST /v1/completions`` per prompt (token-id prompt, ``n`` = num_generations, a seed
derived from the call's seed and the prompt index), sent concurrently; ``return_token_ids`` makes the
server return the sampled token ids, so nothing is re-tokenised, and ``logprobs=0`` returns each sampled
token's log-probability. The server must run with ``--logprobs-mode processed_logprobs`` (as
``scripts/serve_vllm.py`` starts it) so that log-probability is taken under the distribution actually
sampled from (temperature, top-k, top-p applied), the same quantity :mod:`jrl.rollout.sampling` reports.

Weight sync: the transport named by ``rollout.sync`` (:mod:`jrl.rollout.weight_sync`: LoRA adapter
hot-load, full checkpoints through the filesystem, shared memory or an asynchronous writer) delivers
each version; the engine resets the prefix cache and sends new requests to the name the transport
returns once that version is served.

If the server goes away mid-run (connection refused) the engine waits for ``/health`` (at most
``restart_timeout``), restores the current weights on it (reloads the adapter, or the full checkpoint)
and retries the request, so no step is lost.

Several servers (``rollout.vllm.base_urls``): :class:`MultiServerEngine` keeps one :class:`VLLMRolloutEngine` per
server (each with its own weight transport, writing under ``<sync_dir>/server-<k>``) and sends each prompt's request
to the server with the fewest requests in flight. A server that stops answering is not waited for: its requests go
to the others and it is skipped; before each generation and sync the engine asks the skipped servers for
``/health`` and gives one that answers the current weights (a host copy of a version it missed is kept while any
server is down). Sampling seeds depend on the prompt's index, not the server, so which server answered does not
change what was sampled from.

A run of several trainer processes: process 0 alone drives the servers and shares each batch
(:class:`~jrl.rollout.leader.LeaderEngine`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import jax
import numpy as np

from jrl.data.pipeline import left_pad
from jrl.rollout.base import ROLLOUT_ENGINES, RolloutBatch, SamplingParams, check_generate_args
from jrl.rollout.leader import LeaderEngine
from jrl.rollout.vllm_config import VLLMConfig
from jrl.rollout.vllm_http import VLLMClient, VLLMError, VLLMRequestError, VLLMUnavailableError
from jrl.rollout.weight_sync import WEIGHT_TRANSPORTS, model_transport, reset_prefix_cache
from jrl.sharding.placement import host_copy

logger = logging.getLogger(__name__)


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


def assemble_rollout(answers: list[dict], prompt_ids: list[list[int]], params: SamplingParams, *, n: int, pad_id: int,
                     version: int, url: str) -> RolloutBatch:
    """The :class:`RolloutBatch` of the completions answers of ``prompt_ids`` (``n`` choices each, in prompt order)."""
    rows = [row for answer in answers for row in parse_choices(answer, n=n, url=url)]
    t = max(max((len(ids) for ids, _, _ in rows), default=0), 1)
    if t > params.max_new_tokens:
        raise VLLMError(f"{url} returned {t} tokens, more than max_tokens={params.max_new_tokens}")
    completion_ids = np.full((len(rows), t), pad_id, np.int32)
    completion_mask = np.zeros((len(rows), t), np.int32)
    logprobs = np.zeros((len(rows), t), np.float32)
    truncated = np.zeros((len(rows),), bool)
    for r, (ids, lps, stopped) in enumerate(rows):
        completion_ids[r, :len(ids)] = ids
        completion_mask[r, :len(ids)] = 1
        logprobs[r, :len(ids)] = lps
        truncated[r] = not stopped
    p_ids, p_mask = left_pad([list(p) for p in prompt_ids for _ in range(n)], pad_id)
    return RolloutBatch(prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=completion_ids,
                        completion_mask=completion_mask, sampling_logprobs=logprobs, truncated=truncated,
                        policy_version=version)


def refuse_cpu_moe(device: str, model_config) -> None:
    """Refuse a vLLM CPU server for a MoE model (``model_config``: its :class:`~jrl.models.ModelConfig`): vLLM 0.32's
    CPU build serves wrong log-probs after reloading a MoE checkpoint's weights and dies with LoRA enabled."""
    if device == "cpu" and model_config.is_moe:
        raise ValueError(
            "VLLMConfig.device='cpu' cannot sample a MoE model: vLLM 0.32's CPU build serves wrong log-probs after "
            "reloading a MoE checkpoint's weights (every sync, the first included) and dies at the first request "
            "with LoRA enabled; use the embedded sampler (rollout.backend='jax') or a GPU vLLM server "
            "(rollout.vllm.device='gpu')")


class VLLMRolloutEngine:
    """:class:`~jrl.rollout.base.RolloutEngine` over a running vLLM server.

    ``model``: the policy being trained (its weights are delivered on :meth:`sync_weights`; the constructor
    delivers them once as version 0). ``config``: server address, timeouts, retries (:class:`VLLMConfig`).
    ``sync``: a :data:`~jrl.rollout.weight_sync.WEIGHT_TRANSPORTS` name or ``auto``. ``sync_dir``: where
    adapters/checkpoints are written (the server must be able to read it). ``keep_versions``: adapter
    versions kept loaded. ``pad_id``: the id filling prompt and completion padding. ``base_url``: the server (default:
    the first of ``config.base_urls``). ``wait_for_restart=False`` fails a request to a server that stops answering
    after its retries instead of waiting ``restart_timeout`` for it (:class:`MultiServerEngine` sends it elsewhere).

    The constructor waits for ``/health`` (``startup_timeout``) and checks that ``/v1/models`` serves the
    trained base model; both fail with errors naming the URL and the fix.
    """

    #: A server process: the weights it samples are its own copy.
    shares_trainer_devices = False
    capabilities = frozenset()

    def __init__(self, model, *, config: VLLMConfig, sync: str = "auto", sync_dir: str | os.PathLike,
                 keep_versions: int = 2, pad_id: int, base_url: str | None = None, wait_for_restart: bool = True):
        refuse_cpu_moe(config.device, model.config)
        self.config = config
        self.base_url = base_url if base_url is not None else config.base_urls[0]
        self.sync_mode = model_transport(sync, model)
        if keep_versions < 1:
            raise ValueError(f"VLLMRolloutEngine keep_versions={keep_versions} must be >= 1")
        self.pad_id = int(pad_id)
        restart_timeout = config.restart_timeout if wait_for_restart else config.connect_timeout
        self.client = VLLMClient(self.base_url, api_key=config.api_key, connect_timeout=config.connect_timeout,
                                 read_timeout=config.read_timeout, max_retries=config.max_retries,
                                 backoff_seconds=config.backoff_seconds, restart_timeout=restart_timeout,
                                 on_reconnect=self.restore)
        # _sync_lock serialises syncs; _state_lock guards the served name and version and is never held across a
        # request, so a restore triggered from any thread cannot deadlock.
        self._sync_lock = threading.Lock()
        self._state_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(config.max_concurrent_requests, thread_name_prefix="jrl-vllm")
        self.tag = f"jrl-{uuid.uuid4().hex[:8]}"  # adapter names of this engine never clash with another run's
        self.version = 0
        self.last_sync_seconds = float("nan")
        self._pending: tuple[Future, int, float] | None = None  # (delivery, version, start time)
        self.client.wait_healthy(config.startup_timeout)
        self.base_name = self._check_base_model(model)
        self.current_name = self.base_name
        self.transport = WEIGHT_TRANSPORTS.get(self.sync_mode)(
            self.client, config, sync_dir=Path(sync_dir).resolve(), base_name=self.base_name, tag=self.tag,
            keep_versions=keep_versions)
        self.sync_weights(model, 0)

    # ------------------------------------------------------------------ startup checks
    def _check_base_model(self, model) -> str:
        """The name the server serves the trained base model under (an error if it serves another)."""
        served = self.client.get("/v1/models").get("data") or []
        bases = [m for m in served if not m.get("parent")]
        url = f"{self.base_url}/v1/models"
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
        """Deliver ``model``'s weights as ``version`` through the transport. A synchronous transport is done
        when this returns; an asynchronous one finishes in the background and the next :meth:`generate`
        waits for it. :attr:`last_sync_seconds` is the wall time until the version was served."""
        with self._sync_lock:
            self._finish_sync()  # versions are served in order
            self._pending = (self.transport.send(model, int(version)), int(version), time.perf_counter())
            if self._pending[0].done():
                self._finish_sync()

    def _finish_sync(self) -> None:
        """Wait for the pending delivery (if any), then serve it: reset the prefix cache, switch new requests
        to its name and version, retire versions nobody needs."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        delivery, version, t0 = pending
        name = delivery.result()
        reset_prefix_cache(self.client)
        with self._state_lock:
            self.current_name, self.version = name, version
        self.transport.retire_old()
        self.last_sync_seconds = time.perf_counter() - t0

    @property
    def sync_metrics(self) -> dict[str, float]:
        """``time/sync`` (seconds of the last sync) and ``sync/version`` (the version served now)."""
        return {"time/sync": float(self.last_sync_seconds), "sync/version": float(self.version)}

    def adapter_name(self, version: int) -> str:
        """The name version ``version`` of this engine's adapter is served under (``lora`` transport)."""
        return self.transport.adapter_name(version)

    def restore(self) -> None:
        """Put the current weights back on a server that restarted (called after a reconnect)."""
        self.transport.restore()
        reset_prefix_cache(self.client, retry=False)

    # ------------------------------------------------------------------ generation
    def complete(self, body: dict) -> dict:
        """The answer of one ``/v1/completions`` request (an adapter the server lost is restored first)."""
        try:
            return self.client.post("/v1/completions", body)
        except VLLMRequestError as e:
            if e.status != 404 or body["model"] == self.base_name:
                raise
        # The adapter is not served (a server restarted between requests): restore it, then retry once.
        self.restore()
        return self.client.post("/v1/completions", body)

    def serving(self) -> tuple[str, int]:
        """(the name requests ask for, its version) once a pending sync is served."""
        with self._sync_lock:
            self._finish_sync()
        with self._state_lock:
            return self.current_name, self.version

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, num_generations: int,
                 seed: int) -> RolloutBatch:
        """``num_generations`` completions per prompt (rows ``p*G .. p*G+G-1``) with the server's sampled-token
        logprobs; reproducible for a ``seed`` on the same server and weights."""
        check_generate_args(prompt_ids, num_generations)
        g = int(num_generations)
        name, version = self.serving()
        bodies = [completion_request(name, p, params, n=g, seed=prompt_seed(seed, i)) for i, p in enumerate(prompt_ids)]
        answers = list(self._pool.map(self.complete, bodies))
        return assemble_rollout(answers, prompt_ids, params, n=g, pad_id=self.pad_id, version=version,
                                url=f"{self.base_url}/v1/completions")

    def close(self) -> None:
        """Finish a pending sync and stop the request threads (the server keeps running; it is not this
        engine's process)."""
        with self._sync_lock:
            self._finish_sync()
        self.transport.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


class MultiServerEngine:
    """:class:`~jrl.rollout.base.RolloutEngine` over several vLLM servers (see the module docstring): ``servers``
    are their engines (built with ``wait_for_restart=False``), each already holding version 0."""

    #: A server process: the weights it samples are its own copy.
    shares_trainer_devices = False
    capabilities = frozenset()

    def __init__(self, servers: list[VLLMRolloutEngine], *, max_concurrent_requests: int, pad_id: int):
        self.servers, self.pad_id = list(servers), int(pad_id)
        self.up = [True] * len(self.servers)
        self.requests = [0] * len(self.servers)  # requests each server answered
        self._in_flight = [0] * len(self.servers)
        self._lock = threading.Lock()  # guards up / requests / in-flight counts; never held across a request
        self._sync_lock = threading.Lock()  # a sync and the start of a generate (revival, names) do not interleave
        self._pool = ThreadPoolExecutor(max_concurrent_requests * len(self.servers), thread_name_prefix="jrl-vllm")
        self.version = 0
        self._missed = None  # host copy of the current weights while a server is down (it missed a sync)

    @property
    def urls(self) -> list[str]:
        return [s.base_url for s in self.servers]

    def _down(self, k: int, error: Exception) -> None:
        with self._lock:
            was_up, self.up[k] = self.up[k], False
        if was_up:
            logger.warning("vLLM server %s stopped answering (%s); its requests go to the other servers until it "
                           "answers again", self.servers[k].base_url, error)

    def _use_again(self, k: int) -> None:
        with self._lock:
            self.up[k] = True
        logger.info("vLLM server %s answers again: synced to version %d", self.servers[k].base_url, self.version)

    def _revive(self) -> None:
        """Give every down server that answers ``/health`` again the current weights (those it still holds, or the
        host copy of a version it missed), and use it again."""
        for k, server in enumerate(self.servers):
            if self.up[k] or (server.version != self.version and self._missed is None) or not server.client.healthy():
                continue
            try:
                if server.version != self.version:
                    server.sync_weights(self._missed, self.version)
                    server.serving()
                else:
                    server.restore()
            except VLLMUnavailableError:
                continue
            self._use_again(k)
        if all(self.up):
            self._missed = None

    def sync_weights(self, model, version: int) -> None:
        """Deliver ``model`` as ``version`` to every server that answers (see the module docstring); a generate call
        already running keeps the names it started with."""
        with self._sync_lock:
            self._sync(model, int(version))

    def _sync(self, model, version: int) -> None:
        self.version = version
        for k, server in enumerate(self.servers):
            if not self.up[k] and not server.client.healthy():
                continue
            try:
                server.sync_weights(model, version)
            except VLLMUnavailableError as e:
                self._down(k, e)
                continue
            if not self.up[k]:
                self._use_again(k)
        self._missed = None
        if not all(self.up):  # a server that comes back before the next sync needs this version
            self._missed = host_copy(model)  # the model's arrays may change

    def _pick(self, names: dict[int, str], tried: set[int]) -> int:
        with self._lock:
            live = [k for k in names if self.up[k] and k not in tried]
            if not live:
                raise VLLMUnavailableError(
                    f"no vLLM server of rollout.vllm.base_urls answers ({', '.join(self.urls)}); start them "
                    "(scripts/serve_vllm.py --server-index K) or check the addresses")
            k = min(live, key=lambda i: self._in_flight[i])
            self._in_flight[k] += 1
        return k

    def _request(self, names: dict[int, str], prompt: list[int], params: SamplingParams, n: int, seed: int) -> dict:
        """One prompt's answer from a server of ``names`` (server → the name its version is served under)."""
        tried: set[int] = set()
        while True:
            k = self._pick(names, tried)
            try:
                answer = self.servers[k].complete(completion_request(names[k], prompt, params, n=n, seed=seed))
            except VLLMUnavailableError as e:
                self._down(k, e)
                tried.add(k)
                continue
            finally:
                with self._lock:
                    self._in_flight[k] -= 1
            with self._lock:
                self.requests[k] += 1
            return answer

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, num_generations: int,
                 seed: int) -> RolloutBatch:
        """As :meth:`VLLMRolloutEngine.generate`, each prompt's request on the least busy server that answers."""
        check_generate_args(prompt_ids, num_generations)
        g = int(num_generations)
        with self._sync_lock:
            self._revive()
            version, names = self.version, {}
            for k, server in enumerate(self.servers):
                if self.up[k]:
                    try:
                        names[k], served = server.serving()
                    except VLLMUnavailableError as e:
                        self._down(k, e)
                        continue
                    if served != version:
                        raise VLLMError(f"{server.base_url} serves version {served}, the engine is at {version}")
        answers = list(self._pool.map(lambda ip: self._request(names, ip[1], params, g, prompt_seed(seed, ip[0])),
                                      enumerate(prompt_ids)))
        return assemble_rollout(answers, prompt_ids, params, n=g, pad_id=self.pad_id, version=version,
                                url="rollout.vllm.base_urls")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        for server in self.servers:
            server.close()


@ROLLOUT_ENGINES.register("vllm")
def make_vllm_engine(model, *, pad_id: int, mesh, rules, rollout, output_dir, leader: bool = False):
    """The ``vllm`` backend: an engine for the run's ``rollout`` section (a
    :class:`~jrl.rollout.config.RolloutConfig`), writing syncs under ``rollout.vllm.sync_dir`` or
    ``<output_dir>/vllm_sync``. In a run of several processes a :class:`~jrl.rollout.leader.LeaderEngine`: process 0
    builds the engine (``leader``) and drives the servers for all of them."""
    del mesh, rules  # the server has its own devices
    if jax.process_count() > 1 and not leader:  # process 0 drives the servers and shares the batches
        build = functools.partial(make_vllm_engine, pad_id=pad_id, mesh=None, rules=None, rollout=rollout,
                                  output_dir=output_dir, leader=True)
        return LeaderEngine(build, model, adapters_only=model_transport(rollout.sync, model) == "lora")
    cfg: VLLMConfig = rollout.vllm
    keep = cfg.keep_versions if cfg.keep_versions is not None else rollout.max_staleness + 1
    sync_dir = Path(cfg.sync_dir if cfg.sync_dir is not None else Path(output_dir) / "vllm_sync")
    if len(cfg.base_urls) == 1:
        return VLLMRolloutEngine(model, config=cfg, sync=rollout.sync, sync_dir=sync_dir, keep_versions=keep,
                                 pad_id=pad_id)
    servers: list[VLLMRolloutEngine] = []
    try:
        for k, url in enumerate(cfg.base_urls):
            servers.append(VLLMRolloutEngine(model, config=cfg, sync=rollout.sync, sync_dir=sync_dir / f"server-{k}",
                                             keep_versions=keep, pad_id=pad_id, base_url=url, wait_for_restart=False))
    except BaseException:
        for server in servers:
            server.close()
        raise
    return MultiServerEngine(servers, max_concurrent_requests=cfg.max_concurrent_requests, pad_id=pad_id)


#: Config fields the vLLM engine does not read (the servers have their own devices).
make_vllm_engine.ignores = ("rollout.devices", "rollout.mesh", "rollout.kv", "rollout.partial", "rollout.partial_kv")
make_vllm_engine.capabilities = VLLMRolloutEngine.capabilities
