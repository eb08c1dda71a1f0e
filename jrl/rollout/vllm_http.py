"""The JSON-over-HTTP client of a vLLM server, on ``httpx`` with a connection pool (requests reuse kept-alive
connections): separate connect and read timeouts, retries with exponential backoff on transient failures, a
bounded wait for ``/health``, and a hook that runs once when a server that went away answers again (so the caller
can re-sync its weights)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx

#: HTTP statuses worth retrying: the server is up but overloaded or failing transiently.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
#: Seconds an idle pooled connection is kept: under the 5 s after which vLLM's server (uvicorn) closes it, so a
#: request never goes out on a connection the server is closing.
KEEPALIVE_SECONDS = 4.0


class VLLMError(RuntimeError):
    """A vLLM server request that failed for good."""


class VLLMUnavailableError(VLLMError):
    """The server did not answer (or not healthily) within the configured time."""


class VLLMRequestError(VLLMError):
    """The server answered with an HTTP error that retrying does not fix."""

    def __init__(self, message: str, *, status: int, detail: str):
        super().__init__(message)
        self.status = status
        self.detail = detail


class _Transient(Exception):
    """One failed attempt that may succeed when retried; ``unreachable``: no HTTP answer at all."""

    def __init__(self, message: str, *, unreachable: bool):
        super().__init__(message)
        self.unreachable = unreachable


def error_detail(body: bytes) -> str:
    """The message of a vLLM/OpenAI error body (``{"error": {"message": ...}}``), else the raw text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500]
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:500]
        return str(err)[:500]
    return text[:500]


class VLLMClient:
    """JSON requests to the server at ``base_url``.

    A request is retried up to ``max_retries`` times after a transient failure (no connection, a
    timeout, HTTP 429/5xx), sleeping ``backoff_seconds * 2**attempt`` in between. When the server does
    not answer at all, the client first waits (at most ``restart_timeout`` seconds) until ``/health``
    answers 200 again and then calls ``on_reconnect()`` once for all threads that saw the failure, so
    the engine can restore the weights a restarted server lost before the request is retried.
    """

    def __init__(self, base_url: str, *, api_key: str | None = None, connect_timeout: float = 5.0,
                 read_timeout: float = 600.0, max_retries: int = 4, backoff_seconds: float = 0.5,
                 restart_timeout: float = 300.0, on_reconnect: Callable[[], None] | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"vLLM base_url={base_url!r} is not an http(s) URL; use e.g. http://127.0.0.1:8000")
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.connect_timeout = float(connect_timeout)
        self.read_timeout = float(read_timeout)
        self.max_retries = int(max_retries)
        self.backoff_seconds = float(backoff_seconds)
        self.restart_timeout = float(restart_timeout)
        self.on_reconnect = on_reconnect
        self._sleep = sleep
        self._recover_lock = threading.RLock()
        self._epoch = 0  # bumped after every recovery, so concurrent failures recover once
        self.reconnects = 0
        headers = {"Accept": "application/json"} | ({"Authorization": f"Bearer {api_key}"} if api_key else {})
        self._http = httpx.Client(headers=headers, limits=httpx.Limits(keepalive_expiry=KEEPALIVE_SECONDS),
                                  trust_env=False)

    # ------------------------------------------------------------------ one attempt
    def _once(self, method: str, path: str, body, read_timeout: float | None):
        url = self.base_url + path
        wait = read_timeout or self.read_timeout
        try:
            resp = self._http.request(method, url, json=body, timeout=httpx.Timeout(wait, connect=self.connect_timeout))
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # refused, unreachable, DNS, connect timeout
            raise _Transient(f"cannot connect to {url}: {e}", unreachable=True) from e
        except httpx.TimeoutException as e:
            raise _Transient(f"{method} {url} got no answer within {wait:g} s (read timeout)", unreachable=False) from e
        except httpx.TransportError as e:  # the server died mid-request
            raise _Transient(f"{method} {url}: connection lost ({e!r})", unreachable=True) from e
        data = resp.content
        if resp.status_code in RETRY_STATUSES:
            raise _Transient(f"{method} {url} answered HTTP {resp.status_code}: {error_detail(data)}",
                             unreachable=False)
        if resp.status_code >= 400:
            detail = error_detail(data)
            raise VLLMRequestError(f"{method} {url} answered HTTP {resp.status_code}: {detail}",
                                   status=resp.status_code, detail=detail)
        if not data:
            return None
        try:
            return json.loads(data)
        except ValueError:
            return data.decode("utf-8", "replace")

    # ------------------------------------------------------------------ public
    def request(self, method: str, path: str, body=None, *, retry: bool = True, read_timeout: float | None = None):
        """The decoded JSON answer of ``method path`` (text if not JSON, None if empty)."""
        attempts = self.max_retries + 1 if retry else 1
        epoch = self._epoch
        last: _Transient | None = None
        for attempt in range(attempts):
            try:
                return self._once(method, path, body, read_timeout)
            except _Transient as e:
                last = e
                if attempt + 1 == attempts:
                    break
                if e.unreachable:
                    self._recover(epoch)
                    epoch = self._epoch
                self._sleep(self.backoff_seconds * 2 ** attempt)
        raise VLLMUnavailableError(
            f"{last} (after {attempts} attempt{'s' if attempts > 1 else ''}); check that the vLLM server at "
            f"{self.base_url} is running and healthy (scripts/serve_vllm.py starts one), or raise "
            f"rollout.vllm.max_retries / read_timeout")

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)

    def post(self, path: str, body=None, **kw):
        return self.request("POST", path, body if body is not None else {}, **kw)

    def healthy(self) -> bool:
        """Whether ``/health`` answers 200 right now (one attempt, no retry)."""
        try:
            self._once("GET", "/health", None, self.connect_timeout)
            return True
        except (_Transient, VLLMRequestError):
            return False

    def wait_healthy(self, timeout: float, *, poll: float = 0.5) -> float:
        """Block until ``/health`` answers 200; returns the seconds waited. Raises
        :class:`VLLMUnavailableError` naming the URL and the fix after ``timeout`` seconds."""
        t0 = time.monotonic()
        while True:
            if self.healthy():
                return time.monotonic() - t0
            if time.monotonic() - t0 >= timeout:
                raise VLLMUnavailableError(
                    f"no healthy vLLM server at {self.base_url} (GET {self.base_url}/health) after {timeout:g} s; "
                    f"start one for this config with `python scripts/serve_vllm.py --config CONFIG` (or check "
                    f"rollout.vllm.base_urls), or raise rollout.vllm.startup_timeout / restart_timeout")
            self._sleep(poll)

    def _recover(self, epoch: int) -> None:
        """Wait for a server that stopped answering and run ``on_reconnect`` once per outage."""
        with self._recover_lock:
            if self._epoch != epoch:  # another thread already waited and re-synced
                return
            self.wait_healthy(self.restart_timeout)
            self._epoch += 1
            self.reconnects += 1
            if self.on_reconnect is not None:
                try:
                    self.on_reconnect()
                except VLLMUnavailableError:
                    pass  # the server went away again: the caller's next attempt waits once more

    def close(self) -> None:
        """Close the pooled connections."""
        self._http.close()
