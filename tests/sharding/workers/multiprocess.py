"""Worker for the multi-process test: joins ``jax.distributed`` through ``jrl.sharding.initialize()``
(coordinator and ids from the JRL_* environment variables), builds one global mesh over every
process's CPU devices, and computes the loss and gradient norm of the tiny dense model on a global
batch assembled from each process's share. ``JRL_NUM_PROCESSES`` unset = the single-process
reference. Prints one JSON line (every process prints its own)."""

from __future__ import annotations

import functools
import json
import sys

from jrl import sharding as S

multi = S.initialize(initialization_timeout=90)  # before anything touches a device

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import common  # noqa: E402

MESHES = {"fsdp8": dict(fsdp=8), "data2_fsdp2_tensor2": dict(data=2, fsdp=2, tensor=2)}


def main() -> None:
    again = S.initialize()  # idempotent
    out = dict(
        multi=multi, again=again, process_index=jax.process_index(), process_count=jax.process_count(),
        local_devices=jax.local_device_count(), global_devices=jax.device_count(),
        is_main=S.is_main_process(), results={},
    )
    ids_global = common.tokens()
    meshes = MESHES if jax.device_count() > 1 else {"single": dict(fsdp=1)}
    for name, sizes in meshes.items():
        cfg = S.MeshConfig(**sizes)
        mesh, rules = S.make_mesh(cfg), cfg.logical_rules()
        model = S.init_sharded(functools.partial(common.make_model, "dense", mesh, rules), mesh, rules)
        share = S.process_shard(common.BATCH)
        rows = S.process_batch_slice(common.BATCH, mesh, rules)
        ids = S.make_global_batch(ids_global[rows], mesh, rules)
        loss, _, grads = common.loss_and_grads(model, ids)
        grad_norm = jax.jit(optax.global_norm)(grads)
        host_grads = S.gather_to_host(grads)  # process_allgather, tensor by tensor
        host_norm = float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64)) for g in jax.tree.leaves(host_grads))))
        params = nnx.state(model, nnx.Param)
        local_param_bytes = S.device_bytes(params)
        # shard_model: device_put of an eagerly built (host-local, identical on every process) model.
        eager = S.shard_model(common.make_model("dense", mesh, rules), mesh, rules)
        eager_host = jax.tree.leaves(S.gather_to_host(nnx.state(eager, nnx.Param)))
        diffs = [float(np.max(np.abs(a - b))) for a, b in zip(eager_host, jax.tree.leaves(S.gather_to_host(params)),
                                                              strict=True)]
        out["results"][name] = dict(
            mesh=dict(mesh.shape),
            loss=float(S.gather_to_host(loss)), grad_norm=float(S.gather_to_host(grad_norm)),
            host_grad_norm=host_norm,
            process_shard=[share.start, share.stop], process_batch_slice=[rows.start, rows.stop],
            ids_fully_addressable=bool(ids.is_fully_addressable),
            local_param_bytes_per_device=sorted(set(local_param_bytes.values())),
            shard_model_vs_init_sharded=max(diffs),
            grad_checksum=float(sum(np.sum(g, dtype=np.float64) for g in jax.tree.leaves(host_grads))),
        )
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
