"""``ModelSpec.fsdp_layers_per_gather=None``: two layers at a time on a GPU whose memory holds the whole weights in a
quarter, each layer in its checkpoint elsewhere (jrl.train.fsdp_gathers); a number given is kept."""

from __future__ import annotations

import types

import jax
import pytest

from jrl.train.fsdp_gathers import AUTO_LAYERS_PER_GATHER, layers_per_gather

GIB = 1 << 30


def _gpu(limit_bytes):
    """A device as the rule reads one: its platform and its allocator's statistics (no GPU on the test machine)."""
    stats = {} if limit_bytes is None else {"bytes_limit": limit_bytes}
    return types.SimpleNamespace(platform="gpu", memory_stats=lambda: stats)


@pytest.mark.parametrize("setting", [0, 1, 2, 4])
def test_a_number_given_is_kept(setting):
    assert layers_per_gather(setting, weight_bytes=1 << 40, device=_gpu(16 * GIB)) == setting
    assert layers_per_gather(setting, weight_bytes=1, device=jax.devices()[0]) == setting


@pytest.mark.parametrize("weight_gib,limit_gib,expected", [(4, 16, AUTO_LAYERS_PER_GATHER), (4.5, 16, 0),
                                                           (16, 80, AUTO_LAYERS_PER_GATHER), (60, 80, 0),
                                                           (1, None, 0)])
def test_automatic_choice_on_a_gpu_follows_the_weights_share_of_its_memory(weight_gib, limit_gib, expected):
    limit = None if limit_gib is None else int(limit_gib * GIB)
    assert layers_per_gather(None, weight_bytes=int(weight_gib * GIB), device=_gpu(limit)) == expected


def test_automatic_choice_elsewhere_gathers_each_layer_in_its_checkpoint():
    assert jax.devices()[0].platform == "cpu"
    assert layers_per_gather(None, weight_bytes=1, device=jax.devices()[0]) == 0
