"""Fixtures of the rollout tests."""

from __future__ import annotations

import dataclasses

import pytest


@dataclasses.dataclass
class ServedVLLM:
    """The suite's vLLM server (``server``: the child process, restartable) and the config that reaches it."""

    server: object
    config: object


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    """One real vLLM server on the shipped tiny model for every ``vllm`` test (LoRA and full reload on)."""
    from vllm_testlib import free_port, make_server, server_config

    cfg = server_config(free_port())
    server = make_server(cfg, tmp_path_factory.mktemp("vllm") / "server.log")
    server.start()
    try:
        yield ServedVLLM(server, cfg)
    finally:
        server.stop()
