"""How trained weights reach a vLLM server: pluggable weight-sync transports behind one interface.

A :class:`WeightTransport` delivers one version of the policy's weights and names what requests must
ask for to be served by it (an adapter name, or the base model after an in-place reload). The engine
(:class:`~jrl.rollout.vllm_engine.VLLMRolloutEngine`) only says *when* to sync; the transport says *how*:

- ``lora``: the LoRA adapters as a PEFT directory ``<sync_dir>/lora-v{N}``, hot-loaded with
  ``POST /v1/load_lora_adapter`` under a name of this run and version; the newest ``keep_versions`` stay
  loaded (requests in flight finish under their own version), older ones are unloaded and deleted.
- ``filesystem``: the whole model (LoRA adapters merged) as a Hugging Face checkpoint ``<sync_dir>/full-v{N}``,
  reloaded in place (``POST /collective_rpc`` ``reload_weights``; the server needs ``VLLM_SERVER_DEV_MODE=1``); the
  previous checkpoint is deleted.
- ``shared_memory``: as ``filesystem``, but written under ``/dev/shm`` (RAM-backed), so neither side
  touches a disk; for a server on the same host.
- ``async_filesystem``: as ``filesystem``, but :meth:`~WeightTransport.send` only copies the weights to
  host memory and returns; writing and reloading run in a background thread while the trainer goes on
  (prime-rl's asynchronous weight broadcast). The engine waits for the pending version before it next
  generates, so every batch is still sampled from, and tagged with, the version it asked for.

Every transport can :meth:`~WeightTransport.restore` its current version on a server that restarted.
Transports register in :data:`WEIGHT_TRANSPORTS` (the ``rollout.sync`` field), so a new one (NCCL
broadcast into the server's workers) is one registered class.
"""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol


from jrl.models import save_peft_adapter, save_pretrained
from jrl.models.lora import has_lora, has_moe_lora, merge_lora
from jrl.registry import Registry
from jrl.rollout.vllm_config import VLLMConfig
from jrl.rollout.vllm_http import VLLMClient, VLLMError, VLLMRequestError
from jrl.sharding.placement import host_copy

#: ``rollout.sync`` values besides the registered transports: ``auto`` picks ``lora`` for a LoRA run,
#: else ``filesystem``.
AUTO = "auto"

#: Shared-memory root (a tmpfs on Linux).
SHM_ROOT = Path("/dev/shm")


class WeightTransport(Protocol):
    """Delivers versions of the trained weights to a vLLM server."""

    def send(self, model, version: int) -> Future:
        """Start delivering ``model``'s weights as ``version``; the future's result is the name requests for
        that version use. ``model``'s arrays may change once this returns (anything still needed is copied)."""
        ...

    def retire_old(self) -> None:
        """Release versions new requests no longer use (called once a newly sent version is served)."""
        ...

    def restore(self) -> None:
        """Deliver the last completed version again (the server restarted and lost it)."""
        ...

    def close(self) -> None:
        """Wait for pending work and release the transport's resources."""
        ...


#: ``rollout.sync`` name → transport class ``(client, config, *, sync_dir, base_name, tag, keep_versions)``.
WEIGHT_TRANSPORTS = Registry("weight transport", "rollout.sync", how_to_register="@WEIGHT_TRANSPORTS.register(name)")


def resolve_transport(sync: str, *, lora: bool, moe_lora: bool) -> str:
    """The transport name of ``rollout.sync`` for a run with LoRA adapters (``lora``), some of them on MoE layers'
    experts or routers (``moe_lora``, ``lora.target_parameters``): ``auto`` → ``lora`` for adapters on Linear
    projections only, else ``filesystem`` (the full model, adapters merged); ``lora`` needs adapters, none of them
    on MoE parameters (vLLM 0.32's CPU build applies no LoRA to fused-MoE layers)."""
    if sync == AUTO:
        return "lora" if lora and not moe_lora else "filesystem"
    if sync not in WEIGHT_TRANSPORTS:
        raise ValueError(f"RolloutConfig.sync={sync!r} is invalid: use one of {(AUTO,) + WEIGHT_TRANSPORTS.names()}")
    if sync == "lora" and not lora:
        raise ValueError("RolloutConfig.sync='lora' needs a LoRA run (set TrainConfig.lora), or use sync='filesystem'")
    if sync == "lora" and moe_lora:
        raise ValueError("RolloutConfig.sync='lora' cannot send LoRA on MoE parameters (lora.target_parameters): "
                         "vLLM's CPU build applies no LoRA to fused-MoE layers; use sync='auto' or 'filesystem' "
                         "(the adapters merged into full weights)")
    return sync


def model_transport(sync: str, model) -> str:
    """:func:`resolve_transport` for the adapters ``model`` carries."""
    return resolve_transport(sync, lora=has_lora(model), moe_lora=has_moe_lora(model))


def _done(value) -> Future:
    f: Future = Future()
    f.set_result(value)
    return f


def reset_prefix_cache(client: VLLMClient, *, retry: bool = True) -> None:
    """Drop KV blocks computed with earlier weights (vLLM serves this route only in dev mode)."""
    try:
        client.post("/reset_prefix_cache", retry=retry)
    except VLLMRequestError as e:
        if e.status == 404:
            raise VLLMError(f"{client.base_url} has no /reset_prefix_cache route: start the server with "
                            f"VLLM_SERVER_DEV_MODE=1 (scripts/serve_vllm.py does)") from e
        raise


@WEIGHT_TRANSPORTS.register("lora")
class LoRAAdapterTransport:
    """PEFT adapters hot-loaded by name (see the module docstring)."""

    def __init__(self, client: VLLMClient, config: VLLMConfig, *, sync_dir: Path, base_name: str, tag: str,
                 keep_versions: int):
        self.client, self.config, self.sync_dir, self.tag = client, config, Path(sync_dir), tag
        self.keep_versions = int(keep_versions)
        self._lock = threading.Lock()  # guards the adapter list; never held across a request
        self._adapters: list[tuple[int, str, Path]] = []  # (version, served name, dir), oldest first

    def adapter_name(self, version: int) -> str:
        """The name version ``version`` of this run's adapter is served under."""
        return f"{self.tag}-v{version}"

    def _load(self, name: str, path: Path) -> None:
        body = {"lora_name": name, "lora_path": str(path)}
        try:
            self.client.post("/v1/load_lora_adapter", body)
        except VLLMRequestError as e:
            if e.status == 404:
                raise VLLMError(
                    f"{self.client.base_url} has no /v1/load_lora_adapter route: start the server with --enable-lora "
                    f"and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (scripts/serve_vllm.py does both)") from e
            if e.status == 400 and "already been loaded" in e.detail:
                self.client.post("/v1/load_lora_adapter", {**body, "load_inplace": True})
            else:
                raise VLLMError(f"vLLM could not load the adapter {path} as {name!r}: {e.detail}; check "
                                f"--max-lora-rank (>= lora.rank) and --max-loras (>= keep_versions="
                                f"{self.keep_versions})") from e

    def send(self, model, version: int) -> Future:
        path = self.sync_dir / f"lora-v{version}"
        save_peft_adapter(model, path, dtype=self.config.adapter_dtype)
        name = self.adapter_name(version)
        self._load(name, path)
        with self._lock:
            self._adapters = [a for a in self._adapters if a[0] != version] + [(version, name, path)]
        return _done(name)

    def retire_old(self) -> None:
        """Unload and delete all but the newest ``keep_versions`` adapters (after requests moved on)."""
        with self._lock:
            old = self._adapters[:-self.keep_versions]
            self._adapters = self._adapters[-self.keep_versions:]
        for _, name, path in old:
            try:
                self.client.post("/v1/unload_lora_adapter", {"lora_name": name})
            except VLLMRequestError as e:
                if e.status != 404:  # 404: already gone (e.g. the server restarted)
                    raise
            shutil.rmtree(path, ignore_errors=True)

    def restore(self) -> None:
        with self._lock:
            adapters = list(self._adapters)
        served = {m.get("id") for m in self.client.get("/v1/models", retry=False).get("data") or []}
        for _, name, path in adapters:
            if name not in served:
                self._load(name, path)

    def close(self) -> None:
        pass


@WEIGHT_TRANSPORTS.register("filesystem")
class FilesystemTransport:
    """Full checkpoints written under a directory and reloaded in place (see the module docstring)."""

    def __init__(self, client: VLLMClient, config: VLLMConfig, *, sync_dir: Path, base_name: str, tag: str,
                 keep_versions: int):
        del keep_versions  # the server holds one full version
        self.client, self.config, self.root, self.base_name = client, config, Path(sync_dir), base_name
        self._lock = threading.Lock()
        self._current: Path | None = None

    def _reload(self, path: Path) -> None:
        try:
            self.client.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        except VLLMRequestError as e:
            hint = ("start the server with VLLM_SERVER_DEV_MODE=1 (scripts/serve_vllm.py does)" if e.status == 404
                    else "check the server log")
            raise VLLMError(f"vLLM could not reload the weights from {path}: {e.detail}; {hint}") from e

    def deliver(self, model, version: int) -> str:
        """Write ``model`` (adapters merged) as checkpoint ``version``, reload the server from it, delete the previous
        one."""
        path = self.root / f"full-v{version}"
        dtype = self.config.dtype if self.config.dtype != "auto" else None
        save_pretrained(merge_lora(model) if has_lora(model) else model, path, dtype=dtype, progress=False)
        self._reload(path)
        with self._lock:
            old, self._current = self._current, path
        if old is not None and old != path:
            shutil.rmtree(old, ignore_errors=True)
        return self.base_name

    def send(self, model, version: int) -> Future:
        return _done(self.deliver(model, version))

    def retire_old(self) -> None:
        pass  # deliver already deleted the previous checkpoint: the server holds one version

    def restore(self) -> None:
        with self._lock:
            current = self._current
        if current is not None:
            self._reload(current)

    def close(self) -> None:
        pass


@WEIGHT_TRANSPORTS.register("shared_memory")
class SharedMemoryTransport(FilesystemTransport):
    """:class:`FilesystemTransport` rooted in ``/dev/shm/<tag>``: RAM on both sides of a same-host server."""

    def __init__(self, client: VLLMClient, config: VLLMConfig, *, sync_dir: Path, base_name: str, tag: str,
                 keep_versions: int):
        if not SHM_ROOT.is_dir() or not os.access(SHM_ROOT, os.W_OK):
            raise VLLMError(f"RolloutConfig.sync='shared_memory' needs a writable {SHM_ROOT} (a Linux tmpfs); "
                            "use sync='filesystem' on this host")
        super().__init__(client, config, sync_dir=SHM_ROOT / tag, base_name=base_name, tag=tag,
                         keep_versions=keep_versions)

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)  # RAM is not a place to leave checkpoints behind


@WEIGHT_TRANSPORTS.register("async_filesystem")
class AsyncFilesystemTransport:
    """:class:`FilesystemTransport` whose writing and reloading run in a background thread (see the module
    docstring); :meth:`send` returns once the weights are copied to host memory."""

    def __init__(self, client: VLLMClient, config: VLLMConfig, *, sync_dir: Path, base_name: str, tag: str,
                 keep_versions: int):
        self.files = FilesystemTransport(client, config, sync_dir=sync_dir, base_name=base_name, tag=tag,
                                         keep_versions=keep_versions)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="jrl-weight-writer")  # one version at a time, in order

    def send(self, model, version: int) -> Future:
        host_model = host_copy(model)  # the trainer may donate its arrays next
        return self._writer.submit(self.files.deliver, host_model, version)

    def retire_old(self) -> None:
        self.files.retire_old()

    def restore(self) -> None:
        self.files.restore()

    def close(self) -> None:
        self._writer.shutdown(wait=True)
