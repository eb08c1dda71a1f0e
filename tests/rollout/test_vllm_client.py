"""The vLLM backend's pieces that need no vLLM: request bodies, answer parsing, retries with backoff against
a local endpoint that fails on purpose, the error for a server that is not there, the server command, the
config's validation and scripts/serve_vllm.py --dry-run."""

from __future__ import annotations

import http.server
import json
import threading
import time
from pathlib import Path

import pytest

from jrl.rollout import SamplingParams
from jrl.rollout.vllm_config import VLLMConfig
from jrl.rollout.vllm_engine import completion_request, parse_choices, prompt_seed
from jrl.rollout.vllm_http import VLLMClient, VLLMError, VLLMRequestError, VLLMUnavailableError
from jrl.rollout.vllm_server import VLLMServer, server_command, vllm_lora_rank


class _Scripted(http.server.BaseHTTPRequestHandler):
    """Answers each request with the next (status, body) of the server's script; records what it got."""

    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        self.server.seen.append((self.command, self.path, json.loads(self.rfile.read(n)) if n else None,
                                 self.headers.get("Authorization")))
        status, body = self.server.script.pop(0) if self.server.script else (200, {"ok": True})
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    server.script, server.seen = [], []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens there once the socket is closed


def test_completion_request_carries_ids_and_sampling():
    params = SamplingParams(max_new_tokens=7, temperature=0.6, top_p=0.9, top_k=5, stop_token_ids=(258, 10))
    body = completion_request("m-v3", [257, 49, 50], params, n=4, seed=11)
    assert body["model"] == "m-v3" and body["prompt"] == [257, 49, 50] and body["n"] == 4
    assert body["max_tokens"] == 7 and body["temperature"] == 0.6 and body["top_p"] == 0.9 and body["top_k"] == 5
    assert body["stop_token_ids"] == [258, 10] and body["logprobs"] == 0 and body["return_token_ids"] is True
    assert body["seed"] == 11
    assert "top_k" not in completion_request("m", [1], SamplingParams(), n=1, seed=0)
    json.dumps(body)  # plain JSON types only


def test_prompt_seeds_differ_per_prompt_and_are_stable():
    seeds = [prompt_seed(123, i) for i in range(50)]
    assert len(set(seeds)) == 50 and seeds == [prompt_seed(123, i) for i in range(50)]
    assert prompt_seed(124, 0) != prompt_seed(123, 0)
    assert all(0 <= s < 2**31 for s in seeds)


def test_parse_choices_orders_by_index_and_checks_fields():
    answer = {"choices": [
        {"index": 1, "token_ids": [5, 258], "logprobs": {"token_logprobs": [-0.5, -1.5]}, "finish_reason": "stop"},
        {"index": 0, "token_ids": [7, 8, 9], "logprobs": {"token_logprobs": [-1.0, -2.0, -3.0]},
         "finish_reason": "length"}]}
    rows = parse_choices(answer, n=2, url="U")
    assert rows == [([7, 8, 9], [-1.0, -2.0, -3.0], False), ([5, 258], [-0.5, -1.5], True)]
    with pytest.raises(VLLMError, match="3 choices for n=2"):
        parse_choices({"choices": answer["choices"] + answer["choices"][:1]}, n=2, url="U")
    with pytest.raises(VLLMError, match="return_token_ids"):
        parse_choices({"choices": [{"index": 0, "logprobs": {"token_logprobs": []}}]}, n=1, url="U")
    with pytest.raises(VLLMError, match="logprobs=0"):
        parse_choices({"choices": [{"index": 0, "token_ids": [1], "logprobs": None}]}, n=1, url="U")


def test_retries_transient_errors_with_exponential_backoff(scripted):
    scripted.script[:] = [(503, {"error": {"message": "busy"}}), (500, {"error": {"message": "boom"}}),
                          (200, {"answer": 42})]
    sleeps = []
    client = VLLMClient(f"http://127.0.0.1:{scripted.server_port}", api_key="k", max_retries=3, backoff_seconds=0.25,
                        sleep=sleeps.append)
    assert client.post("/v1/completions", {"x": 1}) == {"answer": 42}
    assert sleeps == [0.25, 0.5]
    assert [s[:3] for s in scripted.seen] == [("POST", "/v1/completions", {"x": 1})] * 3
    assert {s[3] for s in scripted.seen} == {"Bearer k"}


class _KeepAlive(_Scripted):
    """The scripted answers over HTTP/1.1 keep-alive (as vLLM's server), counting the TCP connections it accepts."""

    protocol_version = "HTTP/1.1"

    def setup(self):
        super().setup()
        self.server.connections += 1


def test_requests_reuse_one_kept_alive_connection():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive)
    server.script, server.seen, server.connections = [], [], 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client = VLLMClient(f"http://127.0.0.1:{server.server_port}")
    try:
        answers = [client.post("/v1/completions", {"i": i}) for i in range(5)] + [client.get("/v1/models")]
    finally:
        client.close()
        server.shutdown()
        server.server_close()
    assert answers == [{"ok": True}] * 6 and len(server.seen) == 6
    assert server.connections == 1


def test_gives_up_after_max_retries_naming_the_url(scripted):
    scripted.script[:] = [(503, {"error": {"message": "still loading"}})] * 5
    sleeps = []
    client = VLLMClient(f"http://127.0.0.1:{scripted.server_port}", max_retries=2, backoff_seconds=0.1,
                        sleep=sleeps.append)
    with pytest.raises(VLLMUnavailableError) as e:
        client.get("/v1/models")
    assert f"127.0.0.1:{scripted.server_port}/v1/models" in str(e.value) and "still loading" in str(e.value)
    assert "3 attempts" in str(e.value) and len(scripted.seen) == 3 and sleeps == [0.1, 0.2]


def test_client_errors_are_not_retried(scripted):
    scripted.script[:] = [(400, {"error": {"message": "max_tokens is too large", "code": 400}})]
    client = VLLMClient(f"http://127.0.0.1:{scripted.server_port}", max_retries=3, sleep=lambda s: None)
    with pytest.raises(VLLMRequestError) as e:
        client.post("/v1/completions", {})
    assert e.value.status == 400 and e.value.detail == "max_tokens is too large" and len(scripted.seen) == 1


def test_unreachable_server_fails_clearly_within_the_timeout():
    url = f"http://127.0.0.1:{_closed_port()}"
    client = VLLMClient(url, connect_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(VLLMUnavailableError) as e:
        client.wait_healthy(1.5, poll=0.1)
    elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < 4.0
    assert f"{url}/health" in str(e.value) and "serve_vllm.py" in str(e.value)


def test_engine_start_without_server_fails_within_startup_timeout():
    from jrl.models.lora import LoraConfig, apply_lora
    from jrl.rollout.vllm_engine import VLLMRolloutEngine
    from rollout_testlib import tiny_model

    model = apply_lora(tiny_model(), LoraConfig(rank=2))
    cfg = VLLMConfig(base_urls=(f"http://127.0.0.1:{_closed_port()}",), startup_timeout=1.0, connect_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(VLLMUnavailableError, match="no healthy vLLM server at http://127.0.0.1"):
        VLLMRolloutEngine(model, config=cfg, sync="lora", sync_dir="unused", pad_id=0)
    assert time.monotonic() - t0 < 4.0


def test_a_server_that_comes_back_triggers_one_reconnect_hook():
    """Connection refused -> the client waits for /health, runs the hook once, and the request goes through."""
    port = _closed_port()
    hooks = []
    client = VLLMClient(f"http://127.0.0.1:{port}", connect_timeout=0.5, restart_timeout=10.0, max_retries=2,
                        backoff_seconds=0.0, on_reconnect=lambda: hooks.append(time.monotonic()))
    holder = {}

    def come_back():
        time.sleep(1.0)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", port), _Scripted)
        server.script, server.seen = [], []
        holder["server"] = server
        server.serve_forever()

    threading.Thread(target=come_back, daemon=True).start()
    try:
        assert client.post("/v1/completions", {"n": 1}) == {"ok": True}
        assert len(hooks) == 1 and client.reconnects == 1
        assert ("POST", "/v1/completions", {"n": 1}) in [s[:3] for s in holder["server"].seen]
    finally:
        if "server" in holder:
            holder["server"].shutdown()
            holder["server"].server_close()


def test_server_command_for_lora_and_full_runs():
    cfg = VLLMConfig(base_urls=("http://0.0.0.0:8123",), device="cpu", python="/venv/bin/python", dtype="bfloat16",
                     max_model_len=512, cpu_kvcache_gib=2, extra_args=("--enforce-eager",))
    argv, env = server_command(cfg, model="models/m", lora_rank=12, max_loras=3)
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = {a: (None if b.startswith("--") else b) for a, b in zip(argv[3:], argv[4:] + ["--"])
             if a.startswith("--")}
    assert flags["--model"] == "models/m" and flags["--port"] == "8123" and flags["--host"] == "0.0.0.0"
    assert flags["--max-lora-rank"] == "16" and flags["--max-loras"] == "3" and flags["--max-model-len"] == "512"
    assert flags["--logprobs-mode"] == "processed_logprobs" and flags["--dtype"] == "bfloat16"
    assert "--enable-lora" in argv and argv[-1] == "--enforce-eager"
    assert env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "VLLM_CPU_KVCACHE_SPACE": "2",
                   "VLLM_SERVER_DEV_MODE": "1"}
    argv, env = server_command(VLLMConfig(), model="m", lora_rank=None)
    assert "--enable-lora" not in argv and "--gpu-memory-utilization" in argv
    assert env == {"VLLM_SERVER_DEV_MODE": "1"}
    with pytest.raises(ValueError, match="max_lora_rank=8 is smaller than the run's lora.rank=16"):
        server_command(VLLMConfig(max_lora_rank=8), model="m", lora_rank=16)
    assert [vllm_lora_rank(r) for r in (1, 2, 8, 9, 64, 300)] == [1, 8, 8, 16, 64, 320]
    # Several servers: each is started on its own entry of base_urls.
    two = VLLMConfig(base_urls=("http://10.0.0.1:8000", "http://10.0.0.2:8001"))
    argv, _ = server_command(two, model="m", lora_rank=None, index=1)
    assert argv[argv.index("--host") + 1] == "10.0.0.2" and argv[argv.index("--port") + 1] == "8001"
    with pytest.raises(ValueError, match="there is no server 2"):
        server_command(two, model="m", lora_rank=None, index=2)


@pytest.mark.parametrize("field,value,match", [
    ("base_urls", ("localhost:8000",), "http"), ("base_urls", ("http://h:1/v1",), "without a path"),
    ("base_urls", (), "one or more"), ("base_urls", ("http://h:1", "http://h:1/"), "each server once"),
    ("read_timeout", 0, "seconds > 0"), ("max_retries", -1, ">= 0"), ("keep_versions", 0, ">= 1"),
    ("adapter_dtype", "int8", "bfloat16"), ("device", "tpu", "'cpu' or 'gpu'"),
])
def test_config_validation_names_field_and_fix(field, value, match):
    with pytest.raises(ValueError, match=f"VLLMConfig.{field}=.*{match}"):
        VLLMConfig(**{field: value})


def test_rollout_config_sync_field():
    from jrl.rollout.config import RolloutConfig

    for sync in ("auto", "lora", "filesystem", "shared_memory", "async_filesystem"):
        assert RolloutConfig(backend="vllm", sync=sync).vllm.base_urls[0].startswith("http")
    with pytest.raises(ValueError, match="RolloutConfig.sync='full'.*'async_filesystem', 'filesystem', 'lora', "
                                         "'shared_memory'.*'full' is now 'filesystem'"):
        RolloutConfig(sync="full")


def test_serve_script_dry_run_prints_the_command(capsys):
    import importlib.util

    from jrl.train.config import TrainConfig  # noqa: F401  (imported before the script parses)

    spec = importlib.util.spec_from_file_location("serve_vllm", "scripts/serve_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--config", "configs/grpo.py", "--device", "cpu", "--dry-run", "--rollout.max-staleness", "2",
                        "--rollout.vllm.python", "/v/bin/python", "lora:lora-config", "--lora.rank", "8"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True VLLM_CPU_KVCACHE_SPACE=4 VLLM_SERVER_DEV_MODE=1 "
                           "/v/bin/python -m vllm")
    assert "--enable-lora --max-lora-rank 8 --max-loras 3" in line and "--model models/tiny-arithmetic" in line
    # LoRA on MoE parameters syncs merged full weights: the server runs without LoRA.
    assert module.main(["--config", "configs/grpo.py", "--device", "cpu", "--dry-run", "lora:lora-config",
                        "--lora.target-parameters", "mlp.experts.down_proj"]) == 0
    assert "--enable-lora" not in capsys.readouterr().out.strip().splitlines()[-1]
    assert module.main(["--config", "configs/grpo.py", "--dry-run"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("VLLM_SERVER_DEV_MODE=1 .vllm-venv/bin/python -m vllm") and "--enable-lora" not in line


def test_sync_transport_follows_the_model():
    from jrl.models.lora import MOE_LORA_TARGETS, LoraConfig, apply_lora
    from jrl.rollout.weight_sync import model_transport
    from rollout_testlib import tiny_model

    plain = tiny_model()
    assert model_transport("auto", plain) == "filesystem"
    assert model_transport("shared_memory", plain) == "shared_memory"
    with pytest.raises(ValueError, match="sync='lora' needs a LoRA run"):
        model_transport("lora", plain)
    assert model_transport("auto", apply_lora(tiny_model(), LoraConfig(rank=2))) == "lora"
    # LoRA on MoE experts or routers goes as merged full weights (vLLM's CPU build has no fused-MoE LoRA).
    moe = dict(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    for targets in (MOE_LORA_TARGETS[:1], MOE_LORA_TARGETS[2:]):
        adapted = apply_lora(tiny_model(**moe), LoraConfig(rank=2, target_parameters=targets))
        assert model_transport("auto", adapted) == "filesystem"
        with pytest.raises(ValueError, match=r"sync='lora' cannot send LoRA on MoE parameters"):
            model_transport("lora", adapted)
    assert model_transport("auto", apply_lora(tiny_model(**moe), LoraConfig(rank=2))) == "lora"


def test_cpu_vllm_engine_refuses_moe_models(tmp_path):
    """Refused before any request (nothing listens at the URL): vLLM 0.32's CPU build serves MoE models wrongly
    after a weight reload (tests/rollout/test_vllm_moe.py)."""
    from jrl.rollout.vllm_engine import VLLMRolloutEngine
    from rollout_testlib import tiny_model

    moe = tiny_model(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16)
    cfg = VLLMConfig(base_urls=("http://127.0.0.1:9",), device="cpu", connect_timeout=0.1)
    with pytest.raises(ValueError, match=r"VLLMConfig.device='cpu' cannot sample a MoE model.*rollout.backend='jax'"):
        VLLMRolloutEngine(moe, config=cfg, sync_dir=tmp_path, pad_id=0)


def test_serve_script_refuses_a_cpu_server_for_a_moe_checkpoint(tmp_path, capsys):
    """The serve script reads model.path's config.json and refuses what the trainer would refuse, before
    starting anything; a GPU server for the same checkpoint and a CPU server for a dense one are fine."""
    import importlib.util

    from jrl.models import save_pretrained
    from rollout_testlib import tiny_model

    spec = importlib.util.spec_from_file_location("serve_vllm", "scripts/serve_vllm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    moe = tiny_model(model_type="qwen3_moe", qk_norm=True, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=16)
    save_pretrained(moe, tmp_path / "moe")
    save_pretrained(tiny_model(), tmp_path / "dense")
    base = ["--config", "configs/grpo.py", "--dry-run", "--model.path"]
    assert module.main([*base, str(tmp_path / "moe"), "--device", "cpu"]) == 2
    out = capsys.readouterr()
    assert "cannot sample a MoE model" in out.err and "rollout.vllm.device='gpu'" in out.err and out.out == ""
    assert module.main([*base, str(tmp_path / "moe"), "--device", "gpu"]) == 0
    assert module.main([*base, str(tmp_path / "dense"), "--device", "cpu"]) == 0


def test_missing_vllm_python_is_a_clear_error(tmp_path):
    argv = [str(tmp_path / "no-venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    server = VLLMServer(argv, {}, base_url="http://127.0.0.1:9", log_file=tmp_path / "log")
    with pytest.raises(FileNotFoundError, match=r"rollout\.vllm\.python.*scripts/install_vllm_cpu\.sh"):
        server.start()
    assert server.process is None


#: A stand-in server process for the launcher's lifecycle: answers ``/health`` with 200 on the port it is given,
#: and starts a child in its process group (as vLLM starts engine workers) that ignores SIGTERM: only the group's
#: SIGKILL ends it.
HEALTH_SERVER = """
import http.server, subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
print("child", child.pid, flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_server_launcher_waits_for_health_and_stops_the_process_group(tmp_path):
    import os
    import sys

    port = _closed_port()
    script = tmp_path / "health_server.py"
    script.write_text(HEALTH_SERVER)
    server = VLLMServer([sys.executable, str(script), str(port)], {}, base_url=f"http://127.0.0.1:{port}",
                        log_file=tmp_path / "server.log", startup_timeout=60)
    with server:
        pid = server.pid
        assert VLLMClient(server.base_url).healthy()
        child = int((tmp_path / "server.log").read_text().split()[1])
    assert server.process is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the server is gone (and reaped)
    # so is the worker it started, by the time stop() returned: no process, or a zombie left for init to reap
    stat = Path(f"/proc/{child}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
