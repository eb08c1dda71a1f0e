"""One GRPO update, jrl against the PyTorch + transformers loop a user would write, on the same GPU.

Both sides train the same random-weight model shape on the same batch: rows of ``--seq`` tokens, a
left-padded prompt of ``seq / 4`` tokens then a right-padded completion (real lengths drawn per row),
the DAPO token-level clipped loss with old log-probs = sg(current), global-norm clipping at 1.0 and AdamW.
jrl runs :class:`jrl.train.algorithms.grpo.PolicyUpdate` on a :class:`jrl.train.learner.Learner` (what the
trainer runs); PyTorch runs transformers' model (sdpa attention, fused AdamW), eagerly or with the loss
under ``torch.compile``. Each side runs in its own process so their memory does not mix.

Reported per side: median step time, tokens/s (every position of every row), MFU (6 · parameters ·
tokens per second against ``--peak-tflops``), peak device memory, and the first step's time minus the
median (compile time).

    python benchmarks/train_step_vs_torch.py --shape llama1b --batch 8 --seq 1024 --mode full \\
        --sides jrl,torch,torch_compile --out results.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_common import peak_bytes, report  # noqa: E402

SHAPES = {
    # Llama-3.2-1B
    "llama1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                    rope_theta=500000.0, tie_word_embeddings=True, qk_norm=False),
    # Qwen3-1.7B
    "qwen3_1.7b": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1000000.0, tie_word_embeddings=True, qk_norm=True),
    # Llama-3.1-8B
    "llama8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    rope_theta=500000.0, tie_word_embeddings=False, qk_norm=False),
    # Qwen3-8B
    "qwen3_8b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1000000.0, tie_word_embeddings=False, qk_norm=True),
    # Qwen3-30B-A3B (48 MoE layers, 128 experts, top-8; for `scaling.py train --init device` and `scaling.py torch`)
    "qwen3_30b_a3b": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          rope_theta=1000000.0, tie_word_embeddings=False, qk_norm=True, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768),
    # a smoke-test size for CPU
    "tiny": dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                 tie_word_embeddings=True, qk_norm=False),
    "tiny_moe": dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     rope_theta=10000.0, tie_word_embeddings=False, qk_norm=True, num_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=32),
}
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: LoRA of a MoE shape: attention, and every expert's gate/up and down projections.
MOE_LORA = dict(target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
                target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def make_batch(batch: int, seq: int, vocab: int, seed: int = 0):
    """(input_ids, attention_mask [B, S], completion_ids, completion_mask [B, T], advantages [B]) as numpy."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lp = seq // 4
    t = seq - lp
    p_len = rng.integers(lp * 3 // 4, lp + 1, batch)
    c_len = rng.integers(t * 2 // 3, t + 1, batch)
    p_mask = (np.arange(lp)[None] >= lp - p_len[:, None]).astype(np.int32)
    c_mask = (np.arange(t)[None] < c_len[:, None]).astype(np.int32)
    ids = rng.integers(0, vocab, (batch, seq)).astype(np.int32)
    ids[:, :lp] *= p_mask
    ids[:, lp:] *= c_mask
    return ids, np.concatenate([p_mask, c_mask], 1), ids[:, lp:].copy(), c_mask, rng.standard_normal(batch).astype(
        np.float32)


def num_params(shape: dict) -> int:
    sys.path.insert(0, str(REPO))
    from jrl.models.config import ModelConfig

    return ModelConfig(**shape).num_params()


def active_params(shape: dict) -> int:
    """The parameters one token passes through (for MFU): a MoE shape's unchosen experts left out."""
    experts = shape.get("num_experts", 0)
    if not experts:
        return num_params(shape)
    unchosen = experts - shape["num_experts_per_tok"]
    return num_params(shape) - shape["num_hidden_layers"] * unchosen * 3 * shape["hidden_size"] * shape[
        "moe_intermediate_size"]


def device_model(cfg, *, seed: int, mesh, rules):
    """A random :class:`~jrl.models.transformer.Transformer` drawn on the devices (``jax.random``, each parameter
    placed as ``create_model`` places it): for shapes whose host draw takes minutes. Its values differ from
    ``create_model``'s."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jrl.models.transformer import Transformer, named_params, param_shardings

    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed), mesh=mesh, rules=rules))
    shardings = param_shardings(model, mesh, rules) if mesh is not None else {}
    for i, (path, var) in enumerate(sorted(named_params(model).items())):
        shape, dtype = var.shape, var.dtype
        if path.endswith(".scale"):
            draw = lambda key, shape=shape, dtype=dtype: jnp.ones(shape, dtype)  # noqa: E731
        elif path.endswith(".bias"):
            draw = lambda key, shape=shape, dtype=dtype: jnp.zeros(shape, dtype)  # noqa: E731
        else:
            draw = lambda key, shape=shape, dtype=dtype: (  # noqa: E731
                jax.random.normal(key, shape, jnp.float32) * cfg.initializer_range).astype(dtype)
        var.set_value(jax.jit(draw, out_shardings=shardings.get(path))(jax.random.key(seed * 100003 + i)))
    return model


# ----------------------------------------------------------------------------------------------- jrl
def jrl_update(args, shape: dict, mesh=None, rules=None, micro_batch_size: int | None = None,
               grad_sync: str = "auto", layers_per_gather: int = 0, packing: bool = False, share_prompts: bool = False):
    """(learner, update): the benchmark's jrl side, on ``mesh`` when given (the model built sharded by
    ``rules``; batches are split over its batch axes); ``micro_batch_size``: rows per micro-batch (None: a step is one
    micro-batch, gradient and optimizer in one program); ``grad_sync``: ``OptimConfig.grad_sync``;
    ``layers_per_gather``: ``ModelConfig.fsdp_layers_per_gather``; ``packing``, ``share_prompts``: ``OptimConfig``'s."""
    sys.path.insert(0, str(REPO))
    from jrl.losses import GRPOConfig
    from jrl.models.config import ModelConfig
    from jrl.models.lora import LoraConfig, apply_lora
    from jrl.models.transformer import create_model
    from jrl.sharding import shard_model
    from jrl.train.algorithms.grpo_update import PolicyUpdate
    from jrl.train.config import OptimConfig
    from jrl.train.learner import Learner

    cfg = ModelConfig(**shape, dtype="bfloat16", param_dtype="bfloat16", attention=args.attention, remat=args.remat,
                      scan_layers=args.scan_layers, fsdp_prefetch=getattr(args, "fsdp_prefetch", True),
                      fsdp_layers_per_gather=layers_per_gather)
    if getattr(args, "init", "host") == "device":
        model = device_model(cfg, seed=0, mesh=mesh, rules=rules)
    else:
        model = create_model(cfg, seed=0, mesh=mesh, rules=rules)
    if args.mode == "lora":
        targets = MOE_LORA if shape.get("num_experts") else dict(target_modules=LORA_TARGETS)
        apply_lora(model, LoraConfig(rank=16, alpha=32.0, **targets))
        if mesh is not None:
            shard_model(model, mesh, rules)
    learner = Learner(model, OptimConfig(learning_rate=1e-6, max_grad_norm=1.0, micro_batch_size=micro_batch_size,
                                          grad_sync=grad_sync, packing=packing, share_prompts=share_prompts),
                      total_updates=1000, mesh=mesh, rules=rules)
    # The DAPO loss is token-level: the group size plays no part (advantages come with the batch).
    algo = GRPOConfig(loss_type="dapo", epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH)
    update = PolicyUpdate(algo, learner, temperature=1.0, num_iterations=1, impl=args.logprobs,
                          loss_head=args.loss_head)
    return learner, update


def step_batch(rows: int, seq: int, vocab: int, seed: int = 0):
    """:func:`make_batch` as a GRPO :class:`~jrl.train.algorithms.grpo.StepBatch`."""
    import numpy as np

    from jrl.train.algorithms.grpo_update import StepBatch

    ids, mask, c_ids, c_mask, adv = make_batch(rows, seq, vocab, seed)
    return StepBatch(input_ids=ids, attention_mask=mask, completion_ids=c_ids, completion_mask=c_mask,
                     advantages=adv, truncated=np.zeros(rows, bool))


def time_updates(learner, update, batch, steps: int) -> tuple[list[float], list[dict]]:
    """Wall time of ``steps`` updates (each until the new weights are ready) and their metrics."""
    times, metrics = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        metrics.append(update(learner, batch))
        learner.block_until_ready()
        times.append(time.perf_counter() - t0)
    return times, metrics


def run_jrl(args, shape: dict) -> dict:
    import jax

    learner, update = jrl_update(args, shape)
    batch = step_batch(args.batch, args.seq, shape["vocab_size"])
    times, metrics = time_updates(learner, update, batch, args.steps)
    peak = peak_bytes()
    profile = None
    if args.profile:
        from kernels_common import kernel_profile

        profile = kernel_profile(lambda: (update(learner, batch), learner.block_until_ready()), trace_dir=args.profile)
    return dict(times=times, peak_bytes=peak, loss=metrics[-1]["loss"],
                device=jax.local_devices()[0].device_kind, versions=f"jax {jax.__version__}", profile=profile)


# ------------------------------------------------------------------------------------------- PyTorch
def hf_config(shape: dict, max_len: int):
    """``(model class, config)`` of transformers for a benchmark shape (sdpa attention; MoE experts on
    ``torch._grouped_mm``)."""
    import transformers

    kw = dict(vocab_size=shape["vocab_size"], hidden_size=shape["hidden_size"],
              intermediate_size=shape["intermediate_size"], num_hidden_layers=shape["num_hidden_layers"],
              num_attention_heads=shape["num_attention_heads"], num_key_value_heads=shape["num_key_value_heads"],
              head_dim=shape["head_dim"], rope_theta=shape["rope_theta"],
              tie_word_embeddings=shape["tie_word_embeddings"],
              max_position_embeddings=max(4096, max_len), attn_implementation="sdpa")
    if shape["model_type"] == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**kw, num_experts=shape["num_experts"],
                                             num_experts_per_tok=shape["num_experts_per_tok"],
                                             moe_intermediate_size=shape["moe_intermediate_size"], norm_topk_prob=True,
                                             decoder_sparse_step=1, mlp_only_layers=[])
        config._experts_implementation = "grouped_mm"
        return transformers.Qwen3MoeForCausalLM, config
    if shape["model_type"] == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(**kw)
    return transformers.Qwen3ForCausalLM, transformers.Qwen3Config(**kw)


def hf_model(shape: dict, max_len: int, device: str = "cuda"):
    """A random-weight transformers model of a benchmark shape in bf16 on ``device`` (``meta``: shapes only)."""
    import torch

    cls, config = hf_config(shape, max_len)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # initialised in bf16 on the GPU: an 8B model's host init takes minutes
    try:
        with torch.device(device):
            return cls(config)
    finally:
        torch.set_default_dtype(default)


def run_torch(args, shape: dict, compiled: bool) -> dict:
    import numpy as np
    import torch
    import transformers

    model = hf_model(shape, args.seq)
    if args.mode == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=list(LORA_TARGETS)))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-6, fused=True)
    ids, mask, c_ids, c_mask, adv = (torch.from_numpy(np.asarray(x)).cuda() for x in make_batch(
        args.batch, args.seq, shape["vocab_size"]))
    ids, c_ids = ids.long(), c_ids.long()
    positions = (mask.cumsum(-1) - 1).clamp(min=0).long()
    lp = args.seq - c_ids.shape[1]
    base = model.get_base_model() if args.mode == "lora" else model

    def loss_fn(ids, mask, positions, c_ids, c_mask, adv):
        hidden = base.model(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
        logits = base.lm_head(hidden[:, lp - 1:-1]).float()
        logp = torch.log_softmax(logits, -1).gather(-1, c_ids[..., None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())
        a = adv[:, None]
        per_token = -torch.minimum(ratio * a, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * a)
        m = c_mask.float()
        return (per_token * m).sum() / m.sum()

    fn = torch.compile(loss_fn) if compiled else loss_fn

    def step():
        loss = fn(ids, mask, positions, c_ids, c_mask, adv)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times, losses = [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    peak = torch.cuda.max_memory_allocated()
    profile = None
    if args.profile:
        from kernels_common import summarize_kernels

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        kernels = [(e.time_range.start, e.time_range.elapsed_us(), e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA]
        profile = summarize_kernels(kernels)
    return dict(times=times, peak_bytes=peak, loss=losses[-1], profile=profile,
                device=torch.cuda.get_device_name(), versions=f"torch {torch.__version__}, "
                                                              f"transformers {transformers.__version__}")


# ------------------------------------------------------------------------------------------- driver
def steady_median(times: list[float]) -> float:
    """Median step time without the compiling first step (and the second, when there are enough)."""
    return statistics.median(times[2:] if len(times) > 3 else times[1:])


def summarize(side: str, args, shape: dict, raw: dict) -> dict:
    med = steady_median(raw["times"])
    tokens = args.batch * args.seq
    n = num_params(shape)
    return dict(side=side, shape=args.shape, layers=shape["num_hidden_layers"], mode=args.mode, batch=args.batch,
                seq=args.seq, attention=args.attention, remat=args.remat, loss_head=args.loss_head,
                scan_layers=args.scan_layers, step_s=round(med, 4),
                tokens_per_s=round(tokens / med), mfu=round(6 * n * tokens / med / (args.peak_tflops * 1e12), 4),
                peak_gib=None if raw["peak_bytes"] is None else round(raw["peak_bytes"] / 2**30, 2),
                compile_s=round(raw["times"][0] - med, 2), loss=raw["loss"], device=raw["device"],
                versions=raw["versions"], date=time.strftime("%Y-%m-%d"),
                **({"profile": raw["profile"]} if raw.get("profile") else {}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama1b")
    ap.add_argument("--layers", type=int, default=None, help="override the shape's layer count")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--mode", choices=("full", "lora"), default="full")
    ap.add_argument("--sides", default="jrl,torch", help="comma list of jrl, torch, torch_compile")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--attention", default="auto", help="jrl attention implementation")
    ap.add_argument("--remat", default="auto", help="jrl remat policy")
    ap.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                    help="jrl: stacked, scanned layers (--no-scan-layers: unrolled)")
    ap.add_argument("--logprobs", default="auto", help="jrl logprob kernel implementation")
    ap.add_argument("--loss-head", default="auto", help="jrl loss head: auto, fused, logprobs")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the GPU (H100 SXM: 989)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also trace one more step (jrl: into DIR) and report its GPU kernel time by category")
    ap.add_argument("--out", default=None, help="append one JSON line per side here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.worker:
        raw = run_jrl(args, shape) if args.worker == "jrl" else run_torch(args, shape, args.worker == "torch_compile")
        print("RESULT " + json.dumps(summarize(args.worker, args, shape, raw)), flush=True)
        return
    for side in args.sides.split(","):
        cmd = [sys.executable, __file__, *sys.argv[1:], "--worker", side]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
            row = dict(side=side, shape=args.shape, mode=args.mode, batch=args.batch, seq=args.seq,
                       error=tail[-1500:])
        else:
            row = json.loads(lines[-1][len("RESULT "):])
        report(row, args.out)


if __name__ == "__main__":
    main()
