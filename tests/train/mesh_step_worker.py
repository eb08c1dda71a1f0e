"""Child process for test_grpo_e2e.py: the train step on a 2-device FSDP mesh vs one device (fake CPU devices),
padded and with packed rows (optim.packing, with and without shared prompts) on the mesh.

Prints one JSON line: the device count, the max relative gradient difference, the loss of both, and how many
devices hold the sharded parameters; whether the accumulated gradient is laid out as the parameters and how many
programs its micro-batches compiled; the row counts the log-prob kernel ran on; the packed step's gradient
difference and loss.
"""

import json
import logging
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from train_testlib import max_rel_err, random_step_batch, tiny_config  # noqa: E402

from jrl.losses import GRPOConfig  # noqa: E402
from jrl.models import create_model  # noqa: E402
from jrl.sharding import MeshConfig, make_mesh  # noqa: E402
from jrl.train.config import OptimConfig  # noqa: E402
from jrl.train.algorithms.grpo_update import PolicyUpdate  # noqa: E402
from jrl.train import update_programs  # noqa: E402
from jrl.train.learner import Learner  # noqa: E402


class KernelRows(logging.Handler):
    """The row counts the log-prob kernel was called with (from the kernel dispatcher's once-per-shape record)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.rows: set[int] = set()

    def emit(self, record):
        if record.args and record.args[0] == "logprobs":
            self.rows.add(int(record.args[3][0][0]))


def main():
    kernel_rows = KernelRows()
    logging.getLogger("jrl.kernels").addHandler(kernel_rows)
    logging.getLogger("jrl.kernels").setLevel(logging.DEBUG)
    cfg = MeshConfig(fsdp=2)
    mesh, rules = make_mesh(cfg), cfg.logical_rules()
    algo = GRPOConfig(num_generations=2, loss_type="grpo")
    batch = random_step_batch(seed=3)
    p = batch.input_ids.shape[1] - batch.completion_ids.shape[1]  # rows in pairs of one prompt (num_generations=2)
    ids, attention = batch.input_ids.copy(), batch.attention_mask.copy()
    ids[1::2, :p], attention[1::2, :p] = ids[::2, :p], attention[::2, :p]
    batch = batch._replace(input_ids=ids, attention_mask=attention)
    sharded = Learner(create_model(tiny_config(), seed=1, mesh=mesh, rules=rules), OptimConfig(micro_batch_size=4),
                      total_updates=2, mesh=mesh, rules=rules)
    single = Learner(create_model(tiny_config(), seed=1), OptimConfig(), total_updates=2)
    u2, u1 = (PolicyUpdate(algo, x, temperature=1.0, num_iterations=1, impl="auto") for x in (sharded, single))
    g2, c2, _ = sharded.accumulate([u2.policy_term(sharded, batch)])
    micro_programs = update_programs.micro_step._cache_size()  # one for every micro-batch of the step
    grad_layout = all(g.sharding.is_equivalent_to(p.sharding, g.ndim)
                      for g, p in zip(jax.tree.leaves(g2), jax.tree.leaves(sharded.params), strict=True))
    g1, c1, _ = single.accumulate([u1.policy_term(single, batch)])
    # After an optimizer update (the parameters come back from it) and with a micro-batch skipped, an update's
    # micro-batches run the program they ran before: one program for this micro-batch shape, not one per update.
    again = Learner(create_model(tiny_config(), seed=1, mesh=mesh, rules=rules), OptimConfig(micro_batch_size=2),
                    total_updates=2, mesh=mesh, rules=rules)
    term = PolicyUpdate(algo, again, temperature=1.0, num_iterations=1, impl="auto").policy_term(again, batch)
    before = update_programs.micro_step._cache_size()
    again.apply(again.accumulate([term])[0])
    keep = np.ones(len(batch.advantages), bool)
    keep[:2] = False
    skipped = again.accumulate([term._replace(keep=keep)])[2]
    later_programs = update_programs.micro_step._cache_size() - before
    # An MoE model on the same mesh: its head (the loss-fused one, and the log-prob kernel of old / reference
    # log-probs) runs per device too, with gradients equal to one device's.
    moe = tiny_config(model_type="qwen3_moe", qk_norm=True, head_dim=8, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=16)
    moe_grads = {}
    for name, m, o in (("mesh", mesh, OptimConfig(micro_batch_size=4)), ("single", None, OptimConfig())):
        learner = Learner(create_model(moe, seed=1, mesh=m, rules=rules if m else None), o, total_updates=2, mesh=m,
                          rules=rules if m else None)
        update = PolicyUpdate(algo, learner, temperature=1.0, num_iterations=1, impl="auto", loss_head="fused")
        moe_grads[name] = learner.accumulate([update.policy_term(learner, batch)])[0]
        moe_grads[name + "_old"] = learner.evaluate(update.logprobs, batch)
    moe_err = dict(grad=max_rel_err(moe_grads["mesh"], moe_grads["single"]),
                   old_logprobs=float(np.abs(moe_grads["mesh_old"] - moe_grads["single_old"]).max()))
    packed = {}
    # micro-batches of 2 packed rows (through the log-prob kernel, and through the loss-fused head, with and without
    # shared prompts); one micro-batch of a power of two of rows
    for mb, head, share in ((2, "logprobs", False), (2, "fused", False), (2, "fused", True), (None, "logprobs", False)):
        packing = Learner(create_model(tiny_config(), seed=1, mesh=mesh, rules=rules),
                          OptimConfig(micro_batch_size=mb, packing=True, share_prompts=share), total_updates=2,
                          mesh=mesh, rules=rules)
        up = PolicyUpdate(algo, packing, temperature=1.0, num_iterations=1, impl="auto", loss_head=head)
        (term,) = up.policy_terms(packing, batch)
        gp, cp, _ = packing.accumulate([term])
        packed[f"{mb}_{head}_{share}"] = dict(grad_err=max_rel_err(gp, g1), loss=float(sum(cp["loss"])),
                                              rows=int(term.rows.input_ids.shape[0]),
                                              shared=term.rows.expand is not None)
    m2 = u2(sharded, batch)
    m1 = u1(single, batch)
    devices = max(len(x.sharding.device_set) for x in jax.tree.leaves(sharded.params))
    print(json.dumps(dict(devices=jax.device_count(), grad_err=max_rel_err(g2, g1),
                          param_err=max_rel_err(sharded.params, single.params),
                          loss=[float(sum(c2["loss"])), float(c1["loss"][0])], param_devices=devices,
                          grad_norm=[m2["grad_norm"], m1["grad_norm"]], packed=packed,
                          micro_programs=micro_programs, grad_layout=grad_layout, later_programs=later_programs,
                          later_skipped=int(skipped), kernel_rows=sorted(kernel_rows.rows), moe_err=moe_err,
                          micro_batches=len(c2["loss"]))))


if __name__ == "__main__":
    main()
