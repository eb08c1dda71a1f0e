"""Child process for test_leader_engine.py: joins a run of JRL_NUM_PROCESSES processes (1 CPU device each, set by
the parent) or runs alone (the reference), and generates with a LeaderEngine whose engine (the embedded sampler on
process 0's own device, from the host copy of the weights) only process 0 builds: before and after a weight sync of
changed LoRA adapters (all weights gathered: the sampler needs the base too), and once with no prompts (an error
on process 0). Prints one JSON line."""

import json
import sys

from jrl import sharding as S

S.initialize(initialization_timeout=90)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from rollout_testlib import PAD, random_prompts, tiny_model  # noqa: E402

from jrl.models.lora import LoraConfig, LoRAParam, apply_lora  # noqa: E402
from jrl.models.transformer import on_mesh  # noqa: E402
from jrl.rollout import SamplingParams  # noqa: E402
from jrl.rollout.jax_engine import JaxRolloutEngine  # noqa: E402
from jrl.rollout.leader import LeaderEngine  # noqa: E402

PARAMS = SamplingParams(max_new_tokens=6, temperature=0.9, stop_token_ids=(4,))


class LocalSampler(JaxRolloutEngine):
    """The embedded sampler on this process's own device, from host copies of weights of any mesh."""

    def sync_weights(self, model, version: int) -> None:
        super().sync_weights(on_mesh(model, None, None), version)


def _dump(batch) -> dict:
    return dict(version=batch.policy_version, prompt_ids=batch.prompt_ids.tolist(),
                completion_ids=batch.completion_ids.tolist(), completion_mask=batch.completion_mask.tolist(),
                logprobs=np.asarray(batch.sampling_logprobs).tolist(), truncated=batch.truncated.tolist())


def main() -> None:
    mesh = S.make_mesh(S.MeshConfig(fsdp=-1)) if jax.device_count() > 1 else None
    model = tiny_model("llama", seed=6, mesh=mesh)
    apply_lora(model, LoraConfig(rank=4, alpha=8.0), seed=1)
    if mesh is not None:
        S.shard_model(model, mesh, model.rules)
    prompts = random_prompts(np.random.default_rng(8), [5, 2, 9])

    def build(host_model):
        return LocalSampler(on_mesh(host_model, None, None), pad_id=PAD, prompt_bucket=16)

    engine = LeaderEngine(build, model, adapters_only=False)  # the sampler needs every array
    out = dict(process=jax.process_index(), built=engine.inner is not None)
    out["v0"] = _dump(engine.generate(prompts, PARAMS, num_generations=2, seed=3))
    adapters = nnx.state(model, LoRAParam)
    nnx.update(model, jax.tree.map(lambda a: a + 0.05, adapters))  # lora_b starts at 0: now the adapters act
    engine.sync_weights(model, 1)
    out["v1"] = _dump(engine.generate(prompts, PARAMS, num_generations=2, seed=3))
    try:
        engine.generate([], PARAMS, num_generations=2, seed=3)
    except Exception as e:  # noqa: BLE001 - the test asserts which error each process gets
        out["error"] = f"{type(e).__name__}: {e}"
    engine.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
