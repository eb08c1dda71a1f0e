"""``ModelSpec.fsdp_layers_per_gather=None``: two layers at a time on GPUs where a device's share of the training
state and the whole weights take at most half its memory, each layer in its checkpoint elsewhere
(jrl.train.fsdp_gathers); a number given is kept."""

from __future__ import annotations

import jax
import pytest

from jrl.sharding import memory_limit
from jrl.train.fsdp_gathers import AUTO_LAYERS_PER_GATHER, layers_per_gather, training_state_bytes

GIB = 1 << 30
#: Llama-3.1-8B's parameter count (``ModelConfig.num_params`` of its shape) and the allocator limits of an 80 GB H100
#: and a 141 GB H200 at JAX's default 75% of their memory.
PARAMS_8B = 8_030_261_248
H100, H200 = int(0.75 * 81_559 * (1 << 20)), int(0.75 * 143_771 * (1 << 20))


@pytest.mark.parametrize("setting", [0, 1, 2, 4])
def test_a_number_given_is_kept(setting):
    assert layers_per_gather(setting, devices=2, platform="gpu", weight_bytes=1 << 40, state_bytes=1 << 42,
                             device_bytes=16 * GIB) == setting
    cpu = jax.devices()[0]
    assert layers_per_gather(setting, devices=2, platform=cpu.platform, weight_bytes=1, state_bytes=1,
                             device_bytes=memory_limit(cpu)) == setting


def test_training_state_counts_gradients_and_two_float32_moments_only_in_full():
    assert training_state_bytes(10, 2, full=True) == 10 * (2 + 2 + 8)
    assert training_state_bytes(10, 4, full=True) == 10 * (4 + 4 + 8)
    assert training_state_bytes(10, 2, full=False) == 10 * 2


@pytest.mark.parametrize("weight_gib,state_gib,devices,limit_gib,expected", [
    (4, 8, 2, 16, AUTO_LAYERS_PER_GATHER),   # 4 + 8/2 = 8: exactly half
    (4, 9, 2, 16, 0),                        # 4 + 4.5 > 8
    (4, 9, 4, 16, AUTO_LAYERS_PER_GATHER),   # more devices, a smaller share of the state
    (1, 60, 2, 16, 0),                       # small weights, a state that leaves no room
    (1, 1, 2, None, 0),                      # memory not known
])
def test_automatic_choice_on_gpus_follows_the_state_and_weights_share_of_memory(weight_gib, state_gib, devices,
                                                                                 limit_gib, expected):
    limit = None if limit_gib is None else int(limit_gib * GIB)
    assert layers_per_gather(None, devices=devices, platform="gpu", weight_bytes=int(weight_gib * GIB),
                             state_bytes=int(state_gib * GIB), device_bytes=limit) == expected


@pytest.mark.parametrize("devices,limit,expected", [(2, H200, 0), (4, H200, AUTO_LAYERS_PER_GATHER), (4, H100, 0),
                                                    (8, H100, AUTO_LAYERS_PER_GATHER)])
def test_an_8b_full_fine_tune_in_groups_only_where_its_state_leaves_room(devices, limit, expected):
    """The 8B step on 2 H200s peaked at 58.0 GiB per layer and 70.5 GiB in groups (RESULTS, twenty-second session):
    the groups only where the state's share and the whole weights leave half the memory."""
    weights, state = 2 * PARAMS_8B, training_state_bytes(PARAMS_8B, 2, full=True)
    assert layers_per_gather(None, devices=devices, platform="gpu", weight_bytes=weights, state_bytes=state,
                             device_bytes=limit) == expected


def test_automatic_choice_elsewhere_gathers_each_layer_in_its_checkpoint():
    cpu = jax.devices()[0]
    assert cpu.platform == "cpu"
    assert layers_per_gather(None, devices=2, platform=cpu.platform, weight_bytes=1, state_bytes=1,
                             device_bytes=memory_limit(cpu)) == 0
    assert layers_per_gather(None, devices=1, platform="gpu", weight_bytes=1, state_bytes=1,
                             device_bytes=16 * GIB) == 0
