"""Shared fixtures: one tiny random HF checkpoint per family, built once per test session."""

import numpy as np
import pytest
from model_testlib import FAMILIES, VOCAB, build_hf


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """family -> (torch model, checkpoint dir); built lazily."""
    cache = {}

    def get(family):
        if family not in cache:
            path = tmp_path_factory.mktemp(f"hf_{family}")
            cache[family] = (build_hf(family, path), path)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def jrl_models():
    """(family, dtype) -> jrl model loaded from that family's checkpoint; cached."""
    cache = {}

    def get(family, path, dtype="float32"):
        import jax.numpy as jnp

        from jrl.models import from_pretrained

        key = (family, dtype)
        if key not in cache:
            cache[key] = from_pretrained(path, dtype=jnp.dtype(dtype))
        return cache[key]

    return get


@pytest.fixture(params=list(FAMILIES))
def family(request):
    return request.param


@pytest.fixture()
def ids():
    return np.random.default_rng(0).integers(0, VOCAB, size=(2, 16)).astype(np.int32)
