"""Build jrl's shipped default model, ``models/tiny-arithmetic``, reproducibly from code.

    python scripts/make_default_model.py [--out models/tiny-arithmetic] [--seed 0]
        [--max-steps 1000] [--target-accuracy 0.3] [--eval-every 25] ...

GRPO's default run starts from this model, so it must be a policy that is *sometimes* right: if it
never solves a problem, no group of completions carries a learning signal; if it always does,
there is nothing left to learn. The script therefore

1. creates a small random Llama-shaped model (byte-level vocabulary of 262 tokens, head_dim 64 so
   vLLM's CPU attention backend accepts it),
2. runs a supervised warm-up with optax on the built-in arithmetic task, formatted exactly as GRPO
   prompts it (the default :class:`jrl.data.DataConfig`: the chat template with the generation
   prompt), followed by the reference ``solution`` and EOS, with the loss on completion tokens only,
3. every ``--eval-every`` steps samples completions at temperature 1.0 for held-out prompts (a
   different generator seed) and STOPS at the first evaluation whose exact-match accuracy reaches
   ``--target-accuracy`` (or after ``--max-steps``),
4. saves an HF directory (``config.json``, float32 ``model.safetensors``, the byte tokenizer,
   ``generation_config.json``), reloads it with :func:`jrl.models.from_pretrained`, measures the
   final greedy and temperature-1.0 accuracy on the reloaded weights, and writes a ``README.md``
   model card recording the command, seed, steps, data and those numbers.

Sampling here is a plain batched loop over full-sequence forward passes (no KV cache): simple and
obviously correct, and fast enough for a model this small.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jrl.data.pipeline import DataConfig, build_prompt_dataset, left_pad
from jrl.data.tasks.arithmetic import ArithmeticConfig, exact_match, format_answer, format_reward
from jrl.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, load_byte_tokenizer, save_byte_tokenizer
from jrl.models import ModelConfig, create_model, from_pretrained, save_pretrained
from jrl.models.checkpoint_writer import atomic_replace as replace_dir

#: Where the shipped model lives, relative to the repository root.
DEFAULT_OUT = Path(__file__).resolve().parent.parent / "models" / "tiny-arithmetic"
#: Longest correct reply of the default task: ``<answer>18</answer>`` (19 bytes) + EOS.
REPLY_TOKENS = len(format_answer(18).encode()) + 1
#: New tokens sampled when measuring accuracy (some slack beyond :data:`REPLY_TOKENS`).
MAX_NEW_TOKENS = 24
#: Completions sampled per prompt when measuring accuracy at temperature 1.0 (a GRPO group size).
GROUP_SIZE = 8


def model_config(args: argparse.Namespace) -> ModelConfig:
    """The architecture of the default model (Llama, float32 parameters)."""
    return ModelConfig(
        model_type="llama",
        vocab_size=VOCAB_SIZE,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.hidden_size // 64,
        num_key_value_heads=args.hidden_size // 64,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.02,
        dtype="float32",
        param_dtype="float32",
    )


# ---------------------------------------------------------------------------------------------
# Data


@dataclasses.dataclass
class Split:
    """Tokenized prompts of one arithmetic split, with their reference completions and columns."""

    data_config: DataConfig
    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    columns: dict[str, list]


def load_split(data_config: DataConfig, tokenizer) -> Split:
    """Prompts exactly as the GRPO pipeline builds them, plus ``solution`` + EOS as the target."""
    ds = build_prompt_dataset(data_config, tokenizer)
    solutions = tokenizer(ds.columns["solution"], add_special_tokens=False)["input_ids"]
    return Split(data_config, ds.prompt_ids, [list(s) + [EOS_ID] for s in solutions], ds.columns)


def sft_batch(split: Split, rows: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids [B, length], loss_mask [B, length])``: prompt + completion, right-padded; the mask is 1
    where the *next* token is a completion token (the positions whose prediction is trained)."""
    ids = np.full((len(rows), length), PAD_ID, np.int32)
    mask = np.zeros((len(rows), length), np.float32)
    for i, r in enumerate(rows):
        p, c = split.prompt_ids[r], split.completion_ids[r]
        seq = p + c
        if len(seq) > length:
            raise ValueError(f"example {r} has {len(seq)} tokens, more than the training length {length}")
        ids[i, : len(seq)] = seq
        mask[i, len(p) - 1 : len(seq) - 1] = 1.0
    return ids, mask


# ---------------------------------------------------------------------------------------------
# Training


def completion_loss(model, ids: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy over completion tokens."""
    logits = model(ids)[:, :-1]
    targets = ids[:, 1:]
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]
    m = mask[:, :-1]
    return (nll * m).sum() / jnp.maximum(m.sum(), 1.0)


@nnx.jit
def train_step(model, optimizer, ids, mask):
    loss, grads = nnx.value_and_grad(completion_loss)(model, ids, mask)
    optimizer.update(model, grads)
    return loss


# ---------------------------------------------------------------------------------------------
# Sampling and evaluation


@nnx.jit(static_argnames=("max_new_tokens", "temperature"))
def _generate(model, ids, mask, key, *, max_new_tokens: int, temperature: float):
    """Fill ``ids[:, P:]`` token by token; ``ids``/``mask`` are [B, P + max_new_tokens] with the
    left-padded prompts in the first P columns. Every step runs the full-sequence forward pass."""
    batch, total = ids.shape
    start = total - max_new_tokens

    def cond(carry):
        t, _, _, done = carry
        return (t < max_new_tokens) & ~done.all()

    def body(carry):
        t, ids, mask, done = carry
        hidden = model.hidden_states(ids, attention_mask=mask)
        last = jax.lax.dynamic_index_in_dim(hidden, start + t - 1, axis=1, keepdims=False)
        logits = model.logits(last)
        if temperature == 0.0:
            token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        else:
            token = jax.random.categorical(jax.random.fold_in(key, t), logits / temperature).astype(jnp.int32)
        token = jnp.where(done, PAD_ID, token)
        ids = jax.lax.dynamic_update_index_in_dim(ids, token, start + t, axis=1)
        mask = jax.lax.dynamic_update_index_in_dim(mask, (~done).astype(mask.dtype), start + t, axis=1)
        return t + 1, ids, mask, done | (token == EOS_ID)

    _, ids, _, _ = jax.lax.while_loop(cond, body, (jnp.int32(0), ids, mask, jnp.zeros((batch,), bool)))
    return ids[:, start:]


def sample(model, prompt_ids: list[list[int]], *, temperature: float, key: jax.Array,
           max_new_tokens: int = MAX_NEW_TOKENS) -> tuple[list[list[int]], list[bool]]:
    """``(completions, ended)``: the completion token ids of each prompt (up to and excluding EOS, or
    ``max_new_tokens`` tokens if none) and whether it ended with EOS."""
    prompts, prompt_mask = left_pad(prompt_ids, PAD_ID)
    pad = np.full((len(prompt_ids), max_new_tokens), PAD_ID, np.int32)
    ids = np.concatenate([prompts, pad], axis=1)
    mask = np.concatenate([prompt_mask, np.zeros_like(pad)], axis=1)
    out = np.asarray(_generate(model, jnp.asarray(ids), jnp.asarray(mask), key, max_new_tokens=max_new_tokens,
                               temperature=float(temperature)))
    completions = []
    for row in out.tolist():
        completions.append(row[: row.index(EOS_ID)] if EOS_ID in row else row)
    return completions, [EOS_ID in row for row in out.tolist()]


def evaluate(model, split: Split, tokenizer, *, num_prompts: int, samples_per_prompt: int, temperature: float,
             key: jax.Array, batch_size: int = 512) -> dict[str, float]:
    """Exact-match accuracy, format rate and EOS rate of completions for the first ``num_prompts``
    prompts of ``split`` (each sampled ``samples_per_prompt`` times); with several samples per prompt
    also the fraction of prompts whose group is mixed (0 < correct < samples), i.e. carries GRPO signal."""
    n = min(num_prompts, len(split.prompt_ids))
    rows = [r for r in range(n) for _ in range(samples_per_prompt)]
    texts, ended = [], []
    for b, lo in enumerate(range(0, len(rows), batch_size)):
        chunk = rows[lo : lo + batch_size]
        comps, eos = sample(model, [split.prompt_ids[r] for r in chunk], temperature=temperature,
                            key=jax.random.fold_in(key, b))
        texts += tokenizer.batch_decode(comps, skip_special_tokens=False)
        ended += eos
    prompts = [split.columns["prompt"][r] for r in rows]
    correct = np.array(exact_match(prompts, texts, answer=[split.columns["answer"][r] for r in rows]))
    formatted = np.array(format_reward(prompts, texts))
    out = {
        "accuracy": float(correct.mean()),
        "format_rate": float(formatted.mean()),
        "eos_rate": float(np.mean(ended)),
        "num_samples": len(rows),
    }
    if samples_per_prompt > 1:
        per_prompt = correct.reshape(n, samples_per_prompt).sum(1)
        out["mixed_group_rate"] = float(np.mean((per_prompt > 0) & (per_prompt < samples_per_prompt)))
    return out


# ---------------------------------------------------------------------------------------------
# Saving


def generation_config() -> dict:
    """Token ids only: sampling defaults (temperature, top-p) are left to the caller / GRPO config."""
    return {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}


def architecture_summary(cfg: ModelConfig) -> dict:
    """The config.json fields the model card states (checked against config.json by the tests)."""
    hf = cfg.to_hf()
    keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
            "tie_word_embeddings", "rope_theta", "rms_norm_eps", "bos_token_id", "eos_token_id", "pad_token_id",
            "dtype")
    return {**{k: hf[k] for k in keys}, "num_parameters": cfg.num_params()}


def model_card(*, command: str, args: argparse.Namespace, cfg: ModelConfig, train: Split, held_out: Split,
               overlap: float, steps: int, stopped_early: bool, final_loss: float, history: list[dict],
               greedy: dict, sampled: dict, wall_s: float, weights_bytes: int) -> str:
    arch = json.dumps(architecture_summary(cfg), indent=2)
    a_train, a_eval = train.data_config.arithmetic, held_out.data_config.arithmetic
    curve = "\n".join(
        f"| {h['step']} | {h['loss']:.4f} | {h['accuracy']:.3f} | {h['format_rate']:.3f} |" for h in history
    )
    stop = (f"stopped early at step {steps}, the first evaluation with temperature-1.0 accuracy >= "
            f"{args.target_accuracy}" if stopped_early else f"ran all {steps} steps (--max-steps)")
    ops = ", ".join(a_train.ops)
    return f"""# tiny-arithmetic

jrl's default model: a {cfg.num_params():,}-parameter Llama-architecture decoder with jrl's byte-level
tokenizer, briefly trained with supervised learning on jrl's built-in arithmetic task
(`builtin:arithmetic`, e.g. `What is 7+5?` -> `<answer>12</answer>`). The warm-up was stopped while
the model is only *partly* right, so that GRPO has something to learn: at temperature 1.0 most
groups of {GROUP_SIZE} completions for one prompt mix right and wrong answers.

It is not a useful language model; it exists so that jrl's default GRPO run works offline in
minutes on a CPU.

## How it was made

```
{command}
```

(`scripts/make_default_model.py` in the jrl repository, seed {args.seed}; {wall_s:.0f} s of wall time on {os.cpu_count()} CPU cores, JAX {jax.__version__}.)
The run is deterministic on a given machine and software stack; on other CPUs or library versions float rounding can differ slightly, and with it the step at which the early stop fires.

- **Model**: `jrl.models.create_model(config, seed={args.seed})`: normal(0, 0.02) weights, unit norms.
- **Data**: `jrl.data.build_prompt_dataset` with the default `DataConfig`, i.e. exactly the prompts GRPO's default run uses: {len(train.prompt_ids)} examples of `ArithmeticConfig(seed={a_train.seed})` (operands {a_train.min_operand}..{a_train.max_operand}, operators {ops}; {len(set(train.columns["prompt"]))} distinct questions), each rendered with the chat template and the generation prompt (`<|bos|><|user|>What is 7+5?<|eos|><|assistant|>`) and followed by the `solution` column and `<|eos|>`. Batches of {args.batch_size} examples drawn uniformly with replacement.
- **Loss**: mean next-token cross-entropy over the completion tokens (solution and `<|eos|>`) only.
- **Optimiser**: optax AdamW, learning rate {args.lr} (linear warm-up over {args.warmup_steps} steps, then constant), weight decay {args.weight_decay}, gradient clipping at global norm 1.0; float32.
- **Early stop** (`--target-accuracy {args.target_accuracy}`, `--max-steps {args.max_steps}`): every {args.eval_every} steps, {args.eval_prompts} held-out prompts x {GROUP_SIZE} samples at temperature 1.0; {stop}.
- **Held-out split**: `ArithmeticConfig(seed={a_eval.seed})`, same operands and operators. The task has few distinct questions, so {overlap:.0%} of the held-out questions also occur in the training split: the split measures accuracy on the task's distribution (what GRPO samples from), not generalisation to unseen questions.

## Result

Measured on the saved weights reloaded with `jrl.models.from_pretrained`, on the first {args.final_eval_prompts} held-out prompts (greedy: one completion each; temperature 1.0: {GROUP_SIZE} each), with at most {MAX_NEW_TOKENS} new tokens, each completion cut at its first `<|eos|>`; rewards are `jrl.data.tasks.arithmetic.exact_match` and `format_reward`.
A correct reply (`<answer>12</answer><|eos|>`) is {REPLY_TOKENS} tokens long at most, so sample at least that many new tokens: with fewer, no reply can be right.

| metric | greedy | temperature 1.0 |
|---|---|---|
| exact-match accuracy | {greedy['accuracy']:.3f} | {sampled['accuracy']:.3f} |
| format rate (`<answer>INT</answer>`) | {greedy['format_rate']:.3f} | {sampled['format_rate']:.3f} |
| ends with EOS | {greedy['eos_rate']:.3f} | {sampled['eos_rate']:.3f} |
| prompts whose {GROUP_SIZE} samples mix right and wrong | - | {sampled['mixed_group_rate']:.3f} |

Training steps: {steps}. Final training loss (mean of the last {min(25, steps)} steps): {final_loss:.4f}.

Warm-up curve (held-out, temperature 1.0, {args.eval_prompts} prompts x {GROUP_SIZE} samples):

| step | train loss | accuracy | format rate |
|---|---|---|---|
{curve}

## Architecture

Parameters are stored in float32 (`model.safetensors`, {weights_bytes / 1e6:.2f} MB): GRPO starts from exactly the weights measured above (no rounding to bfloat16), and the directory is still only a few MB.
head_dim is 64 because vLLM's CPU attention backend rejects smaller heads.

```json
{arch}
```

## Files

`config.json`, `model.safetensors`, `generation_config.json` (`eos_token_id` = `<|eos|>` = {EOS_ID}), `tokenizer.json`, `tokenizer_config.json` (with the chat template) and `special_tokens_map.json`.
The directory loads with `jrl.models.from_pretrained` and with `transformers`' `AutoModelForCausalLM` / `AutoTokenizer`.
"""


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output HF directory (replaced atomically)")
    p.add_argument("--seed", type=int, default=0, help="seed of the init, the batch order and the sampling")
    p.add_argument("--max-steps", type=int, default=1000, help="upper bound on optimiser steps")
    p.add_argument("--target-accuracy", type=float, default=0.3,
                   help="stop at the first evaluation whose held-out exact-match accuracy at temperature 1.0 "
                        "reaches this; 0 disables early stopping (train exactly --max-steps)")
    p.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    p.add_argument("--eval-prompts", type=int, default=48, help="held-out prompts per evaluation during training")
    p.add_argument("--final-eval-prompts", type=int, default=256, help="held-out prompts of the final evaluation")
    p.add_argument("--held-out-seed", type=int, default=1, help="ArithmeticConfig.seed of the held-out split")
    p.add_argument("--batch-size", type=int, default=64, help="sequences per optimiser step")
    p.add_argument("--lr", type=float, default=1e-3, help="peak AdamW learning rate")
    p.add_argument("--warmup-steps", type=int, default=20, help="linear learning-rate warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay")
    p.add_argument("--hidden-size", type=int, default=128, help="hidden size (a multiple of head_dim 64)")
    p.add_argument("--intermediate-size", type=int, default=384, help="SwiGLU MLP width")
    p.add_argument("--num-layers", type=int, default=2, help="decoder layers")
    args = p.parse_args(argv)
    if args.hidden_size % 64:
        p.error(f"--hidden-size {args.hidden_size} must be a multiple of 64 (head_dim 64)")
    if not 0.0 <= args.target_accuracy <= 1.0:
        p.error(f"--target-accuracy {args.target_accuracy} must be in [0, 1]")
    for name in ("max_steps", "eval_every", "eval_prompts", "final_eval_prompts", "batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    t0 = time.perf_counter()
    command = shlex.join(["python", "scripts/make_default_model.py", *(sys.argv[1:] if argv is None else argv)])
    tokenizer = load_byte_tokenizer()
    train = load_split(DataConfig(), tokenizer)
    held_out = load_split(DataConfig(arithmetic=ArithmeticConfig(seed=args.held_out_seed)), tokenizer)
    train_questions = set(train.columns["prompt"])
    overlap = float(np.mean([q in train_questions for q in held_out.columns["prompt"]]))
    length = max(len(p) + len(c) for p, c in zip(train.prompt_ids, train.completion_ids))
    print(f"data: {len(train.prompt_ids)} training examples ({len(train_questions)} distinct questions), "
          f"{len(held_out.prompt_ids)} held-out (seed {args.held_out_seed}; {overlap:.0%} of its questions also in "
          f"training); sequence length {length}", flush=True)

    cfg = model_config(args)
    model = create_model(cfg, seed=args.seed)
    print(f"model: llama, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
          f"x {cfg.head_dim}, mlp {cfg.intermediate_size}, {cfg.num_params():,} parameters", flush=True)
    schedule = optax.join_schedules([optax.linear_schedule(0.0, args.lr, args.warmup_steps),
                                     optax.constant_schedule(args.lr)], [args.warmup_steps])
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=args.weight_decay))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    rng = np.random.default_rng(args.seed)
    key = jax.random.key(args.seed)
    losses: list[float] = []
    history: list[dict] = []
    stopped_early = False
    step = 0
    while step < args.max_steps:
        rows = rng.integers(0, len(train.prompt_ids), size=args.batch_size)
        ids, mask = sft_batch(train, rows, length)
        losses.append(float(train_step(model, optimizer, jnp.asarray(ids), jnp.asarray(mask))))
        step += 1
        if step % args.eval_every == 0 or step == args.max_steps:
            ev = evaluate(model, held_out, tokenizer, num_prompts=args.eval_prompts, samples_per_prompt=GROUP_SIZE,
                          temperature=1.0, key=jax.random.fold_in(key, step))
            loss = float(np.mean(losses[-args.eval_every :]))
            history.append({"step": step, "loss": loss, **ev})
            print(f"step {step:5d}  loss {loss:.4f}  T=1.0 accuracy {ev['accuracy']:.3f}  format {ev['format_rate']:.3f}"
                  f"  mixed groups {ev['mixed_group_rate']:.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
            if args.target_accuracy > 0 and ev["accuracy"] >= args.target_accuracy:
                stopped_early = True
                break
    if not stopped_early and args.target_accuracy > 0:
        print(f"warning: held-out accuracy never reached --target-accuracy {args.target_accuracy} in "
              f"{args.max_steps} steps", flush=True)

    # Build the whole directory (weights, tokenizer, generation config, then the card with the numbers
    # measured on the saved files) beside the destination and swap it in at the end, so a crash never
    # leaves a model without its card.
    out = Path(args.out)
    building = out.parent / f".{out.name}.building-{os.getpid()}"
    with tempfile.TemporaryDirectory() as staging:
        save_byte_tokenizer(staging)
        (Path(staging) / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")
        save_pretrained(model, building, source_dir=staging)  # copies those files from source_dir
    try:
        reloaded = from_pretrained(building, dtype=jnp.float32)
        final_key = jax.random.fold_in(key, 10**9)
        greedy = evaluate(reloaded, held_out, tokenizer, num_prompts=args.final_eval_prompts, samples_per_prompt=1,
                          temperature=0.0, key=final_key)
        sampled = evaluate(reloaded, held_out, tokenizer, num_prompts=args.final_eval_prompts,
                           samples_per_prompt=GROUP_SIZE, temperature=1.0, key=final_key)
        wall_s = time.perf_counter() - t0
        weights_bytes = (building / "model.safetensors").stat().st_size
        final_loss = float(np.mean(losses[-25:]))
        card = model_card(command=command, args=args, cfg=cfg, train=train, held_out=held_out, overlap=overlap,
                          steps=step, stopped_early=stopped_early, final_loss=final_loss, history=history,
                          greedy=greedy, sampled=sampled, wall_s=wall_s, weights_bytes=weights_bytes)
        (building / "README.md").write_text(card)
        replace_dir(building, out)
    finally:
        shutil.rmtree(building, ignore_errors=True)
    summary = {
        "out": str(out), "steps": step, "stopped_early": stopped_early, "final_loss": final_loss,
        "greedy": greedy, "temperature_1": sampled, "weights_bytes": weights_bytes,
        "dir_bytes": sum(f.stat().st_size for f in out.iterdir() if f.is_file()), "wall_s": round(wall_s, 1),
    }
    print(json.dumps(summary, indent=2), flush=True)
    return summary


if __name__ == "__main__":
    main()
