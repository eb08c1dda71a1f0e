"""Multi-device scaling: the train step on 1..N devices, one process or one per device group, its PyTorch peers,
and an expert-parallel MoE layer.

``train``: the GRPO update of ``benchmarks/train_step_vs_torch.py`` (same shapes, batch and loss) on meshes over
the first ``n`` devices for each ``n`` of ``--devices``, in each layout of ``--layouts`` (``fsdp``: fsdp=n;
``data``: data=n; ``hsdp:K``: data=n/K x fsdp=K; ``tensor:T``: fsdp=n/T x tensor=T; ``--tensor T`` adds the
last). Weak scaling: ``--rows-per-device`` rows of ``--seq`` tokens per device (a layout over ``n`` devices
trains ``n x rows-per-device`` rows). Per layout: median step time, tokens/s per device, MFU, scaling efficiency
(tokens/s per device against the run's one-device layout, when it has one), and the process's peak memory on its
first device so far (JAX keeps one peak per process, so a layout's own peak needs a run of that layout alone);
the wall time of the layout's first update (``first_update_s``: its compile and one update of ``--check-rows`` rows)
and the seconds XLA spent compiling in it (``compile_s``: the backend compiles of ``jrl.train.compile_clock``; one
update program per layout, so layouts compare program for program: the timed batch of n x ``--rows-per-device`` rows
compiles a second one where n x rows differs from the check rows, not counted);
with ``--profile DIR`` one more traced step's GPU kernels on the first device (time by category, the collectives'
busy time and the part of it with no other kernel beside, idle gaps). ``--no-fsdp-prefetch`` leaves the FSDP
collectives to XLA (``ModelConfig.fsdp_prefetch``).
Numerics: before the timed steps each layout makes one update on the same ``--check-rows`` batch from the same
initial weights (``create_model`` draws the same values on any mesh); its loss and gradient norm, and their
relative difference from the first layout's, are reported.

``torch``: the same model (transformers), batch shape and loss under PyTorch FSDP2 (``fully_shard`` per decoder
layer and the root) and DDP, bf16, fused AdamW, one process per GPU under torchrun (``--wraps``; ``--torch-remat``
turns on transformers' gradient checkpointing, which the 30B-A3B peer needs: without, 8 x 1024 tokens per GPU run
out of an H200's 140 GB; ``--mode lora``: peft's LoRA on the modules jrl's side adapts, on a
MoE shape attention and every expert's ``gate_up_proj``/``down_proj`` as ``target_parameters``; a MoE shape's model
is built on the meta device and given storage after ``fully_shard``, its experts on ``torch._grouped_mm``); tokens/s
per device against FSDP2 on one GPU. Without a GPU the workers run on CPU with gloo (a check of the worker, not a
timing).

``--processes P``: the same as ``P`` processes joined by :func:`jrl.sharding.initialize` (the ``JRL_*``
variables), each seeing ``1/P`` of the devices (``CUDA_VISIBLE_DEVICES`` on GPU, fake CPU devices on CPU); only
layouts over every device run; process 0 reports.

``moe``: one MoE layer (defaults: Qwen3-30B-A3B's, E=128, top-8, hidden 2048, expert 768) with
``--tokens-per-device`` tokens per device, forward + backward time (gradients of every weight and the input;
efficiency against the run's one-device time, when ``--devices`` has 1) on
one device, on ``n`` devices with the experts gathered over ``fsdp`` (``expert=1``), and with ``expert=n``
(expert parallelism: the tokens gathered over ``expert``); and the time of one dispatch alone (``exchange``); with
``--profile DIR`` each layout's kernels as for ``train``. ``moe --own-experts EP`` times instead, on one device,
what one device of ``expert=EP`` computes between its collectives against the same work at ``EP = 1``
(:func:`own_experts`): expert parallelism's own overhead, measurable without ``EP`` GPUs.

``exchange``: one device's dispatch of ``tokens`` tokens to ``expert=n``: the all-gather of the tokens that
``jrl.models.expert_parallel`` runs, against a padded ``all_to_all`` of their ``tokens x top_k`` rows (``n x tokens
x top_k`` row slots sent) and ``jax.lax.ragged_all_to_all`` (only the routed rows move; its placement is checked
first).

    python benchmarks/scaling.py train --shape llama1b --devices 1,2,4,8 --layouts fsdp,data,hsdp:2 --out scaling.jsonl
    python benchmarks/scaling.py torch --shape llama1b --devices 1,2,4,8 --wraps fsdp2,ddp --out scaling.jsonl
    python benchmarks/scaling.py torch --shape qwen3_30b_a3b --mode lora --devices 4 --wraps fsdp2 --torch-remat
    python benchmarks/scaling.py train --shape llama1b --devices 8 --processes 8 --out scaling.jsonl
    python benchmarks/scaling.py train --shape llama1b --devices 1,4 --micro-batches 8    # accumulate, then update
    python benchmarks/scaling.py train --devices 1,2 --micro-batches 8 --grad-sync micro_batch,update
    python benchmarks/scaling.py train --devices 1,2,4 --grad-sync micro_batch,update    # one micro-batch per step
    python benchmarks/scaling.py train --shape qwen3_30b_a3b --mode lora --init device --devices 4 --layouts fsdp,expert:4
    python benchmarks/scaling.py moe --devices 1,8 --out scaling.jsonl
    python benchmarks/scaling.py moe --own-experts 4 [--expert-capacity 1.25]    # on one GPU
    python benchmarks/scaling.py exchange --devices 2,4,8 --out scaling.jsonl

``benchmarks/scaling_gpu.sh`` runs the usual set (train, accum, torch, moe, own) on every GPU of a machine in one call.

On CPU (fake devices show the mechanism and the numerics, not speed):

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu python benchmarks/scaling.py train \\
        --shape tiny --seq 128 --devices 1,2,4,8 --tensor 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import kernels_common as C  # noqa: E402
import local_processes  # noqa: E402
import train_step_vs_torch as T  # noqa: E402
from moe_layer_vs_torch import moe_config  # noqa: E402


LAYOUTS = ("fsdp", "data", "hsdp:K", "tensor:T", "expert:E")
SIZED = ("hsdp", "tensor", "expert")  # the layouts that take a size (``:K``)


def _layouts(devices: list[int], names: list[str], available: int) -> list[tuple[int, dict]]:
    """(devices, mesh axis sizes) of every layout the run takes, per device count in the order of ``names``:
    ``fsdp`` (fsdp=n), ``data`` (data=n: replicated weights), ``hsdp:K`` (data=n/K x fsdp=K), ``tensor:T``
    (fsdp=n/T x tensor=T), ``expert:E`` (fsdp=n/E x expert=E: a MoE shape's experts split over E devices). One
    device runs once, unsharded."""
    out = []
    for n in devices:
        if n > available:
            raise SystemExit(f"--devices asks for {n} devices but {available} are visible")
        seen = set()
        for name in names:
            kind, _, k = name.partition(":")
            if kind not in ("fsdp", "data", *SIZED) or (kind in SIZED) != bool(k):
                raise SystemExit(f"--layouts: {name!r} is not one of {', '.join(LAYOUTS)}")
            k = int(k or 1)
            if n == 1:
                sizes = dict(fsdp=1)
            elif kind == "fsdp":
                sizes = dict(fsdp=n)
            elif kind == "data":
                sizes = dict(data=n, fsdp=1)
            elif n % k or n == k and kind == "hsdp":
                continue
            else:
                sizes = dict(data=n // k, fsdp=k) if kind == "hsdp" else {"fsdp": n // k, kind: k}
            key = tuple(sorted(sizes.items()))
            if key not in seen:
                seen.add(key)
                out.append((n, sizes))
    return out


def _mesh(n: int, sizes: dict, rules: str = ""):
    import jax

    from jrl.sharding import MeshConfig, make_mesh

    cfg = MeshConfig(**sizes, rules=parse_rules(rules))
    return make_mesh(cfg, devices=jax.devices()[:n]), cfg.logical_rules()


def parse_rules(text: str) -> tuple:
    """``--rules`` (``vocab=tensor+fsdp,mlp=tensor``; ``name=`` replicates) as MeshConfig.rules pairs."""
    pairs = []
    for item in filter(None, text.split(",")):
        name, _, axes = item.partition("=")
        parts = tuple(filter(None, axes.split("+")))
        pairs.append((name, None if not parts else parts[0] if len(parts) == 1 else parts))
    return tuple(pairs)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _report(row: dict, out: str | None) -> None:
    """``C.report`` with the NCCL settings of the environment in the row (``nccl_env``), so that runs under different
    NCCL variables (``scaling_gpu.sh nccl``) tell themselves apart."""
    nccl = {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")}
    C.report({**row, "nccl_env": nccl} if nccl else row, out)


def train(args) -> None:
    import jax

    from jrl import sharding as S
    from jrl.train.compile_clock import compiled_seconds

    multi = S.initialize(initialization_timeout=300)
    shape = dict(T.SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.expert_capacity is not None:
        shape["expert_capacity"] = args.expert_capacity
    if args.expert_chunks > 1:
        shape["expert_chunks"] = args.expert_chunks
    count = jax.device_count()
    devices = [count] if multi else [int(d) for d in args.devices.split(",")]
    first = None
    names = args.layouts.split(",") + ([f"tensor:{args.tensor}"] if args.tensor > 1 else [])
    syncs = args.grad_sync.split(",")
    runs = [(n, sizes, sync) for n, sizes in _layouts(devices, names, count)
            for sync in (syncs if n > 1 else syncs[:1])]
    for n, sizes, sync in runs:
        mesh, rules = _mesh(n, sizes, args.rules)
        micro = n * args.rows_per_device if args.micro_batches > 1 else None
        gathers = _layers_per_gather(args, shape, n)
        learner, update = T.jrl_update(args, shape, mesh, rules, micro_batch_size=micro, grad_sync=sync,
                                       layers_per_gather=gathers)
        # With micro-batches the check batch must split into every layout's micro-batches: the largest layout's step.
        check_rows = max(devices) * args.rows_per_device * args.micro_batches if micro else args.check_rows
        check_batch = T.step_batch(check_rows, args.seq, shape["vocab_size"], seed=1)
        compiled, t0 = compiled_seconds(), time.perf_counter()
        checked = jax.block_until_ready(update(learner, check_batch))  # this layout's first call: compiles
        first_update, compile_s = time.perf_counter() - t0, compiled_seconds() - compiled
        rows = n * args.rows_per_device * args.micro_batches
        batch = T.step_batch(rows, args.seq, shape["vocab_size"])
        times, _ = T.time_updates(learner, update, batch, args.steps)
        step = T.steady_median(times)
        tokens = rows * args.seq
        row = dict(bench="scaling_train", shape=args.shape, mode=args.mode, devices=n, fsdp_prefetch=args.fsdp_prefetch,
                   fsdp_layers_per_gather=gathers,
                   layout=",".join(f"{k}={v}" for k, v in sizes.items() if v > 1) or "-", rules=args.rules or None,
                   processes=jax.process_count(), rows_per_device=args.rows_per_device,
                   micro_batches=args.micro_batches, grad_sync=sync if n > 1 else None,
                   expert_capacity=args.expert_capacity, expert_chunks=args.expert_chunks,
                   seq=args.seq, step_s=round(step, 4), tokens_per_s_per_device=round(tokens / step / n),
                   mfu=round(6 * T.active_params(shape) * tokens / n / step / (args.peak_tflops * 1e12), 4),
                   first_update_s=round(first_update, 2), compile_s=round(compile_s, 2), check_loss=checked["loss"],
                   check_grad_norm=checked["grad_norm"], process_peak_gib_device0=_gib(C.peak_bytes()),
                   device=jax.devices()[0].device_kind, versions=f"jax {jax.__version__}")
        if args.profile:
            name = row["layout"].replace(",", "_").replace("=", "") + (f"_{sync}" if n > 1 else "")
            row["profile"] = _profile(os.path.join(args.profile, name), learner, update, batch)
        first = first or row
        row["efficiency"] = (round(row["tokens_per_s_per_device"] / first["tokens_per_s_per_device"], 4)
                             if first["devices"] == 1 else None)
        row["check_loss_rel_diff"] = _rel(row["check_loss"], first["check_loss"])
        row["check_grad_norm_rel_diff"] = _rel(row["check_grad_norm"], first["check_grad_norm"])
        if jax.process_index() == 0:
            _report(row, args.out)
        del learner, update, batch
        jax.clear_caches()


def _layers_per_gather(args, shape: dict, n: int) -> int:
    """``--fsdp-layers-per-gather``, or the CLI's automatic choice for the model in bf16 on ``n`` devices."""
    import jax

    from jrl.models.config import ModelConfig
    from jrl.sharding import memory_limit
    from jrl.train.fsdp_gathers import layers_per_gather, training_state_bytes

    device, params = jax.local_devices()[0], ModelConfig(**shape).num_params()
    return layers_per_gather(args.fsdp_layers_per_gather, devices=n, platform=device.platform, weight_bytes=2 * params,
                             state_bytes=training_state_bytes(params, 2, full=args.mode == "full"),
                             device_bytes=memory_limit(device))


def _profile(trace_dir: str, learner, update, batch) -> dict:
    """One traced update's kernels on the first device (:func:`kernels_common.kernel_profile`)."""
    def step():
        update(learner, batch)
        learner.block_until_ready()

    return C.kernel_profile(step, trace_dir=trace_dir, top=12)


def _gib(x) -> float | None:
    return None if x is None else round(x / 2**30, 2)


def exchange_times(mesh, args) -> dict:
    """One device's dispatch of ``tokens`` tokens (``tokens x top_k`` rows of ``hidden``, bf16) to the ``expert``
    axis, routed uniformly, three ways: the all-gather of the tokens that :mod:`jrl.models.expert_parallel` runs
    (each token moves once; its reduce-scatter back moves as much), a padded ``all_to_all`` (``ep x rows`` slots
    sent: dropless without a ragged exchange), and ``jax.lax.ragged_all_to_all`` (only the rows move, into a
    receive buffer sized for the worst case), whose placement is checked (float32, small rows) before it is timed.
    Milliseconds and MiB sent per device."""
    import functools

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    ep = mesh.shape["expert"]
    rows = args.tokens_per_device * args.top_k
    padded = jax.jit(jax.shard_map(functools.partial(jax.lax.all_to_all, axis_name="expert", split_axis=0,
                                                     concat_axis=0),
                                   mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))

    def ragged(x):  # x [rows, hidden]: this device's rows, rows/ep for each shard in shard order
        share = x.shape[0] // ep
        sizes = jnp.full((ep,), share, jnp.int32)
        me = jax.lax.axis_index("expert")
        return jax.lax.ragged_all_to_all(x, jnp.zeros((ep * x.shape[0], x.shape[1]), x.dtype),
                                         jnp.arange(ep, dtype=jnp.int32) * share, sizes,
                                         jnp.full((ep,), me * share, jnp.int32), sizes, axis_name="expert")

    spec = NamedSharding(mesh, P("expert"))
    mib = rows * args.hidden * 2 / 2**20
    gather = jax.jit(jax.shard_map(functools.partial(jax.lax.all_gather, axis_name="expert", axis=0, tiled=True),
                                   mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
    out = dict(token_all_gather_mib_per_device=round(mib / args.top_k * (ep - 1), 1),
               padded_all_to_all_mib_per_device=round(ep * mib, 1), ragged_all_to_all_mib_per_device=round(mib, 1))
    out["token_all_gather_ms"] = round(C.bench(gather, jax.device_put(
        jnp.ones((ep * args.tokens_per_device, args.hidden), jnp.bfloat16), spec))["ms"], 3)
    out["padded_all_to_all_ms"] = round(C.bench(padded, jax.device_put(
        jnp.ones((ep * ep, rows, args.hidden), jnp.bfloat16), spec))["ms"], 3)
    if jax.default_backend() == "cpu":  # XLA:CPU has no ragged all-to-all
        return out
    ragged = jax.jit(jax.shard_map(ragged, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
    small = 4 * ep
    probe = jnp.arange(ep * small * 8, dtype=jnp.float32).reshape(ep * small, 8)
    got = ragged(jax.device_put(probe, spec)).reshape(ep, ep * small, 8)
    share = small // ep
    for d in range(ep):  # device d holds, at s * share, the rows source s sent it
        for s in range(ep):
            want = probe[s * small + d * share:s * small + (d + 1) * share]
            if not bool(jnp.array_equal(got[d, s * share:(s + 1) * share], want)):
                raise SystemExit(f"ragged_all_to_all placed source {s}'s rows for device {d} wrongly")
    out["ragged_all_to_all_ms"] = round(C.bench(ragged, jax.device_put(
        jnp.ones((ep * rows, args.hidden), jnp.bfloat16), spec))["ms"], 3)
    return out


def exchange(args) -> None:
    """:func:`exchange_times` alone on ``expert=n`` meshes of the first ``n`` devices."""
    import jax

    from jrl.sharding import MeshConfig, make_mesh

    for n in (int(d) for d in args.devices.split(",") if int(d) > 1):
        mesh = make_mesh(MeshConfig(fsdp=1, expert=n), devices=jax.devices()[:n])
        _report(dict(bench="scaling_exchange", devices=n, tokens_per_device=args.tokens_per_device,
                     top_k=args.top_k, hidden=args.hidden, **exchange_times(mesh, args),
                     device=jax.devices()[0].device_kind, versions=f"jax {jax.__version__}"), args.out)


def dropped_rows(block, x) -> float:
    """The share of routed (token, expert) rows that ``block`` (expert-parallel, at its config's
    ``expert_capacity``) drops on ``x``, as the block itself reports it (``moe/dropped_rows``)."""
    from flax import nnx

    from jrl.models import router_stats

    @nnx.jit
    def share(block, x):
        with router_stats.collecting() as stats:
            block(x)
        return router_stats.summary(stats)["moe/dropped_rows"]

    return round(float(share(block, x)), 6)


def moe(args) -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jrl.models.moe import MoE
    from jrl.sharding import MeshConfig, batch_sharding, make_mesh, shard_model

    config = moe_config(args)
    if args.expert_capacity is not None:
        config = dataclasses.replace(config, expert_capacity=args.expert_capacity)
    config = dataclasses.replace(config, expert_chunks=args.expert_chunks)

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
            single = ms if n == 1 else single
            row = dict(bench="scaling_moe", devices=n, expert=expert, fsdp=n // expert, experts=args.experts,
                       expert_capacity=config.expert_capacity, expert_chunks=config.expert_chunks,
                       top_k=args.top_k, hidden=args.hidden, expert_size=args.expert_size,
                       tokens_per_device=args.tokens_per_device, fwd_bwd_ms=round(ms, 3),
                       efficiency=round(single / ms, 4) if single else None, device=jax.devices()[0].device_kind,
                       versions=f"jax {jax.__version__}")
            if expert > 1:
                row.update(exchange_times(mesh, args))
                row["dropped_rows"] = dropped_rows(block, x)
            if args.profile:
                row["profile"] = C.kernel_profile(forward_backward, block, x, top=12, trace_dir=os.path.join(
                    args.profile, f"moe{n}_expert{expert}"))
            _report(row, args.out)
            del block, x
            jax.clear_caches()


def own_experts(args) -> None:
    """One expert-parallel device's work between its collectives, on one device (``moe --own-experts EP``): the
    forward + backward of :func:`jrl.models.expert_parallel.own_experts` for device 0 of ``EP`` over ``EP x
    --tokens-per-device`` tokens and its ``E / EP`` experts, against the same function at ``EP = 1`` over
    ``--tokens-per-device`` tokens and every expert: the work a perfectly scaled layer would leave each device. Their
    ratio is the expert-parallel layer's efficiency before its collectives, timed on one GPU."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jrl.models.expert_parallel import capacity_rows, own_experts as own
    from jrl.models.moe import MoE, ROUTERS

    config = moe_config(args)
    capacity = args.expert_capacity or 0.0
    block = MoE(config, rngs=nnx.Rngs(0))
    params, _ = block.experts.arrays()
    baseline = None
    for ep in (1, args.own_experts):
        local = config.num_experts // ep
        x = jax.random.normal(jax.random.key(1), (ep * args.tokens_per_device, args.hidden), jnp.bfloat16)
        weights, ids = ROUTERS[config.router](block.router_logits(x), None, config)
        rows = capacity_rows(capacity, ids.size, ep)

        @jax.jit
        def forward_backward(params, x, weights=weights, ids=ids, rows=rows, local=local):
            def loss(params, x):
                y, _ = own(x, weights, ids, block.experts.compute, params, device=0, local_count=local, rows=rows)
                return jnp.sum(y ** 2)
            return jax.grad(loss, argnums=(0, 1))(params, x)

        mine = tuple(p[:local] for p in params)
        ms = C.bench(forward_backward, mine, x)["ms"]
        baseline = ms if ep == 1 else baseline
        row = dict(bench="scaling_moe_own_experts", ep=ep, experts=args.experts, local_experts=local,
                   expert_capacity=capacity, buffer_rows=rows or ids.size, top_k=args.top_k, hidden=args.hidden,
                   expert_size=args.expert_size, tokens_per_device=args.tokens_per_device, fwd_bwd_ms=round(ms, 3),
                   efficiency=round(baseline / ms, 4), device=jax.devices()[0].device_kind,
                   versions=f"jax {jax.__version__}")
        if args.profile:
            row["profile"] = C.kernel_profile(forward_backward, mine, x, top=12,
                                              trace_dir=os.path.join(args.profile, f"own_experts_ep{ep}"))
        _report(row, args.out)


def torch_sides(args) -> None:
    """The PyTorch peers of ``train``: transformers' model under FSDP2 (``fully_shard`` per decoder layer and the
    root) or DDP, bf16, fused AdamW, the same batch shape and loss, one process per GPU under torchrun."""
    single = {}
    for wrap in args.wraps.split(","):
        for n in (int(d) for d in args.devices.split(",")):
            if wrap == "ddp" and n == 1:
                continue
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__,
                   "torch-worker", "--wraps", wrap, "--shape", args.shape,
                   "--rows-per-device", str(args.rows_per_device), "--seq", str(args.seq), "--steps", str(args.steps),
                   "--mode", args.mode]
            cmd += (["--layers", str(args.layers)] if args.layers else []) + (["--torch-remat"] if args.torch_remat
                                                                               else [])
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if proc.returncode or not lines:
                error = _first_error((proc.stdout + proc.stderr).splitlines())
                _report(dict(bench="scaling_torch", wrap=wrap, devices=n, error=error), args.out)
                continue
            row = dict(json.loads(lines[-1][len("RESULT "):]), torch_remat=args.torch_remat)
            single.setdefault(wrap, row["tokens_per_s_per_device"] if n == 1 else None)
            base = single.get(wrap) or single.get("fsdp2")
            row["efficiency"] = round(row["tokens_per_s_per_device"] / base, 4) if base else None
            _report(row, args.out)


def _first_error(log: list[str]) -> str:
    """The first rank's exception line (torchrun interleaves every rank's traceback), or the log's last lines."""
    for line in log:
        text = line.split("]: ", 1)[1] if line.startswith("[rank") and "]: " in line else line
        if re.match(r"[\w.]+(Error|Exception)\b.*:", text):
            return text[:3000]
    return "\n".join(log[-30:])[-3000:]


def torch_worker(args) -> None:
    """One rank of :func:`torch_sides` (started by torchrun)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    gpu = torch.cuda.is_available()  # without one (a CPU check of the worker): gloo, plain AdamW
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if gpu else "gloo")
    shape = dict(T.SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    torch.manual_seed(0)
    # A MoE shape is built on the meta device and materialised after sharding: its whole weights (61 GB for
    # Qwen3-30B-A3B) need not fit one GPU.
    meta = bool(shape.get("num_experts")) and args.wraps == "fsdp2"
    model = T.hf_model(shape, args.seq, device="meta" if meta else device)
    if args.mode == "lora":
        import peft

        targets = T.MOE_LORA if shape.get("num_experts") else dict(target_modules=T.LORA_TARGETS)
        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=list(targets["target_modules"]),
            target_parameters=list(targets.get("target_parameters", ()))))
    if args.torch_remat:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if args.wraps == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in (model.get_base_model() if args.mode == "lora" else model).model.layers:
            fully_shard(layer)
        fully_shard(model)
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if gpu else None)
    if meta:
        _materialise(model, device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, fused=gpu)
    ids, mask, c_ids, c_mask, adv = (torch.from_numpy(np.asarray(x)).to(device) for x in T.make_batch(
        args.rows_per_device, args.seq, shape["vocab_size"], seed=rank))
    ids, c_ids = ids.long(), c_ids.long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0).long()
    t = c_ids.shape[1]

    def step():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=t + 1).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, c_ids[..., None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        a = adv[:, None]
        per_token = -torch.minimum(ratio * a, ratio.clamp(1 - T.CLIP_LOW, 1 + T.CLIP_HIGH) * a)
        m = c_mask.float()
        loss = (per_token * m).sum() / m.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    sync = torch.cuda.synchronize if gpu else (lambda: None)
    times = []
    for _ in range(args.steps):
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        loss = step()
        sync()
        times.append(time.perf_counter() - t0)
    med = T.steady_median(times)
    if rank == 0:
        print("RESULT " + json.dumps(dict(
            bench="scaling_torch", wrap=args.wraps, shape=args.shape, devices=world,
            rows_per_device=args.rows_per_device,
            seq=args.seq, step_s=round(med, 4), tokens_per_s_per_device=round(args.rows_per_device * args.seq / med),
            mfu=round(6 * T.active_params(shape) * args.rows_per_device * args.seq / med / (args.peak_tflops * 1e12),
                      4),
            mode=args.mode, last_loss=float(loss),
            peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if gpu else None,
            device=torch.cuda.get_device_name() if gpu else "cpu", versions=f"torch {torch.__version__}")),
            flush=True)
    dist.destroy_process_group()


def _materialise(model, device) -> None:
    """A model built on the meta device (and sharded) given storage on ``device`` and random weights: every
    parameter normal(0, 0.02) (the values do not matter to the timing), the rotary tables computed again."""
    import torch

    model.to_empty(device=device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for m in model.modules():
            if isinstance(getattr(m, "inv_freq", None), torch.Tensor):
                fresh = type(m)(m.config)
                for name, buf in fresh.named_buffers(recurse=False):
                    getattr(m, name).copy_(buf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("train", "torch", "moe", "exchange", "torch-worker"))
    ap.add_argument("--devices", default="1,2,4,8", help="comma list of device counts (the first n devices)")
    ap.add_argument("--out", default=None, help="append one JSON line per layout here")
    ap.add_argument("--expert-capacity", type=float, default=None,
                    help="train/moe: ModelConfig.expert_capacity (default: ModelConfig's)")
    ap.add_argument("--expert-chunks", type=int, default=1,
                    help="train/moe: ModelConfig.expert_chunks (a device's tokens in chunks, expert parallel layouts)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="train, moe: also trace one step per layout into DIR and report its GPU kernels (first "
                         "device): time by category, collectives' busy and exposed time, idle gaps")
    train_args = ap.add_argument_group("train")
    train_args.add_argument("--shape", choices=sorted(T.SHAPES), default="llama1b")
    train_args.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    train_args.add_argument("--mode", choices=("full", "lora"), default="full")
    train_args.add_argument("--rows-per-device", type=int, default=8)
    train_args.add_argument("--seq", type=int, default=1024)
    train_args.add_argument("--micro-batches", type=int, default=1,
                            help="micro-batches of --rows-per-device rows per GPU in a step (>1: gradients "
                                 "accumulated, then one optimizer update, as a GRPO step of many rows runs)")
    train_args.add_argument("--grad-sync", default="auto",
                            help="comma list of OptimConfig.grad_sync values, each run on every multi-device layout")
    train_args.add_argument("--check-rows", type=int, default=8,
                            help="rows of the numerics batch every layout updates on (divisible by every fsdp size)")
    train_args.add_argument("--layouts", default="fsdp",
                            help=f"comma list of layouts per device count: {', '.join(LAYOUTS)}")
    train_args.add_argument("--rules", default="",
                            help="logical-axis rule overrides, e.g. vocab=tensor+fsdp,mlp=tensor")
    train_args.add_argument("--tensor", type=int, default=1, help="also run fsdp=n/T, tensor=T layouts")
    train_args.add_argument("--init", choices=("host", "device"), default="host",
                            help="random weights drawn on the host (create_model) or on the devices (jax.random: "
                                 "seconds instead of minutes for a 30B shape; other values than the host draw's, the "
                                 "same on every layout)")
    train_args.add_argument("--steps", type=int, default=6)
    train_args.add_argument("--processes", type=int, default=1, help="one process per device group")
    train_args.add_argument("--timeout-s", type=float, default=1800, help="multi-process: wait this long at most")
    for name, default in (("attention", "auto"), ("remat", "auto"), ("logprobs", "auto"), ("loss_head", "auto")):
        train_args.add_argument("--" + name.replace("_", "-"), default=default, help=f"jrl {name} implementation")
    train_args.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True)
    train_args.add_argument("--fsdp-prefetch", action=argparse.BooleanOptionalAction, default=True,
                            help="jrl's per-device FSDP path (ModelConfig.fsdp_prefetch)")
    train_args.add_argument("--fsdp-layers-per-gather", type=int, default=None,
                            help="ModelConfig.fsdp_layers_per_gather: 0 gathers each layer in its checkpoint, P the "
                                 "layers gathered P at a time and kept for the backward; default: the CLI's "
                                 "automatic choice (jrl.train.fsdp_gathers)")
    train_args.add_argument("--peak-tflops", type=float, default=989.0,
                            help="dense bf16 peak of one GPU, for MFU (H100 SXM: 989)")
    train_args.add_argument("--wraps", default="fsdp2,ddp", help="torch: comma list of fsdp2, ddp")
    train_args.add_argument("--torch-remat", action="store_true",
                            help="torch: transformers' gradient checkpointing of every decoder layer")
    moe_args = ap.add_argument_group("moe")
    moe_args.add_argument("--tokens-per-device", type=int, default=8192)
    moe_args.add_argument("--experts", type=int, default=128)
    moe_args.add_argument("--top-k", type=int, default=8)
    moe_args.add_argument("--hidden", type=int, default=2048)
    moe_args.add_argument("--expert-size", type=int, default=768)
    moe_args.add_argument("--own-experts", type=int, default=0, metavar="EP",
                          help="moe: time one expert-parallel device's own work at EP devices, on one device")
    args = ap.parse_args()
    if args.what == "moe" and args.own_experts:
        own_experts(args)
    elif args.what == "moe":
        moe(args)
    elif args.what == "exchange":
        exchange(args)
    elif args.what == "torch":
        torch_sides(args)
    elif args.what == "torch-worker":
        torch_worker(args)
    elif args.processes > 1 and not local_processes.is_worker():
        sys.exit(local_processes.launch(__file__, sys.argv[1:], args.processes,
                                        max(int(d) for d in args.devices.split(",")), args.timeout_s))
    else:
        train(args)


if __name__ == "__main__":
    main()
