"""Child process for test_grad_sync.py: GRPO updates accumulated per device (``OptimConfig.grad_sync="update"``; of
several micro-batches, and of one) on fake CPU devices against one device, and the updates it refuses.

Prints one JSON line: per layout, the parameters' relative difference from one device's after two updates, both
updates' losses and gradient norms on both sides, the metric values per update, the per-device programs compiled;
for ``auto`` on a CPU, whether the per-device program ran; the messages of the refused updates.
"""

import json
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).parent))
from train_testlib import max_rel_err, random_step_batch, tiny_config  # noqa: E402

from jrl.losses import GRPOConfig  # noqa: E402
from jrl.models import create_model  # noqa: E402
from jrl.models.lora import apply_lora  # noqa: E402
from jrl.models.lora_config import LoraConfig  # noqa: E402
from jrl.sharding import MeshConfig, make_mesh, shard_model  # noqa: E402
from jrl.train import update_programs  # noqa: E402
from jrl.train.algorithms.grpo_update import PolicyUpdate  # noqa: E402
from jrl.train.config import OptimConfig  # noqa: E402
from jrl.train.learner import Learner  # noqa: E402

ALGO = GRPOConfig(num_generations=2, loss_type="dapo")


def model(mesh=None, rules=None, lora=False, **overrides):
    m = create_model(tiny_config(**overrides), seed=1, mesh=mesh, rules=rules)
    if lora:
        apply_lora(m, LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj")), seed=2)
        if mesh is not None:
            shard_model(m, mesh, rules)
    return m


def two_updates(mesh_cfg, optim, *, lora=False, algo=ALGO, **overrides):
    """(learner, [per-micro-batch metrics of update 1, of update 2]) of two GRPO updates on two random batches."""
    mesh = rules = None
    if mesh_cfg is not None:
        mesh, rules = make_mesh(mesh_cfg), mesh_cfg.logical_rules()
    learner = Learner(model(mesh, rules, lora, **overrides), optim, total_updates=4, mesh=mesh, rules=rules)
    update = PolicyUpdate(algo, learner, temperature=1.0, num_iterations=1, impl="auto")
    metrics = [learner.step(update.policy_terms(learner, random_step_batch(seed=s, n=16)))[0] for s in (3, 4)]
    return learner, [{k: list(v) for k, v in m.items()} for m in metrics]


def compiled(programs, run):
    """The number of programs each of ``programs`` (names in :mod:`update_programs`) compiled during ``run()``, and
    what ``run`` returned."""
    before = {name: getattr(update_programs, name)._cache_size() for name in programs}
    result = run()
    return {name: getattr(update_programs, name)._cache_size() - n for name, n in before.items()}, result


def compare(mesh_cfg, *, packing=False, lora=False, micro_batch_size=8):
    """``micro_batch_size`` 16: an update of one micro-batch, its own program (``local_step_and_apply``)."""
    single, m1 = two_updates(None, OptimConfig(packing=packing), lora=lora)
    micro_batches = 16 // micro_batch_size
    program = "local_micro_step" if micro_batches > 1 else "local_step_and_apply"
    counts, (local, m2) = compiled([program], lambda: two_updates(mesh_cfg, OptimConfig(
        micro_batch_size=micro_batch_size, grad_sync="update", packing=packing), lora=lora))
    per_device = counts[program]
    return dict(param_err=max_rel_err(local.params, single.params), micro_batches=micro_batches,
                loss=[[m["loss"] for m in m2], [m["loss"] for m in m1]],
                grad_norm=[[m["grad_norm"] for m in m2], [m["grad_norm"] for m in m1]],
                num_tokens=[[m["num_tokens"] for m in m2], [m["num_tokens"] for m in m1]],
                programs=per_device,
                param_devices=max(len(x.sharding.device_set) for x in jax.tree.leaves(local.params)))


def reduction(reduce_dtype):
    """The devices' bf16 gradients [4, 8, 16] summed into a layout split over ``fsdp`` (``_summed``): the element
    types the program's reduction over the device axis adds in (as lowered: XLA:CPU's own collectives add bfloat16
    in float32 whatever it is asked), the result's dtype and its error against a float32 sum."""
    import re

    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = make_mesh(MeshConfig(fsdp=4))
    x = np.random.default_rng(0).normal(size=(4, 8, 16)).astype(jnp.bfloat16)
    acc = update_programs.Flat.of([jax.device_put(x, NamedSharding(mesh, PartitionSpec("fsdp")))])
    layout = update_programs.Static((NamedSharding(mesh, PartitionSpec("fsdp")),))
    fn = jax.jit(lambda a: update_programs._summed(a, layout, reduce_dtype))
    types = re.findall(r"stablehlo\.reduce.*\(tensor<4x8x16x(\w+)>", fn.lower(acc).as_text())
    out = fn(acc).leaves[0]
    want = x.astype(np.float32).sum(axis=0)
    return dict(types=types, dtype=str(out.dtype),
                rel_err=float(np.abs(np.asarray(out, np.float32) - want).max() / np.abs(want).max()))


def refused(mesh_cfg, micro_batch_size=8, **kwargs) -> str:
    try:
        two_updates(mesh_cfg, OptimConfig(micro_batch_size=micro_batch_size, grad_sync="update"), **kwargs)
    except ValueError as e:
        return str(e)
    return ""


def main():
    out = dict(devices=jax.device_count())
    # First, before other runs compile the same programs: each program of two updates compiled once (the optimizer
    # state enters the first update spelled as it leaves it). auto, on a CPU: per micro-batch. The update case's
    # micro-batches of 4 rows leave the 8-row per-device program to the comparisons below.
    out["auto_programs"], _ = compiled(["local_micro_step", "micro_step", "apply_update"],
                                       lambda: two_updates(MeshConfig(fsdp=4), OptimConfig(micro_batch_size=8)))
    out["one_micro_batch_programs"], _ = compiled(["micro_step_and_apply"],
                                                  lambda: two_updates(MeshConfig(fsdp=4), OptimConfig()))
    out["update_programs"], _ = compiled(["reduce_and_apply"], lambda: two_updates(
        MeshConfig(fsdp=4), OptimConfig(micro_batch_size=4, grad_sync="update")))
    out["fsdp4"] = compare(MeshConfig(fsdp=4))
    out["data2_fsdp2"] = compare(MeshConfig(data=2, fsdp=2))
    out["data4"] = compare(MeshConfig(data=4, fsdp=1))
    out["packed"] = compare(MeshConfig(fsdp=4), packing=True)
    out["lora"] = compare(MeshConfig(fsdp=4), lora=True)
    out["one_micro_batch"] = compare(MeshConfig(fsdp=4), micro_batch_size=16)
    out["reduce"] = {str(d): reduction(d) for d in (None, "float32")}
    out["refused"] = dict(
        bnpo=refused(MeshConfig(fsdp=4), algo=GRPOConfig(num_generations=2, loss_type="bnpo")),
        moe=refused(MeshConfig(fsdp=4), model_type="qwen3_moe", qk_norm=True, head_dim=8, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=16),
        rows=refused(MeshConfig(fsdp=4), micro_batch_size=2),
    )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
