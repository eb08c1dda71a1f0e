"""A real multi-process run: 2 local processes x 4 CPU devices join one 8-device mesh through
``jax.distributed`` (coordinator on 127.0.0.1, free port; gloo CPU collectives, JAX's default) via
``jrl.sharding.initialize()`` reading the JRL_* environment variables, and produce the loss and
gradient norm of a 1-process, 1-device run."""

from __future__ import annotations

import subprocess
import sys

import pytest

NUM_PROCESSES = 2
TIMEOUT = 240


def _spawn(helpers, num_devices, **env):
    return subprocess.Popen(
        [sys.executable, str(helpers.workers / "multiprocess.py")],
        env=helpers.worker_env(num_devices, **env), cwd=helpers.repo,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


@pytest.fixture(scope="module")
def runs(helpers):
    port = helpers.free_port()
    procs = [
        _spawn(helpers, 4, JRL_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JRL_NUM_PROCESSES=str(NUM_PROCESSES),
               JRL_PROCESS_ID=str(i))
        for i in range(NUM_PROCESSES)
    ]
    procs.append(_spawn(helpers, 1))  # the single-process reference, run alongside
    outs = helpers.json_results(procs, TIMEOUT)
    return outs[:-1], outs[-1]


def test_processes_form_one_global_mesh(runs):
    workers, _ = runs
    for i, w in enumerate(workers):
        assert w["multi"] and w["again"]  # initialize() joined, and a second call is a no-op
        assert (w["process_index"], w["process_count"]) == (i, NUM_PROCESSES)
        assert (w["local_devices"], w["global_devices"]) == (4, 8)
        assert w["is_main"] == (i == 0)


@pytest.mark.parametrize("mesh", ["fsdp8", "data2_fsdp2_tensor2"])
def test_loss_and_grad_norm_match_single_process(runs, mesh):
    workers, ref = runs
    want = ref["results"]["single"]
    assert not ref["multi"] and ref["process_count"] == 1
    for i, w in enumerate(workers):
        r = w["results"][mesh]
        assert abs(r["loss"] - want["loss"]) <= 1e-5 * abs(want["loss"]), (r["loss"], want["loss"])
        assert abs(r["grad_norm"] - want["grad_norm"]) <= 1e-5 * want["grad_norm"]
        # Gradients gathered to host across processes (process_allgather) agree too.
        assert abs(r["host_grad_norm"] - want["host_grad_norm"]) <= 1e-5 * want["host_grad_norm"]
        assert abs(r["grad_checksum"] - want["grad_checksum"]) <= 1e-5 * max(abs(want["grad_checksum"]), 1.0)
        # Each process fed its own half of the global batch.
        assert r["process_shard"] == r["process_batch_slice"] == [4 * i, 4 * i + 4]
        assert not r["ids_fully_addressable"]
        # Host-built model placed with shard_model == model built sharded with init_sharded.
        assert r["shard_model_vs_init_sharded"] <= 1e-7
    # Both processes computed the same global result.
    assert workers[0]["results"][mesh] | {"process_shard": 0, "process_batch_slice": 0} == \
        workers[1]["results"][mesh] | {"process_shard": 0, "process_batch_slice": 0}
