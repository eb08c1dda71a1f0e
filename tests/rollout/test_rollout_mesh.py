"""The engine on a 2-device mesh (fake CPU devices in a child process; batch split over ``data``, or cache
heads and vocabulary split over ``tensor``, or a replicated copy of an FSDP-sharded model's weights on its devices,
or a rollout mesh of its own beside the model's) generates what it generates on one device, and continues a
conversation on its KV cache as one device does; the paged sampler, one part of the prompts per device, samples
what it samples on one device."""

import json
import subprocess
import sys
import threading
from pathlib import Path

import child_processes as helpers
import jax.numpy as jnp
import numpy as np
from rollout_mesh_worker import PAGED, PAGED_PARAMS, SESSION_TURN
from rollout_testlib import PAD, random_prompts, tiny_model

from jrl.rollout import SamplingParams
from jrl.rollout.config import RolloutConfig, sampler_mesh
from jrl.rollout.jax_engine import JaxRolloutEngine, narrowed
from jrl.sharding import MeshConfig

HERE = Path(__file__).parent


def test_two_device_mesh_matches_one_device():
    # greedy: 3 rows, padded to 4 on the data mesh, prefilled as rows; sampled: 2 generations of each prompt, 6 rows
    # padded to 8, continuing 4 prefilled prompts (each prompt's cache copied across the mesh to its rows)
    prompts = random_prompts(np.random.default_rng(8), [5, 2, 9])
    env = helpers.worker_env(4)
    env["PYTHONPATH"] = f"{HERE}:{env['PYTHONPATH']}"
    proc = subprocess.run([sys.executable, str(HERE / "rollout_mesh_worker.py"), json.dumps(prompts)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=helpers.REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = helpers.parse_json_tail(proc.stdout)

    engine = JaxRolloutEngine(tiny_model("llama", seed=6), pad_id=PAD, prompt_bucket=16)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=6, top_k=1), num_generations=1, seed=0)
    sampled = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.9, stop_token_ids=(4,)),
                              num_generations=2, seed=1)
    assert result["data"]["weight_devices"] == result["tensor"]["weight_devices"] == [0, 1]
    assert result["data"]["shares_trainer_devices"] and not result["data"]["copies_weights"]
    assert not result["tensor"]["replicated"]
    decode = result["decode_layout"]  # the model FSDP-sharded on devices 0 and 1, the engine's copy whole on both
    assert decode["weight_devices"] == [0, 1] and decode["shares_trainer_devices"] and decode["copies_weights"]
    assert decode["replicated"]
    own = result["own_mesh"]  # the model on devices 0 and 1, the engine's copy of the weights on 2 and 3
    assert own["weight_devices"] == [2, 3] and not own["shares_trainer_devices"] and own["copies_weights"]
    params = SamplingParams(max_new_tokens=4, temperature=0.9, stop_token_ids=(4,))
    first, session = engine.start_session(prompts, params, num_generations=2, seed=2)
    turn, _ = engine.continue_session(session, *SESSION_TURN, params, seed=3)
    for name in ("data", "tensor", "decode_layout", "own_mesh"):
        got = result[name]
        # A conversation continued on its KV cache (rows sharded over the mesh, gathered in another order).
        assert got["session"][:2] == [first.completion_ids.tolist(), turn.completion_ids.tolist()], name
        np.testing.assert_allclose(got["session"][2], turn.sampling_logprobs, atol=1e-4, err_msg=name)
        assert got["greedy"] == greedy.completion_ids.tolist(), name
        assert got["sampled"] == sampled.completion_ids.tolist(), name
        assert got["sampled_mask"] == sampled.completion_mask.tolist(), name
        np.testing.assert_allclose(got["sampled_logprobs"], sampled.sampling_logprobs, atol=1e-4, err_msg=name)

    # The paged sampler on a data-parallel mesh: each device decodes a part of the prompts, in its own pool, and the
    # rows come out as on one device; with the weights split over the mesh (tensor) it is refused.
    paged = JaxRolloutEngine(tiny_model("llama", seed=6), pad_id=PAD, prompt_bucket=16, kv=PAGED).generate(
        prompts, PAGED_PARAMS, num_generations=3, seed=5)
    assert 3 < paged.completion_mask.sum(1).max() and len(set(paged.completion_mask.sum(1).tolist())) > 2
    for name in ("data", "decode_layout", "own_mesh"):
        got = result[name]["paged"]
        assert got.get("tokens") == paged.completion_ids.tolist(), (name, got.get("error"))
        np.testing.assert_allclose(got["logprobs"], paged.sampling_logprobs, atol=1e-4, err_msg=name)
        # Each device's rounds run in a thread of its own (a round's loop holds the thread that starts it on a GPU).
        devices = [device for device, _ in got["rounds"]]
        threads = {thread for _, thread in got["rounds"]}
        assert len(set(devices)) == len(devices) == len(threads) == 2, (name, got["rounds"])
        assert threading.main_thread().name not in threads, (name, got["rounds"])
    assert "needs the whole model on every device" in result["tensor"]["paged"]["error"]


def test_the_copy_in_a_layout_of_its_own_is_narrowed_to_the_compute_dtype():
    rng = np.random.default_rng(3)
    tree = {"kernel": jnp.asarray(rng.normal(size=(4, 3)), jnp.float32),
            "scale": jnp.asarray(rng.normal(size=(3,)), jnp.bfloat16), "step": jnp.arange(3)}
    out = narrowed(tree, jnp.bfloat16)
    assert {k: str(v.dtype) for k, v in out.items()} == {"kernel": "bfloat16", "scale": "bfloat16", "step": "int32"}
    np.testing.assert_array_equal(np.asarray(out["kernel"], np.float32),
                                  np.asarray(tree["kernel"].astype(jnp.bfloat16), np.float32))
    assert narrowed(tree, jnp.float32) is tree  # nothing wider than float32: no copy


def test_the_default_sampler_layout_shards_weights_that_would_crowd_a_device():
    gib = 2**30
    default = RolloutConfig().mesh
    # a 1B model's 2.5 GB beside 80 GB: whole on every device; 60 GB: over 2 of 4 devices; 120 GB: over 4
    assert sampler_mesh(default, weight_bytes=int(2.5 * gib), device_bytes=80 * gib, devices=4) == default
    assert sampler_mesh(default, weight_bytes=60 * gib, device_bytes=80 * gib, devices=4) == \
        MeshConfig(data=-1, fsdp=1, tensor=2)
    assert sampler_mesh(default, weight_bytes=120 * gib, device_bytes=80 * gib, devices=4).tensor == 4
    assert sampler_mesh(default, weight_bytes=120 * gib, device_bytes=80 * gib, devices=2).tensor == 2  # at most all
    chosen = MeshConfig(data=1, fsdp=-1)  # a layout the user chose stays, and so does any without a memory size
    assert sampler_mesh(chosen, weight_bytes=60 * gib, device_bytes=80 * gib, devices=4) == chosen
    assert sampler_mesh(default, weight_bytes=60 * gib, device_bytes=None, devices=4) == default


def test_kept_pages_continue_on_the_device_that_kept_them_or_move_to_the_one_given():
    """A paged generation over 2 devices continued twice from its kept pages samples the tokens and log-probs of one
    uninterrupted generation on one device, both when the rows' groups are regrouped without naming where their pages
    are (some continue on the other device, their pages moved) and when each names the device that kept it
    (:attr:`RowGroup.home`: none moves, and both devices keep rows); each device's pool is allocated on it."""
    env = helpers.worker_env(2)
    env["PYTHONPATH"] = f"{HERE}:{env['PYTHONPATH']}"
    proc = subprocess.run([sys.executable, str(HERE / "paged_keep_worker.py"), json.dumps([1, 8, 13, 17, 5, 6])],
                          env=env, capture_output=True, text=True, timeout=300, cwd=helpers.REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = helpers.parse_json_tail(proc.stdout)
    moving, homed = result["moving"], result["homed"]
    assert moving["generations"] == homed["generations"] == 3
    assert moving["moved"] > 0 and homed["moved"] == 0
    assert {0, 1} <= set(homed["homes"])
    # each device's pool is allocated on that device (not first on the default one, which then held two at once)
    assert result["pools"] == {"cpu:0": ["cpu:0"], "cpu:1": ["cpu:1"]}, result["pools"]
    for chain in (moving, homed):
        assert chain["tokens"] == result["whole_tokens"]
        for got, want in zip(chain["logprobs"], result["whole_logprobs"]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
