"""Child process for test_rollout_mesh.py (fake CPU devices set by the parent): generates on a 2-device mesh
and prints one JSON line with the tokens and logprobs per mesh layout."""

import json
import sys

import jax
import numpy as np
from rollout_testlib import PAD, tiny_model

from jrl.rollout import SamplingParams
from jrl.rollout.jax_engine import JaxRolloutEngine
from jrl.sharding import MeshConfig, make_mesh


def main(prompts_json):
    assert jax.device_count() == 2, jax.devices()
    prompts = json.loads(prompts_json)
    out = {}
    for name, cfg in {"data": MeshConfig(data=2, fsdp=1), "tensor": MeshConfig(fsdp=1, tensor=2)}.items():
        mesh = make_mesh(cfg)
        engine = JaxRolloutEngine(tiny_model("llama", seed=6, mesh=mesh), pad_id=PAD, prompt_bucket=16)
        greedy = engine.generate(prompts, SamplingParams(max_new_tokens=6, top_k=1), num_generations=1, seed=0)
        sampled = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.9, stop_token_ids=(4,)),
                                  num_generations=1, seed=1)
        out[name] = dict(greedy=greedy.completion_ids.tolist(), sampled=sampled.completion_ids.tolist(),
                         sampled_mask=sampled.completion_mask.tolist(),
                         sampled_logprobs=np.asarray(sampled.sampling_logprobs).tolist())
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
