"""Multi-device scaling: the train step on 1..N devices, one process or one per device group, and an
expert-parallel MoE layer.

``train``: the GRPO update of ``benchmarks/train_step_vs_torch.py`` (same shapes, batch and loss) on a mesh over
the first ``n`` devices for each ``n`` of ``--devices``: ``fsdp=n`` and, with ``--tensor T``, ``fsdp=n/T,
tensor=T``. Weak scaling: ``--rows-per-device`` rows of ``--seq`` tokens per device (a layout over ``n`` devices
trains ``n x rows-per-device`` rows). Per layout: median step time, tokens/s per device, scaling efficiency
(tokens/s per device against the run's one-device layout, when it has one), and the process's peak memory on its
first device so far (JAX keeps one peak per process, so a layout's own peak needs a run of that layout alone).
Numerics: before the timed steps each layout makes one update on the same ``--check-rows`` batch from the same
initial weights (``create_model`` draws the same values on any mesh); its loss and gradient norm, and their
relative difference from the first layout's, are reported.

``--processes P``: the same as ``P`` processes joined by :func:`jrl.sharding.initialize` (the ``JRL_*``
variables), each seeing ``1/P`` of the devices (``CUDA_VISIBLE_DEVICES`` on GPU, fake CPU devices on CPU); only
layouts over every device run; process 0 reports.

``moe``: one MoE layer (defaults: Qwen3-30B-A3B's, E=128, top-8, hidden 2048, expert 768) with
``--tokens-per-device`` tokens per device, forward + backward time (gradients of every weight and the input) on
one device, on ``n`` devices with the experts gathered over ``fsdp`` (``expert=1``), and with ``expert=n``
(expert parallelism, tokens exchanged by all-to-all); and the time of one ``all_to_all`` of the dispatch buffer
alone (each device sends ``n x tokens x top_k`` rows of ``hidden``: the padded exchange of
``jrl.models.expert_parallel``, which runs twice per forward).

    python benchmarks/scaling.py train --shape llama1b --devices 1,2,4,8 --tensor 2 --out scaling.jsonl
    python benchmarks/scaling.py train --shape llama1b --devices 8 --processes 8 --out scaling.jsonl
    python benchmarks/scaling.py moe --devices 1,8 --out scaling.jsonl

On CPU (fake devices show the mechanism and the numerics, not speed):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python benchmarks/scaling.py train \\
        --shape tiny --seq 128 --devices 1,2,4,8 --tensor 2
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_common as C  # noqa: E402
import train_step_vs_torch as T  # noqa: E402
from moe_layer_vs_torch import moe_config  # noqa: E402


def _layouts(devices: list[int], tensor: int, available: int) -> list[tuple[int, int]]:
    """(devices, tensor size) of every layout the run takes, one device first."""
    out = []
    for n in devices:
        if n > available:
            raise SystemExit(f"--devices asks for {n} devices but {available} are visible")
        out.append((n, 1))
        if tensor > 1 and n >= tensor and n % tensor == 0:
            out.append((n, tensor))
    return out


def _mesh(n: int, tensor: int):
    import jax

    from jrl.sharding import MeshConfig, make_mesh

    cfg = MeshConfig(fsdp=n // tensor, tensor=tensor)
    return make_mesh(cfg, devices=jax.devices()[:n]), cfg.logical_rules()


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def train(args) -> None:
    import jax

    from jrl import sharding as S

    multi = S.initialize(initialization_timeout=300)
    shape = dict(T.SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    count = jax.device_count()
    devices = [count] if multi else [int(d) for d in args.devices.split(",")]
    first = None
    for n, tensor in _layouts(devices, args.tensor, count):
        mesh, rules = _mesh(n, tensor)
        learner, update = T.jrl_update(args, shape, mesh, rules)
        checked = update(learner, T.step_batch(args.check_rows, args.seq, shape["vocab_size"], seed=1))
        batch = T.step_batch(n * args.rows_per_device, args.seq, shape["vocab_size"])
        times, _ = T.time_updates(learner, update, batch, args.steps)
        step = T.steady_median(times)
        tokens = n * args.rows_per_device * args.seq
        row = dict(bench="scaling_train", shape=args.shape, mode=args.mode, devices=n, fsdp=n // tensor,
                   tensor=tensor, processes=jax.process_count(), rows_per_device=args.rows_per_device,
                   seq=args.seq, step_s=round(step, 4), tokens_per_s_per_device=round(tokens / step / n),
                   check_loss=checked["loss"],
                   check_grad_norm=checked["grad_norm"], process_peak_gib_device0=_gib(C.peak_bytes()),
                   device=jax.devices()[0].device_kind, versions=f"jax {jax.__version__}")
        first = first or row
        row["efficiency"] = (round(row["tokens_per_s_per_device"] / first["tokens_per_s_per_device"], 4)
                             if first["devices"] == 1 else None)
        row["check_loss_rel_diff"] = _rel(row["check_loss"], first["check_loss"])
        row["check_grad_norm_rel_diff"] = _rel(row["check_grad_norm"], first["check_grad_norm"])
        if jax.process_index() == 0:
            C.report(row, args.out)
        del learner, update, batch
        jax.clear_caches()


def _gib(x) -> float | None:
    return None if x is None else round(x / 2**30, 2)


def moe(args) -> None:
    import functools

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jrl.models.moe import MoE
    from jrl.sharding import MeshConfig, batch_sharding, make_mesh, shard_model

    config = moe_config(args)

    @nnx.jit
    def forward_backward(m, x):
        def loss(m, x):
            return jnp.sum(m(x).astype(jnp.float32) ** 2)
        return nnx.grad(loss, argnums=(0, 1))(m, x)

    single = None
    for n in (int(d) for d in args.devices.split(",")):
        for expert in sorted({1, n}):
            cfg = MeshConfig(fsdp=n // expert, expert=expert)
            mesh, rules = make_mesh(cfg, devices=jax.devices()[:n]), cfg.logical_rules()
            block = shard_model(MoE(config, rngs=nnx.Rngs(0), mesh=mesh, rules=rules), mesh, rules)
            shape = (n, args.tokens_per_device, args.hidden)
            x = jax.device_put(jax.random.normal(jax.random.key(1), shape, jnp.bfloat16),
                               batch_sharding(mesh, 3, rules, shape=shape))
            ms = C.bench(forward_backward, block, x)["ms"]
            single = single or ms
            row = dict(bench="scaling_moe", devices=n, expert=expert, fsdp=n // expert, experts=args.experts,
                       top_k=args.top_k, hidden=args.hidden, expert_size=args.expert_size,
                       tokens_per_device=args.tokens_per_device, fwd_bwd_ms=round(ms, 3),
                       efficiency=round(single / ms, 4), device=jax.devices()[0].device_kind,
                       versions=f"jax {jax.__version__}")
            if expert > 1:
                rows = args.tokens_per_device * args.top_k
                buf_shape = (expert * expert, rows, args.hidden)
                spec = NamedSharding(mesh, P("expert"))
                buf = jax.device_put(jnp.ones(buf_shape, jnp.bfloat16), spec)
                exchange = jax.jit(jax.shard_map(functools.partial(jax.lax.all_to_all, axis_name="expert",
                                                                   split_axis=0, concat_axis=0),
                                                 mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
                row["all_to_all_ms"] = round(C.bench(exchange, buf)["ms"], 3)
                row["all_to_all_mib_per_device"] = round(expert * rows * args.hidden * 2 / 2**20, 1)
            C.report(row, args.out)
            del block, x
            jax.clear_caches()


def launch(args, argv: list[str]) -> int:
    """Run ``train`` as ``--processes`` processes over ``max(--devices)`` devices; returns the worst exit code."""
    total = max(int(d) for d in args.devices.split(","))
    if total % args.processes:
        raise SystemExit(f"--processes {args.processes} does not divide the {total} devices of --devices")
    per = total // args.processes
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cpu = os.environ.get("JAX_PLATFORMS", "") == "cpu"
    procs = []
    for i in range(args.processes):
        env = dict(os.environ, JRL_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JRL_NUM_PROCESSES=str(args.processes),
                   JRL_PROCESS_ID=str(i))
        if cpu:
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={per}".strip()
        else:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in range(i * per, (i + 1) * per))
        procs.append(subprocess.Popen([sys.executable, __file__, *argv, "--process-worker"], env=env))
    codes = [p.wait(timeout=args.timeout_s) for p in procs]
    return max(codes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("train", "moe"))
    ap.add_argument("--devices", default="1,2,4,8", help="comma list of device counts (the first n devices)")
    ap.add_argument("--out", default=None, help="append one JSON line per layout here")
    train_args = ap.add_argument_group("train")
    train_args.add_argument("--shape", choices=sorted(T.SHAPES), default="llama1b")
    train_args.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    train_args.add_argument("--mode", choices=("full", "lora"), default="full")
    train_args.add_argument("--rows-per-device", type=int, default=8)
    train_args.add_argument("--seq", type=int, default=1024)
    train_args.add_argument("--check-rows", type=int, default=8,
                            help="rows of the numerics batch every layout updates on (divisible by every fsdp size)")
    train_args.add_argument("--tensor", type=int, default=1, help="also run fsdp=n/T, tensor=T layouts")
    train_args.add_argument("--steps", type=int, default=6)
    train_args.add_argument("--processes", type=int, default=1, help="one process per device group")
    train_args.add_argument("--timeout-s", type=float, default=1800, help="multi-process: wait this long at most")
    for name, default in (("attention", "auto"), ("remat", "auto"), ("logprobs", "auto"), ("loss_head", "auto")):
        train_args.add_argument("--" + name.replace("_", "-"), default=default, help=f"jrl {name} implementation")
    train_args.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    train_args.add_argument("--process-worker", action="store_true", help=argparse.SUPPRESS)
    moe_args = ap.add_argument_group("moe")
    moe_args.add_argument("--tokens-per-device", type=int, default=8192)
    moe_args.add_argument("--experts", type=int, default=128)
    moe_args.add_argument("--top-k", type=int, default=8)
    moe_args.add_argument("--hidden", type=int, default=2048)
    moe_args.add_argument("--expert-size", type=int, default=768)
    args = ap.parse_args()
    if args.what == "moe":
        moe(args)
    elif args.processes > 1 and not args.process_worker:
        sys.exit(launch(args, sys.argv[1:]))
    else:
        train(args)


if __name__ == "__main__":
    main()
