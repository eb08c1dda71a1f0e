"""A whole GRPO step as a user runs it: sample, score, update, sync, through the trainer of ``jrl train``.

``prepare`` writes, under ``--work``: a random-weight Hugging Face checkpoint of a benchmark shape (``llama1b``,
``qwen3_1.7b``, ``llama8b``, ``tiny``; the shapes of ``train_step_vs_torch.py``, bf16; drawn by jrl on the host, or
with ``--init torch`` by transformers on the GPU) with a byte-level BPE
tokenizer trained offline on generated pseudo-word text (its vocabulary is smaller than the model's: sampled ids
past it decode to nothing), a prompt set of ``--prompt-tokens`` tokens per prompt, and a reward file (completion
length mod 5: cheap, and with spread, so no step is skipped for zero advantages). A random model rarely emits EOS,
so ``--mean-fraction`` sets the stop ids: the top ``k`` ids of the vocabulary, ``k`` chosen so that a uniform
sampler's truncated geometric length has mean ``mean-fraction x max-new-tokens`` (the measured mean is
reported; a random model's token distribution is not uniform).

``run`` builds the config from ``--work``'s files plus overrides, parses it with the CLI's own parser
(:func:`jrl.cli.train.parse_config`) and drives :class:`jrl.train.Trainer` step by step (what ``jrl train`` runs,
without the checkpoints). Layouts: ``one`` (one device), ``shared`` (every visible device: the learner's mesh, the
sampler on the same devices in ``rollout.mesh``'s layout), ``split`` (``--rollout-devices`` devices only
generate, with prefetch 1); ``shared`` as ``--processes P`` processes of the host's devices, joined as a pod's
hosts are (:mod:`local_processes`), times the multi-host path on one host. Weak scaling: ``--prompts-per-device``
prompts x ``--generations`` per learner device (in ``split``, per device of the whole host, so every layout trains
the same rows per device). Reported per step
(medians of the steps after the first, which compiles, and, when generation runs ahead, before the last, whose wall
is its update alone, without the steps that compiled for a second or more, listed in ``compiling_steps``; every
step's wall is kept in ``step_walls``): wall time; generate (``time/rollout``), experience
(``time/reward``: scoring, old/reference log-probs), update (``time/train``), weight sync (``time/sync``) and the
rest of the step (host gaps; negative where the trainer prepares a step during the previous update, as in
``split``: its wait, experience and update plan then fall in the previous step's wall, and the update counts its
launch and the wait for its metrics); generated tokens/s (real tokens) and trained tokens/s (prompt + completion tokens of
every row, padding excluded); peak device memory after the first generation and after the first step (JAX keeps
one peak per process); with ``--profile DIR`` the GPU busy fraction of one more step (the union of its kernels'
intervals on the first GPU over the step's wall time); the seconds each step spent compiling (``time/compile``) and,
on its printed line, the programs compiled (from JAX's compile log, which the run then keeps off stderr); with the
paged sampler, where its time went (prefill and decode seconds, decode steps, the slots' occupancy, ms per
decode step).

    python benchmarks/grpo_e2e.py prepare --work /tmp/e2e --shape llama1b --max-new-tokens 1024
    python benchmarks/grpo_e2e.py run --work /tmp/e2e --layout shared --steps 4 --out e2e.jsonl
    python benchmarks/grpo_e2e.py run --work /tmp/e2e --layout one --lora --steps 4 --out e2e.jsonl
    python benchmarks/grpo_e2e.py run --work /tmp/e2e --layout shared --processes 2 --steps 4 --out e2e.jsonl
    CUDA_VISIBLE_DEVICES=0 python benchmarks/grpo_e2e.py trl --work /tmp/e2e --steps 3 --out e2e.jsonl

``trl`` runs the peer, TRL's ``GRPOTrainer`` with its own ``generate`` (``use_vllm=False``), on the same checkpoint,
prompts, reward, group size, lengths and stop ids (DAPO, bf16 on a GPU, micro-batches of
``--micro-rows-per-device`` rows accumulated to one optimizer step per generation batch); it needs ``trl`` (and
its ``datasets``), which jrl does not depend on.

On CPU (the mechanism, not speed): ``prepare --shape tiny --prompt-tokens 32 --max-new-tokens 32`` and ``run
--layout one --prompts-per-device 2 --generations 4 --steps 2``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import math
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import local_processes  # noqa: E402
from kernels_common import report  # noqa: E402

#: A timed step that compiled at least this long is left out of the medians (``compiling_steps``).
COMPILING_STEP_S = 1.0
SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "ze", "pa", "qu", "xi", "do", "fe", "gu", "hy")
REWARD = '''def length_mod_5(prompts, completions, completion_ids, **kwargs):
    """Completion length mod 5: cheap, and with spread on a random model."""
    return [float(len(ids) % 5) for ids in completion_ids]
'''


def _words(rng, n: int) -> list[str]:
    return ["".join(rng.choice(SYLLABLES, size=rng.integers(1, 4))) for _ in range(n)]


def stop_count(vocab: int, max_new: int, mean_fraction: float) -> int:
    """Stop ids ``k`` such that a uniform sampler over ``vocab`` ids, stopping at any of ``k`` of them, has a mean
    completion length (geometric, truncated at ``max_new``) of ``mean_fraction x max_new``."""
    lo, hi = 1e-9, 50.0  # x = p * max_new; mean / max_new = (1 - exp(-x)) / x decreases in x
    for _ in range(100):
        x = (lo + hi) / 2
        lo, hi = (x, hi) if (1 - math.exp(-x)) / x > mean_fraction else (lo, x)
    return max(1, round(x / max_new * vocab))


def prepare(args) -> None:
    import numpy as np
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from train_step_vs_torch import SHAPES

    from jrl.models import ModelConfig, create_model, save_pretrained

    work, rng = Path(args.work), np.random.default_rng(0)
    model_dir = work / "model"
    shape = SHAPES[args.shape]
    t0 = time.perf_counter()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(args.tokenizer_vocab, shape["vocab_size"]),
                                  special_tokens=["<|eos|>", "<|pad|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((" ".join(_words(rng, 200)) for _ in range(2000)), trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", pad_token="<|pad|>")
    print(f"tokenizer: {tok.get_vocab_size()} ids ({time.perf_counter() - t0:.1f} s)", flush=True)

    t0 = time.perf_counter()
    if args.init == "torch":  # drawn on the GPU by transformers: an 8B model's host draw takes minutes
        from train_step_vs_torch import hf_model

        hf_model(shape, args.prompt_tokens + args.max_new_tokens).save_pretrained(str(model_dir))
    else:
        save_pretrained(create_model(ModelConfig(**shape, dtype="bfloat16", param_dtype="bfloat16"), seed=0),
                        model_dir, progress=True)
    tokenizer.save_pretrained(str(model_dir))
    print(f"model {args.shape}: written to {model_dir} ({time.perf_counter() - t0:.1f} s)", flush=True)

    with open(work / "prompts.jsonl", "w") as f:
        for i in range(args.num_prompts):
            ids = tokenizer(" ".join(_words(rng, args.prompt_tokens)))["input_ids"][:args.prompt_tokens]
            f.write(json.dumps({"prompt": tokenizer.decode(ids), "id": i}) + "\n")
    (work / "reward.py").write_text(REWARD)
    k = stop_count(shape["vocab_size"], args.max_new_tokens, args.mean_fraction)
    meta = dict(shape=args.shape, vocab_size=shape["vocab_size"], prompt_tokens=args.prompt_tokens,
                max_new_tokens=args.max_new_tokens, stop_ids=[shape["vocab_size"] - k, shape["vocab_size"]],
                mean_fraction=args.mean_fraction, tokenizer_vocab=tok.get_vocab_size())
    (work / "meta.json").write_text(json.dumps(meta))
    print(f"prompts: {args.num_prompts} x ~{args.prompt_tokens} tokens; stop ids: the top {k} of "
          f"{shape['vocab_size']}", flush=True)


def _overrides(args, meta: dict, devices: int) -> list[str]:
    work = Path(args.work)
    learner = devices - (args.rollout_devices if args.layout == "split" else 0)
    prompts = args.prompts_per_device * (devices if args.layout == "split" else learner)
    rows = prompts * args.generations
    lo, hi = meta["stop_ids"]
    out = ["--model.path", str(work / "model"), "--model.dtype", "bfloat16",
           "--data.source", str(work / "prompts.jsonl"), "--data.no-use-chat-template",
           "--data.max-prompt-length", str(meta["prompt_tokens"] + 8), "--data.prompts-per-batch", str(prompts),
           "--rewards", f"{work / 'reward.py'}:length_mod_5",
           "--rollout.max-new-tokens", str(meta["max_new_tokens"]), "--rollout.temperature", "1.0",
           "--rollout.stop-token-ids", *[str(i) for i in range(lo, hi)],
           "--algo.num-generations", str(args.generations), "--algo.loss-type", "dapo", "--algo.beta", "0.0",
           "--optim.learning-rate", "1e-6", "--optim.micro-batch-size",
           str(min(rows, args.micro_rows_per_device * learner)),
           "--max-steps", str(args.steps + bool(args.profile)), "--save-every", "0", "--log-every", "1",
           "--output-dir", str(work / f"run-{args.layout}-{devices}"), "--overwrite", "--seed", "0",
           "--compile-cache-dir", args.compile_cache or "None"]
    if args.layout == "split":
        out += ["--rollout.devices", str(args.rollout_devices), "--rollout.prefetch-depth", "1"]
    if args.rollout_mesh:
        for axis, size in (kv.split("=") for kv in args.rollout_mesh.split(",")):
            out += [f"--rollout.mesh.{axis}", size]
    if args.lora:
        out += ["lora:lora-config", "--lora.rank", str(args.lora_rank)]
    return out + args.extra


def _peak_gib() -> float | None:
    import jax

    stats = [d.memory_stats() or {} for d in jax.local_devices()]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    return round(max(peaks) / 2**30, 2) if peaks else None


def _busy_fraction(trace_dir: str, wall_s: float) -> float:
    """The union of the first GPU's kernel intervals in the trace under ``trace_dir`` over ``wall_s``."""
    from kernels_common import _union, trace_kernels

    busy = sum(end - start for start, end in _union([(ts, ts + dur) for ts, dur, _ in trace_kernels(trace_dir)]))
    return busy / 1e6 / wall_s


def _note_paged_generations(engine) -> list[dict]:
    """A list that each paged generation of ``engine`` (the embedded sampler with ``rollout.kv.layout paged``)
    appends its counts to (:func:`jrl.rollout.paged.generate_paged`'s); empty for other engines."""
    calls: list[dict] = []
    if getattr(engine, "kv", None) is None or engine.kv.layout != "paged":
        return calls
    paged_groups = engine.paged_groups

    def noted(*a, **kw):
        out = paged_groups(*a, **kw)
        calls.append({k: out[k] for k in ("prefill_s", "decode_s", "keep_s", "decode_steps", "slot_steps",
                                          "decoded_tokens", "rounds", "shrinks", "preempted", "pool")})
        return out

    engine.paged_groups = noted
    return calls


def _paged_figures(calls: list[dict]) -> dict:
    """The paged generations noted since the last call, summed (and forgotten): where their time went, and the largest
    pool a device held (pages)."""
    from jrl.rollout.paged import slot_occupancy

    if not calls:
        return {}
    total = {k: sum(c[k] for c in calls) for k in calls[0]}
    pool = max(c["pool"] for c in calls)
    calls.clear()
    return {"paged/prefill_s": total["prefill_s"], "paged/decode_s": total["decode_s"], "paged/keep_s": total["keep_s"],
            "paged/decode_steps": total["decode_steps"], "paged/rounds": total["rounds"],
            "paged/occupancy": slot_occupancy(total),
            "paged/ms_per_decode_step": 1e3 * total["decode_s"] / max(total["decode_steps"], 1),
            "paged/preempted": total["preempted"], "paged/pool_pages": pool}


class _CompiledPrograms(logging.Handler):
    """The names of the programs XLA compiles (JAX's compile log, ``jax_log_compiles``), counted until :meth:`take`:
    a step's ``time/compile`` says how long, this says what (e.g. a partial step's prefill for a new shape)."""

    LOGGERS = ("jax._src.interpreters.pxla", "jax._src.dispatch")  # the compile lines, the tracing lines

    def __init__(self):
        super().__init__()
        self.names: collections.Counter = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        found = re.match(r"Compiling (\S+) with", record.getMessage())
        if found:
            self.names[found.group(1)] += 1

    def take(self) -> collections.Counter:
        names, self.names = self.names, collections.Counter()
        return names

    @classmethod
    def attached(cls) -> _CompiledPrograms:
        """A handler on JAX's compile log, which then goes here instead of to stderr."""
        import jax

        jax.config.update("jax_log_compiles", True)
        handler = cls()
        for name in cls.LOGGERS:
            logger = logging.getLogger(name)
            logger.propagate = False
            logger.addHandler(handler)
        return handler


def run(args) -> None:
    import jax

    from jrl.cli.train import parse_config
    from jrl.sharding import initialize
    from jrl.train import Trainer

    initialize()  # with --processes: this process joins the others (a no-op for one)
    lead = jax.process_index() == 0
    meta = json.loads((Path(args.work) / "meta.json").read_text())
    devices = 1 if args.layout == "one" else jax.device_count()
    if args.layout == "one" and jax.device_count() > 1:
        raise SystemExit("--layout one needs one visible device (set CUDA_VISIBLE_DEVICES=0)")
    argv = _overrides(args, meta, devices)
    cfg = parse_config(argv)
    rows = cfg.data.prompts_per_batch * cfg.algo.num_generations
    say = functools.partial(print, flush=True) if lead else lambda *a, **kw: None
    say(f"# {args.layout} on {devices} device(s), {jax.process_count()} process(es): {rows} rows, {' '.join(argv)}")
    t0 = time.perf_counter()
    trainer = Trainer(cfg, progress=False)
    peaks = {}
    generate = trainer.source._generate

    def generate_and_note_peak(*a, **kw):  # the first generation's peak, before any update
        out = generate(*a, **kw)
        peaks.setdefault("after_generate", _peak_gib())
        return out

    trainer.source._generate = generate_and_note_peak
    paged = _note_paged_generations(trainer.source.engine)
    compiled = _CompiledPrograms.attached()
    compiled.take()  # the trainer's setup
    steps, busy = [], None
    try:
        for i in range(args.steps):
            t = time.perf_counter()
            m = trainer.train_step()
            m["wall"] = time.perf_counter() - t
            m.update(_paged_figures(paged))
            steps.append(m)
            peaks.setdefault("after_step", _peak_gib())
            partial = "".join(f", {k.removeprefix('partial/')} {v:.3g}" for k, v in sorted(m.items())
                              if k.startswith("partial/"))  # with rollout.partial: what was carried and restarted
            decode = "".join(f", {k.removeprefix('paged/')} {v:.3g}" for k, v in m.items() if k.startswith("paged/"))
            programs = ", ".join(f"{name} x{n}" if n > 1 else name for name, n in sorted(compiled.take().items()))
            say(f"step {i}: wall {m['wall']:.2f} s, generate {m['time/rollout']:.2f}, experience "
                f"{m['time/reward']:.2f}, update {m['time/train']:.2f}, sync {m['time/sync']:.2f}, compile "
                f"{m['time/compile']:.2f}, mean length {m['completions/mean_length']:.0f}{partial}{decode}"
                f"{f', compiled: {programs}' if programs else ''}")
        if args.profile:
            with jax.profiler.trace(args.profile, create_perfetto_trace=True):
                t = time.perf_counter()
                trainer.train_step()
                wall = time.perf_counter() - t
            busy = round(_busy_fraction(args.profile, wall), 3)
    finally:
        trainer.close()
    # Timed: the steps after the first (which compiles); when generating ahead, also before the last, which has no
    # next generation to wait for (its wall is the update alone, not the steady state's); and of those the ones that
    # compiled for less than COMPILING_STEP_S (a later step that meets a new shape, e.g. a packed-row layout the run
    # had not seen, is not the steady state either; its wall stays in step_walls and its index in compiling_steps).
    end = len(steps) - 1 if cfg.rollout.prefetch_depth > 0 and len(steps) > 2 else len(steps)
    compiling = [i for i in range(1, end) if steps[i]["time/compile"] >= COMPILING_STEP_S]
    timed = [m for i, m in enumerate(steps[1:end], 1) if i not in compiling] or steps[1:end] or steps

    def med(key):  # over the timed steps that have the figure (a partial step may not generate)
        return round(statistics.median(m[key] for m in timed if key in m), 3)

    wall = med("wall")
    prompt_tokens = meta["prompt_tokens"]
    lengths = statistics.median(m["completions/mean_length"] for m in timed)
    row = dict(shape=meta["shape"], layout=args.layout, devices=devices, processes=jax.process_count(), lora=args.lora,
               rollout_mesh=args.rollout_mesh or "default", overrides=" ".join(args.extra), rows=rows,
               max_new_tokens=meta["max_new_tokens"],
               mean_length=round(lengths, 1), step_s=wall, generate_s=med("time/rollout"),
               experience_s=med("time/reward"), update_s=med("time/train"), sync_s=med("time/sync"),
               wait_rollout_s=med("time/wait_rollout"), compile_s=med("time/compile"),
               **{k.replace("/", "_"): med(k) for k in dict.fromkeys(k for m in timed for k in m)
                  if k.startswith("paged/")},
               generated_tok_s=round(rows * lengths / wall), generated_tok_s_per_device=round(rows * lengths / wall
                                                                                               / devices),
               trained_tok_s=round(rows * (prompt_tokens + lengths) / wall),
               trained_tok_s_per_device=round(rows * (prompt_tokens + lengths) / wall / devices),
               peak_gib=peaks, gpu_busy=busy, steps=len(steps), timed_steps=len(timed),
               step_walls=[round(m["wall"], 3) for m in steps], compiling_steps=compiling,
               setup_and_steps_s=round(time.perf_counter() - t0, 1),
               device=jax.devices()[0].device_kind, jax=jax.__version__)
    # the trainer's thread waits for generation (all of it when synchronous), then works: the rest is host gaps
    row["host_gap_s"] = round(wall - row["wait_rollout_s"] - row["experience_s"] - row["update_s"] - row["sync_s"], 3)
    say(json.dumps(row))
    if args.out and lead:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


def trl_run(args) -> None:
    """The peer: TRL's ``GRPOTrainer`` (its own ``generate``, no vLLM) on the same checkpoint, prompts, reward, group
    size, lengths and stop ids, DAPO loss, bf16 on a GPU; seconds per optimizer step (one generation batch each).

    ``generate`` stops a row at any of the stop ids, as jrl's sampler does, but TRL's completion mask ends at the
    tokenizer's EOS only, so it counts the padding after another stop id as completion tokens: its logged lengths
    (``trl_mean_length``) are not the generated ones, and its loss covers the padding. Its update computes the
    padded batch either way, as jrl's does without ``optim.length_bucket``: the step times compare."""
    import importlib.util

    missing = [m for m in ("trl", "datasets") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"the trl case needs {' and '.join(missing)}, which jrl does not depend on: pip install trl "
                         "datasets, or, on a machine without a network, carry their wheels (and their dependencies') "
                         "in .whl")

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLGRPOConfig
    from trl import GRPOTrainer

    work = Path(args.work)
    meta = json.loads((work / "meta.json").read_text())
    spec = importlib.util.spec_from_file_location("e2e_reward", work / "reward.py")
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    tokenizer = AutoTokenizer.from_pretrained(str(work / "model"))
    prompts = [json.loads(line)["prompt"] for line in open(work / "prompts.jsonl")]
    rows = args.prompts_per_device * args.generations
    micro = min(rows, args.micro_rows_per_device)
    lo, hi = meta["stop_ids"]
    gpu = torch.cuda.is_available()
    cfg = TRLGRPOConfig(
        output_dir=str(work / "run-trl"), per_device_train_batch_size=micro, gradient_accumulation_steps=rows // micro,
        num_generations=args.generations, max_completion_length=meta["max_new_tokens"], temperature=1.0,
        loss_type="dapo", beta=0.0, learning_rate=1e-6, max_steps=args.steps, logging_steps=1, report_to=[],
        save_strategy="no", bf16=gpu, use_cpu=not gpu, seed=0,
        model_init_kwargs={"dtype": torch.bfloat16 if gpu else torch.float32},
        generation_kwargs={"eos_token_id": [tokenizer.eos_token_id, *range(lo, hi)]})
    steps, logged = [], []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **kw):
            steps.append(time.perf_counter() - self.t0)
            print(f"trl step {len(steps) - 1}: {steps[-1]:.2f} s", flush=True)

        def on_log(self, _args, _state, _control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                logged.append(dict(logs))

    trainer = GRPOTrainer(model=str(work / "model"), reward_funcs=reward.length_mod_5, args=cfg,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                          callbacks=[Timer()])
    trainer.train()
    timed = steps[1:] or steps
    wall = statistics.median(timed)
    lengths = statistics.median(log["completions/mean_length"] for log in logged[1:] or logged)
    row = dict(shape=meta["shape"], layout="trl", devices=1, rows=rows, max_new_tokens=meta["max_new_tokens"],
               trl_mean_length=round(float(lengths), 1), step_s=round(wall, 3), steps=len(steps), device=torch.cuda.get_device_name() if gpu else "cpu",
               trl=__import__("trl").__version__, torch=torch.__version__)
    report(row, args.out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--work", required=True)
    p.add_argument("--shape", default="llama1b")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=4096)
    p.add_argument("--max-new-tokens", type=int, default=1024)
    p.add_argument("--mean-fraction", type=float, default=0.4)
    p.add_argument("--tokenizer-vocab", type=int, default=16384)
    p.add_argument("--init", choices=("jrl", "torch"), default="jrl",
                   help="draw the random weights with jrl on the host, or with transformers on the GPU")
    r = sub.add_parser("run")
    r.add_argument("--work", required=True)
    r.add_argument("--layout", choices=("one", "shared", "split"), default="one")
    r.add_argument("--rollout-devices", type=int, default=2, help="split: devices that only generate")
    r.add_argument("--rollout-mesh", default="", help="rollout.mesh axis sizes, e.g. data=1,fsdp=-1 (default: "
                                                      "the config's default)")
    r.add_argument("--prompts-per-device", type=int, default=32)
    r.add_argument("--generations", type=int, default=8)
    r.add_argument("--steps", type=int, default=4)
    r.add_argument("--micro-rows-per-device", type=int, default=8, help="rows per learner device per micro-batch")
    r.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="TrainConfig.compile_cache_dir (default: off, so every case compiles as a first run would)")
    r.add_argument("--lora", action="store_true")
    r.add_argument("--lora-rank", type=int, default=16)
    r.add_argument("--profile", default=None, metavar="DIR")
    r.add_argument("--processes", type=int, default=1,
                   help="shared: the run as this many processes of the host's devices (one share each), "
                        "joined as a multi-host run's processes are; process 0 reports")
    r.add_argument("--timeout-s", type=float, default=1800, help="--processes: stop every process after this long")
    r.add_argument("--out", default=None)
    r.add_argument("extra", nargs="*", help="more config overrides (after --)")
    t = sub.add_parser("trl", help="the same steps with TRL's GRPOTrainer (one device)")
    t.add_argument("--work", required=True)
    t.add_argument("--prompts-per-device", type=int, default=32)
    t.add_argument("--generations", type=int, default=8)
    t.add_argument("--steps", type=int, default=3)
    t.add_argument("--micro-rows-per-device", type=int, default=8)
    t.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.command == "run" and args.processes > 1 and not local_processes.is_worker():
        if args.layout != "shared":
            raise SystemExit(f"--processes needs --layout shared, not {args.layout} (across processes a rollout mesh "
                             "of its own cannot generate ahead: rollout.prefetch_depth must be 0 there)")
        sys.exit(local_processes.launch(__file__, sys.argv[1:], args.processes, local_processes.host_device_count(),
                                        args.timeout_s))
    {"prepare": prepare, "run": run, "trl": trl_run}[args.command](args)


if __name__ == "__main__":
    main()
