"""Optional parts are declared, not probed: each registered algorithm's ``capabilities`` name exactly the optional
members it has, each engine factory's ``capabilities`` are its engine's, and a config whose algorithm needs an engine
capability the backend lacks is refused naming ``rollout.backend``."""

from __future__ import annotations

import dataclasses

import pytest

from jrl.rollout import ROLLOUT_ENGINES
from jrl.rollout.jax_engine import JaxRolloutEngine
from jrl.rollout.vllm_engine import MultiServerEngine, VLLMRolloutEngine
from jrl.train.algorithms import ALGORITHMS
from jrl.train.algorithms.base import CAPABILITIES


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_declared_capabilities_are_the_members_an_algorithm_has(name):
    cls = ALGORITHMS.get(name)
    assert cls.capabilities <= set(CAPABILITIES), cls.capabilities
    for capability, members in CAPABILITIES.items():
        if not members:  # a declared behaviour (e.g. partial), no member to find
            continue
        has = [hasattr(cls, m) for m in members]
        assert all(has) == (capability in cls.capabilities) and (all(has) or not any(has)), (capability, has)
    assert all(isinstance(k, str) for k in cls.summary_keys + cls.plot_keys)


def test_engine_factories_carry_their_engines_capabilities():
    assert ROLLOUT_ENGINES.get("jax").capabilities == JaxRolloutEngine.capabilities == {"blocks", "sessions"}
    assert ROLLOUT_ENGINES.get("vllm").capabilities == VLLMRolloutEngine.capabilities == frozenset()
    assert MultiServerEngine.capabilities == frozenset()
    assert not VLLMRolloutEngine.shares_trainer_devices and not MultiServerEngine.shares_trainer_devices


def test_an_engine_need_the_backend_lacks_is_refused(monkeypatch):
    from jrl.rollout.config import RolloutConfig
    from jrl.train.config import TrainConfig

    cfg = TrainConfig()
    grpo = ALGORITHMS.get("grpo")
    monkeypatch.setattr(grpo, "engine_needs", frozenset({"blocks"}))
    with pytest.raises(ValueError, match=r"TrainConfig\.rollout\.backend='vllm'.*\['blocks'\].*algorithm='grpo'"):
        dataclasses.replace(cfg, rollout=RolloutConfig(backend="vllm"))
    dataclasses.replace(cfg, rollout=RolloutConfig(backend="jax"))  # the embedded sampler has it
