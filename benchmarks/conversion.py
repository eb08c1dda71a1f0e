"""Checkpoint conversion benchmark: HF safetensors -> jrl (from_pretrained) and jrl -> HF (save_pretrained).

Builds a >= 1 GB random Llama-shaped bfloat16 checkpoint locally (shard by shard with jrl's streaming
safetensors writer; no torch, no network), then in fresh child processes measures

* import: ``from_pretrained(dtype=bfloat16)`` wall time, GB/s, and peak host RSS (VmHWM) against the
  largest shard and the checkpoint size;
* export: ``save_pretrained`` wall time and GB/s from the loaded model.

Prints a markdown table row per measurement. Page cache is warm (the checkpoint was just written).

    python benchmarks/conversion.py [--layers 10] [--hidden 2048] [--shard-size 300MB] [--dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def build_checkpoint(out: Path, *, layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int,
                     vocab: int, shard_size: str) -> dict:
    """Write a random bf16 Llama checkpoint (config.json, shards, index) without building a model."""
    import ml_dtypes

    from jrl.models import ModelConfig, Transformer
    from jrl.models.checkpoint import SAFE_INDEX, export_entries
    from jrl.models.checkpoint_writer import parse_size, write_safetensors

    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      rope_theta=500000.0, param_dtype="bfloat16", dtype="bfloat16")
    from flax import nnx

    from jrl.models import named_params

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    params = named_params(abstract)
    entries = export_entries(cfg, params)
    specs = [(e.hf_key, e.hf_shape(params[e.jrl_path].shape)) for e in entries]
    limit = parse_size(shard_size)
    shards, used = [[]], 0
    for key, shape in specs:
        n = math.prod(shape) * 2
        if shards[-1] and used + n > limit:
            shards.append([])
            used = 0
        shards[-1].append((key, shape))
        used += n
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)

    def arrays(items):
        for key, shape in items:
            if "norm" in key:
                yield np.ones(shape, ml_dtypes.bfloat16)
            else:
                yield (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    weight_map, sizes = {}, []
    for i, items in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(out / name, [(k, s, "bfloat16") for k, s in items], arrays(items))
        weight_map.update({k: name for k, _ in items})
        sizes.append((out / name).stat().st_size)
    total = sum(math.prod(s) * 2 for _, s in specs)
    (out / SAFE_INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(cfg.to_hf(dtype="bfloat16")))
    return dict(total_bytes=total, shards=len(shards), largest_shard=max(sizes), params=cfg.num_params())


def child(mode: str, ckpt: str, out: str | None) -> None:
    """Runs in a fresh process: import (and optionally export), report JSON on stdout."""
    import jax
    import jax.numpy as jnp

    from jrl.models import from_pretrained, named_params, save_pretrained

    jax.numpy.zeros(1).block_until_ready()
    base = _status_kb("VmRSS") * 1024
    t0 = time.perf_counter()
    model = from_pretrained(ckpt, dtype=jnp.bfloat16, progress=False)
    jax.block_until_ready([v[...] for v in named_params(model).values()])
    t1 = time.perf_counter()
    res = dict(load_s=t1 - t0, base_rss=base, peak_rss_load=_status_kb("VmHWM") * 1024,
               rss_after_load=_status_kb("VmRSS") * 1024)
    if mode == "export":
        t2 = time.perf_counter()
        save_pretrained(model, out, progress=False)
        res.update(save_s=time.perf_counter() - t2, peak_rss_save=_status_kb("VmHWM") * 1024)
    print("RESULT " + json.dumps(res))


def run_child(mode: str, ckpt: Path, out: Path | None = None) -> dict:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, __file__, "--child", mode, str(ckpt)] + ([str(out)] if out else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-4000:])
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=10)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard-size", default="300MB")
    p.add_argument("--dir", default=None, help="work directory (default: a temp dir, removed at the end)")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        mode, ckpt, *rest = args.child
        child(mode, ckpt, rest[0] if rest else None)
        return
    work = Path(args.dir or tempfile.mkdtemp(prefix="jrl-conv-bench-"))
    try:
        t0 = time.perf_counter()
        info = build_checkpoint(work / "ckpt", layers=args.layers, hidden=args.hidden,
                                intermediate=args.intermediate, heads=args.hidden // 128,
                                kv_heads=max(1, args.hidden // 256), vocab=args.vocab, shard_size=args.shard_size)
        build_s = time.perf_counter() - t0
        load = run_child("load", work / "ckpt")
        export = run_child("export", work / "ckpt", work / "export")
        gb = info["total_bytes"] / 1e9
        import jax

        print(f"\ncheckpoint: random Llama, {info['params'] / 1e6:.0f}M params, {gb:.2f} GB bf16, "
              f"{info['shards']} shards (largest {info['largest_shard'] / 1e6:.0f} MB), built in {build_s:.1f} s")
        print(f"host: {platform.machine()}, {os.cpu_count()} cores, jax {jax.__version__} "
              f"({os.environ.get('JAX_PLATFORMS', 'cpu')}), python {platform.python_version()}, "
              f"{datetime.date.today().isoformat()}; page cache warm\n")
        print("| direction | size (GB) | time (s) | GB/s | peak RSS (GB) | RSS before (GB) | peak - before (GB) "
              "| largest shard (GB) |")
        print("|---|---|---|---|---|---|---|---|")
        for name, secs, peak in (("import (from_pretrained)", load["load_s"], load["peak_rss_load"]),
                                 ("export (save_pretrained)", export["save_s"], export["peak_rss_save"])):
            base = load["base_rss"] if name.startswith("import") else export["base_rss"]
            print(f"| {name} | {gb:.2f} | {secs:.2f} | {gb / secs:.2f} | {peak / 1e9:.2f} | {base / 1e9:.2f} | "
                  f"{(peak - base) / 1e9:.2f} | {info['largest_shard'] / 1e9:.2f} |")
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
