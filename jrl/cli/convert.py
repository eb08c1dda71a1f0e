"""Convert a Hugging Face checkpoint through jrl and back (import, re-export), or run a self-contained demo.

    python scripts/convert.py HF_DIR OUT_DIR [--dtype float32] [--max-shard-size 5GB] [--verify]
    python scripts/convert.py --demo

``HF_DIR -> OUT_DIR`` loads the checkpoint with ``jrl.models.from_pretrained`` and writes it back with
``save_pretrained`` (config, safetensors shards, index, tokenizer files), then prints a summary.
``--verify`` re-reads both directories and compares every tensor.

``--demo`` needs no torch and no network: it builds a tiny random Llama in jrl, saves it as an HF directory,
re-imports it and prints the parameter count, conversion times and the max logit difference (0.0 expected).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jrl.models import ModelConfig, RopeScaling, create_model, from_pretrained, named_params, save_pretrained


def _nbytes(model) -> int:
    return sum(v[...].size * v[...].dtype.itemsize for v in named_params(model).values())


def _dir_tensors(path: Path):
    from safetensors import safe_open

    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as sf:
            for k in sf.keys():
                yield k, f.name, sf


def verify(src: Path, out: Path) -> tuple[int, float, bool]:
    """(tensors compared, max abs diff, all bitwise equal) between two HF directories."""
    from safetensors import safe_open

    out_files = {k: f for k, f, _ in _dir_tensors(out)}
    n, worst, bitwise = 0, 0.0, True
    for key, _, sf in _dir_tensors(src):
        if key not in out_files:
            if key == "lm_head.weight" or key.endswith("rotary_emb.inv_freq"):
                continue
            raise SystemExit(f"verify: {key} is missing from {out}")
        a = sf.get_tensor(key)
        with safe_open(str(out / out_files[key]), framework="np") as g:
            b = g.get_tensor(key)
        if a.shape != b.shape:
            raise SystemExit(f"verify: {key} has shape {a.shape} in {src} but {b.shape} in {out}")
        bitwise &= a.dtype == b.dtype and a.tobytes() == b.tobytes()
        worst = max(worst, float(np.abs(a.astype(np.float32) - b.astype(np.float32)).max()))
        n += 1
    return n, worst, bitwise


def convert(hf_dir: str, out_dir: str, dtype: str, max_shard_size: str, check: bool) -> None:
    t0 = time.perf_counter()
    model = from_pretrained(hf_dir, dtype=jnp.dtype(dtype))
    t1 = time.perf_counter()
    out = save_pretrained(model, out_dir, max_shard_size=max_shard_size)
    t2 = time.perf_counter()
    cfg = model.config
    size = _nbytes(model)
    print(f"model_type      {cfg.model_type} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}"
          + (f", {cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if cfg.is_moe else "") + ")")
    print(f"parameters      {cfg.num_params():,} ({size / 1e9:.3f} GB as {cfg.param_dtype})")
    print(f"import          {t1 - t0:.2f} s ({size / 1e9 / max(t1 - t0, 1e-9):.2f} GB/s)")
    print(f"export          {t2 - t1:.2f} s -> {out}")
    print(f"files           {', '.join(sorted(p.name for p in out.iterdir()))}")
    if check:
        n, worst, bitwise = verify(Path(hf_dir), out)
        print(f"verify          {n} tensors, max |diff| {worst:.3g}, bitwise identical: {bitwise}")


def demo() -> float:
    """Tiny random Llama: jrl -> HF directory -> jrl. Returns the max logit difference."""
    config = ModelConfig(
        model_type="llama", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=500000.0, max_position_embeddings=256,
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64), bos_token_id=1, eos_token_id=2,
    )
    model = create_model(config, seed=0)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, (2, 32)), jnp.int32)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        out = save_pretrained(model, Path(tmp) / "tiny-llama", max_shard_size="1MB")
        t1 = time.perf_counter()
        again = from_pretrained(out, dtype=jnp.float32)
        t2 = time.perf_counter()
        files = sorted(p.name for p in out.iterdir())
    forward = nnx.jit(lambda m, x: m(x))
    diff = float(jnp.abs(forward(model, ids) - forward(again, ids)).max())
    print(f"jrl demo: random Llama ({config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"vocab {config.vocab_size}, llama3 rope) on {jax.default_backend()}")
    print(f"parameters       {config.num_params():,} ({_nbytes(model) / 1e6:.2f} MB float32)")
    print(f"save_pretrained  {t1 - t0:.3f} s -> {len(files)} files: {', '.join(files)}")
    print(f"from_pretrained  {t2 - t1:.3f} s")
    print(f"max |logit diff| {diff:.3g} (jrl -> HF -> jrl)")
    return diff


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("hf_dir", nargs="?", help="Hugging Face checkpoint directory (config.json + *.safetensors)")
    p.add_argument("out_dir", nargs="?", help="where to write the re-exported checkpoint")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                   help="dtype to load (and re-export) the weights in (default: bfloat16)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default: 5GB)")
    p.add_argument("--verify", action="store_true", help="compare every exported tensor with the source")
    p.add_argument("--demo", action="store_true", help="self-contained round trip of a tiny random Llama")
    args = p.parse_args(argv)
    if args.demo:
        return 0 if demo() == 0.0 else 1
    if not (args.hf_dir and args.out_dir):
        p.error("HF_DIR and OUT_DIR are required (or pass --demo)")
    convert(args.hf_dir, args.out_dir, args.dtype, args.max_shard_size, args.verify)
    return 0


if __name__ == "__main__":
    sys.exit(main())
