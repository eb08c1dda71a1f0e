"""LeaderEngine with 2 real processes (jax.distributed, 1 CPU device each): process 0 alone builds and drives the
engine, both processes receive the same batches, a weight sync gathers the adapters sharded across both processes
and reaches the engine, and an error on process 0 is raised on both; against one process generating alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import child_processes as helpers
import numpy as np
import pytest

HERE = Path(__file__).parent
PROCESSES = 2


def _spawn(helpers, **env) -> subprocess.Popen:
    worker_env = helpers.worker_env(1, **env)
    worker_env["PYTHONPATH"] = f"{HERE}:{worker_env['PYTHONPATH']}"
    return subprocess.Popen([sys.executable, str(HERE / "leader_worker.py")], env=worker_env, cwd=helpers.REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def outputs():
    port = helpers.free_port()
    procs = [_spawn(helpers, JRL_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JRL_NUM_PROCESSES=str(PROCESSES),
                    JRL_PROCESS_ID=str(i)) for i in range(PROCESSES)] + [_spawn(helpers)]
    outs = helpers.json_results(procs, 150)
    return outs[:-1], outs[-1]


def test_every_process_gets_process_zeros_batches(outputs):
    workers, alone = outputs
    assert [w["built"] for w in workers] == [True, False]  # only process 0 has the engine
    for version in ("v0", "v1"):
        assert workers[0][version] == workers[1][version]
        got, want = workers[0][version], alone[version]
        assert got["version"] == want["version"] == int(version[1])
        for key in ("prompt_ids", "completion_ids", "completion_mask", "truncated"):
            assert got[key] == want[key], (version, key)
        np.testing.assert_allclose(got["logprobs"], want["logprobs"], rtol=1e-5, atol=1e-6)
    # The sync delivered the changed adapters: version 1 samples differently from version 0.
    assert np.abs(np.subtract(workers[0]["v1"]["logprobs"], workers[0]["v0"]["logprobs"])).max() > 1e-3


def test_an_error_on_process_zero_stops_every_process(outputs):
    workers, alone = outputs
    empty = "ValueError: generate: prompt_ids is empty; pass at least one prompt"
    assert workers[0]["error"] == alone["error"] == empty
    assert workers[1]["error"].startswith("RuntimeError: process 0 could not generate a rollout batch")
