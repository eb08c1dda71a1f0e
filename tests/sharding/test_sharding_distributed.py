"""Single-process behaviour of the multi-host helpers (the real multi-process run is in
test_sharding_multiprocess.py)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jrl import sharding as S
from jrl.sharding import distributed


@pytest.fixture
def clean_env(monkeypatch):
    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_initialize_is_a_noop_for_one_process(clean_env):
    assert S.initialize() is False
    assert S.initialize(num_processes=1) is False
    clean_env.setenv(distributed.ENV_NUM_PROCESSES, "1")
    assert S.initialize() is False
    assert jax.process_count() == 1 and S.is_main_process()


def test_initialize_names_what_is_missing(clean_env):
    clean_env.setenv(distributed.ENV_NUM_PROCESSES, "4")
    missing = r"missing: coordinator_address / JRL_COORDINATOR_ADDRESS, process_id / JRL_PROCESS_ID"
    with pytest.raises(ValueError, match=missing):
        S.initialize()
    with pytest.raises(ValueError, match=r"process_id=4 must be in \[0, num_processes=4\)"):
        S.initialize("127.0.0.1:1234", process_id=4)
    clean_env.setenv(distributed.ENV_NUM_PROCESSES, "four")
    with pytest.raises(ValueError, match=r"JRL_NUM_PROCESSES='four' must be an integer"):
        S.initialize()


def test_process_shard():
    assert S.process_shard(8) == slice(0, 8)
    assert [S.process_shard(12, i, 4) for i in range(4)] == [slice(0, 3), slice(3, 6), slice(6, 9), slice(9, 12)]
    with pytest.raises(ValueError, match=r"10 items do not split evenly over 4 processes"):
        S.process_shard(10, 0, 4)


def test_global_batch_and_gather_single_process():
    mesh = S.make_mesh()
    x = np.arange(24, dtype=np.int32).reshape(8, 3)
    batch = S.make_global_batch({"ids": x}, mesh)
    assert batch["ids"].shape == (8, 3)
    assert S.process_batch_slice(8, mesh) == slice(0, 8)
    back = S.gather_to_host(batch)
    np.testing.assert_array_equal(back["ids"], x)
    assert [p for p, _ in S.iter_to_host(batch)] == ["ids"]
