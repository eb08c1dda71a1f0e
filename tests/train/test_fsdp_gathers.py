"""``ModelSpec.fsdp_layers_per_gather=None``: two layers at a time on GPUs whose memory holds the whole weights in a
quarter, each layer in its checkpoint elsewhere (jrl.train.fsdp_gathers); a number given is kept."""

from __future__ import annotations

import jax
import pytest

from jrl.sharding import memory_limit
from jrl.train.fsdp_gathers import AUTO_LAYERS_PER_GATHER, layers_per_gather

GIB = 1 << 30


@pytest.mark.parametrize("setting", [0, 1, 2, 4])
def test_a_number_given_is_kept(setting):
    assert layers_per_gather(setting, devices=2, platform="gpu", weight_bytes=1 << 40, device_bytes=16 * GIB) == setting
    cpu = jax.devices()[0]
    assert layers_per_gather(setting, devices=2, platform=cpu.platform, weight_bytes=1,
                             device_bytes=memory_limit(cpu)) == setting


@pytest.mark.parametrize("weight_gib,limit_gib,expected", [(4, 16, AUTO_LAYERS_PER_GATHER), (4.5, 16, 0),
                                                           (16, 80, AUTO_LAYERS_PER_GATHER), (60, 80, 0),
                                                           (1, None, 0)])
def test_automatic_choice_on_gpus_follows_the_weights_share_of_their_memory(weight_gib, limit_gib, expected):
    limit = None if limit_gib is None else int(limit_gib * GIB)
    assert layers_per_gather(None, devices=2, platform="gpu", weight_bytes=int(weight_gib * GIB),
                             device_bytes=limit) == expected


def test_automatic_choice_elsewhere_gathers_each_layer_in_its_checkpoint():
    cpu = jax.devices()[0]
    assert cpu.platform == "cpu"
    assert layers_per_gather(None, devices=2, platform=cpu.platform, weight_bytes=1,
                             device_bytes=memory_limit(cpu)) == 0
    assert layers_per_gather(None, devices=1, platform="gpu", weight_bytes=1, device_bytes=16 * GIB) == 0
