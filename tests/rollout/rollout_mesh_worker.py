"""Child process for test_rollout_mesh.py (4 fake CPU devices set by the parent): generates on a 2-device mesh of
the model, on the model's 2 devices laid out for decoding (the model FSDP-sharded, the engine's copy replicated),
and on a 2-device mesh of its own, and prints one JSON line with the tokens, logprobs (of generate, and of a second
turn continued on the KV cache), the devices holding the engine's weights and whether each engine weight is whole
on every device, and a paged generation (or its error, and the threads each device's decode rounds ran in), per
layout."""

import json
import sys
import threading

import jax
import numpy as np
from flax import nnx
from rollout_testlib import PAD, tiny_model

from jrl.rollout import SamplingParams, paged
from jrl.rollout.jax_engine import JaxRolloutEngine
from jrl.rollout.kv_config import KVCacheConfig
from jrl.sharding import MeshConfig, make_mesh, split_devices


#: The paged sampler's settings on a mesh: 3 slots and a small pool per device (preemptions), 8-slot pages.
PAGED = KVCacheConfig(layout="paged", page_size=8, round_steps=8, slots=3, pages=12)
PAGED_PARAMS = SamplingParams(max_new_tokens=20, temperature=0.9, stop_token_ids=(4,))


def _paged(name: str, prompts) -> dict:
    """A paged generation on layout ``name`` (each device a part of the prompts), or the error it gives, and the
    (device, thread) pairs its decode rounds ran on."""
    rounds, decode_round = set(), paged._decode_round

    def recorded(graphdef, state, *args, **kwargs):
        device = next(iter(jax.tree.leaves(state)[0].devices()))
        rounds.add((device.id, threading.current_thread().name))
        return decode_round(graphdef, state, *args, **kwargs)

    paged._decode_round = recorded
    try:
        batch = _engine(name, PAGED).generate(prompts, PAGED_PARAMS, num_generations=3, seed=5)
    except ValueError as e:
        return dict(error=str(e))
    finally:
        paged._decode_round = decode_round
    return dict(tokens=batch.completion_ids.tolist(), logprobs=np.asarray(batch.sampling_logprobs).tolist(),
                rounds=sorted(rounds))


#: A conversation's next turn: the session rows continued (another order, one left out) and what each reads first.
SESSION_TURN = ([4, 0, 3], [[7, 8], [], [11]])


def _engine(name: str, kv: KVCacheConfig = KVCacheConfig()) -> JaxRolloutEngine:
    """The engine of layout ``name``: on a 2-device mesh of the model, on the model's devices in a layout of its own
    (``decode_layout``), or (``own_mesh``) on 2 devices of its own while the model lives on the other 2."""
    learner_devices, rollout_devices = split_devices(2)
    if name == "decode_layout":
        model = tiny_model("llama", seed=6, mesh=make_mesh(MeshConfig(fsdp=2), learner_devices))
        return JaxRolloutEngine(model, pad_id=PAD, prompt_bucket=16, mesh=make_mesh(MeshConfig(data=2, fsdp=1),
                                                                                    learner_devices), kv=kv)
    if name == "own_mesh":
        model = tiny_model("llama", seed=6, mesh=make_mesh(MeshConfig(fsdp=2), learner_devices))
        return JaxRolloutEngine(model, pad_id=PAD, prompt_bucket=16, mesh=make_mesh(MeshConfig(data=2, fsdp=1),
                                                                                    rollout_devices), kv=kv)
    cfg = {"data": MeshConfig(data=2, fsdp=1), "tensor": MeshConfig(fsdp=1, tensor=2)}[name]
    return JaxRolloutEngine(tiny_model("llama", seed=6, mesh=make_mesh(cfg, learner_devices)), pad_id=PAD,
                            prompt_bucket=16, kv=kv)


def main(prompts_json):
    assert jax.device_count() == 4, jax.devices()
    prompts = json.loads(prompts_json)
    out = {}
    for name in ("data", "tensor", "decode_layout", "own_mesh"):
        engine = _engine(name)
        graphdef, state, _ = engine._weights()  # what a generation decodes from
        weights = nnx.merge(graphdef, state)
        devices = {d.id for x in jax.tree.leaves(nnx.state(weights)) for d in x.sharding.device_set}
        greedy = engine.generate(prompts, SamplingParams(max_new_tokens=6, top_k=1), num_generations=1, seed=0)
        sampled = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.9, stop_token_ids=(4,)),
                                  num_generations=2, seed=1)
        params = SamplingParams(max_new_tokens=4, temperature=0.9, stop_token_ids=(4,))
        first, session = engine.start_session(prompts, params, num_generations=2, seed=2)
        turn, _ = engine.continue_session(session, *SESSION_TURN, params, seed=3)
        out[name] = dict(greedy=greedy.completion_ids.tolist(), sampled=sampled.completion_ids.tolist(),
                         session=[first.completion_ids.tolist(), turn.completion_ids.tolist(),
                                  np.asarray(turn.sampling_logprobs).tolist()],
                         sampled_mask=sampled.completion_mask.tolist(),
                         sampled_logprobs=np.asarray(sampled.sampling_logprobs).tolist(),
                         weight_devices=sorted(devices), shares_trainer_devices=engine.shares_trainer_devices,
                         copies_weights=engine.copies_weights,
                         replicated=all(x.is_fully_replicated for x in jax.tree.leaves(nnx.state(weights))),
                         paged=_paged(name, prompts))
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
