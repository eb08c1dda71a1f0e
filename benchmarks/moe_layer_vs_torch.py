"""One MoE layer, jrl vs PyTorch + transformers, on the same GPU: forward and forward+backward time.

    python benchmarks/moe_layer_vs_torch.py [--tokens 8192] [--experts 128] [--top-k 8] [--hidden 2048]
                                            [--expert-size 768] [--lora-rank 0] [--out rows.jsonl]

Defaults are Qwen3-30B-A3B's MoE layer. jrl: ``jrl.models.moe.MoE`` (router, expert sort, three grouped
matmuls by ``jrl.kernels.moe.gmm`` with ``impl="auto"``), jitted; the backward takes gradients of every
weight and of the input. PyTorch: transformers' ``Qwen3MoeSparseMoeBlock`` with each experts implementation
of ``--torch-experts`` (``eager``: a loop over the experts; ``grouped_mm``: ``torch._grouped_mm``), eager mode,
the same shapes and bfloat16 weights, ``loss.backward()`` through weights and input.
With ``--lora-rank R`` both train LoRA on the experts' gate/up and down weights (rank R, random non-zero A and
B) and the backward takes gradients of the adapters and the input only: jrl's ``ExpertsLoRA``
(``jrl.kernels.moe.gmm_lora``, no per-expert delta built) vs peft's ``target_parameters`` on the same block.
Both draw the router weights at random, so tokens spread over the experts about evenly. Times are medians of
CUDA-synchronised iterations after warm-up. Prints one JSON line per (framework, pass) and a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time

import kernels_common as C


def moe_config(a):
    """The bf16 ModelConfig of one Qwen3-MoE layer of ``a.experts`` experts (top ``a.top_k``), ``a.hidden`` wide,
    experts ``a.expert_size`` wide."""
    from jrl.models import ModelConfig

    return ModelConfig(model_type="qwen3_moe", vocab_size=128, hidden_size=a.hidden, intermediate_size=a.hidden,
                       num_hidden_layers=1, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                       qk_norm=True, num_experts=a.experts, num_experts_per_tok=a.top_k,
                       moe_intermediate_size=a.expert_size, norm_topk_prob=True, dtype="bfloat16",
                       param_dtype="bfloat16")


def jrl_times(a) -> dict[str, float]:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jrl.models.moe import MoE

    block = MoE(moe_config(a), rngs=nnx.Rngs(0))
    trained = nnx.Param
    if a.lora_rank:
        from jrl.models.lora import ExpertsLoRA, LoRAParam

        block.experts = ExpertsLoRA(block.experts, gate_up=True, down=True, rank=a.lora_rank, scale=2.0,
                                    key=jax.random.key(2))
        for i, var in enumerate((block.experts.lora_gate_b, block.experts.lora_up_b, block.experts.lora_down_b)):
            var.set_value(0.01 * jax.random.normal(jax.random.key(10 + i), var.shape, var.dtype))
        trained = LoRAParam
    x = jax.random.normal(jax.random.key(1), (1, a.tokens, a.hidden), jnp.bfloat16)
    forward = nnx.jit(lambda m, x: m(x))

    @nnx.jit
    def forward_backward(m, x):
        def loss(m, x):
            return jnp.sum(m(x).astype(jnp.float32) ** 2)
        return nnx.grad(loss, argnums=(nnx.DiffState(0, trained), 1))(m, x)

    return {"forward": C.bench(forward, block, x)["ms"], "forward+backward": C.bench(forward_backward, block, x)["ms"]}


def torch_times(a, experts_implementation: str) -> dict[str, float]:
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=a.hidden, moe_intermediate_size=a.expert_size, num_experts=a.experts,
                            num_experts_per_tok=a.top_k, norm_topk_prob=True)
    config._experts_implementation = experts_implementation
    block = Qwen3MoeSparseMoeBlock(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    if a.lora_rank:
        import peft

        block = peft.inject_adapter_in_model(peft.LoraConfig(
            r=a.lora_rank, lora_alpha=2 * a.lora_rank, target_modules=[],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"]), block)
        with torch.no_grad():
            for name, p in block.named_parameters():
                p.requires_grad_("lora_" in name)
                if "lora_B" in name:
                    p.normal_(0.0, 0.01)
        block = block.to("cuda", torch.bfloat16)
    x = torch.randn(1, a.tokens, a.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def forward():
        with torch.no_grad():
            block(x)

    def forward_backward():
        block.zero_grad(set_to_none=True)
        x.grad = None
        (block(x).float() ** 2).sum().backward()

    return {"forward": _torch_median(forward, a.reps), "forward+backward": _torch_median(forward_backward, a.reps)}


def _torch_median(fn, reps: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--expert-size", type=int, default=768)
    ap.add_argument("--torch-experts", default="grouped_mm,eager")
    ap.add_argument("--lora-rank", type=int, default=0, help="train LoRA of this rank on the experts (0: full)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    print(C.env_line(), flush=True)
    shape = dict(tokens=a.tokens, experts=a.experts, top_k=a.top_k, hidden=a.hidden, expert_size=a.expert_size,
                 lora_rank=a.lora_rank)
    # Expert matmul FLOPs: 3 matmuls of 2 * rows * H * I, rows = tokens * top_k (x3 with the backward).
    flops = 3 * 2 * a.tokens * a.top_k * a.hidden * a.expert_size
    results = {"jrl": jrl_times(a)}
    for impl in a.torch_experts.split(","):
        results[f"torch {impl}"] = torch_times(a, impl)
    for framework, times in results.items():
        for name, ms in times.items():
            backward = 2 if a.lora_rank else 3  # LoRA: no weight gradient of the experts
            tflops = flops * (backward if name == "forward+backward" else 1) / (ms * 1e-3) / 1e12
            C.report(dict(shape, framework=framework, pass_=name, ms=ms, expert_tflops=tflops), a.out)
    print("\n| pass | framework | ms | jrl speed-up |")
    print("|---|---|---|---|")
    for name in ("forward", "forward+backward"):
        for framework, times in results.items():
            print(f"| {name} | {framework} | {times[name]:.2f} | {times[name] / results['jrl'][name]:.2f}x |")


if __name__ == "__main__":
    main()
