"""The shipped default model ``models/tiny-arithmetic``: it loads in jrl and in transformers (local files
only) with the same logits, its tokenizer is jrl's byte tokenizer, its model card tells the truth
about its config and its greedy accuracy, and it answers in the task's ``<answer>N</answer>`` format."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from jrl.data.tasks.arithmetic import ArithmeticConfig, exact_match, format_reward, generate_arithmetic
from jrl.data.tokenizer import BOS_ID, CHAT_TEMPLATE, EOS_ID, PAD_ID, VOCAB_SIZE

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "tiny-arithmetic"
SCRIPT = ROOT / "scripts" / "make_default_model.py"


@pytest.fixture(scope="module")
def hf_model():
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32, attn_implementation="eager",
                                                       output_loading_info=True, local_files_only=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


@pytest.fixture(scope="module")
def jrl_model():
    import jax.numpy as jnp

    from jrl.models import from_pretrained

    return from_pretrained(MODEL_DIR, dtype=jnp.float32)


@pytest.fixture(scope="module")
def card() -> str:
    return (MODEL_DIR / "README.md").read_text()


def held_out_prompts(tokenizer, n: int) -> tuple[list[dict], list[list[int]]]:
    records = generate_arithmetic(ArithmeticConfig(seed=1, num_examples=n))
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], add_generation_prompt=True,
                                           tokenize=False) for r in records]
    return records, tokenizer(texts, add_special_tokens=False)["input_ids"]


def test_jrl_and_transformers_logits_agree(jrl_model, hf_model, hf_tokenizer):
    import torch

    records, prompt_ids = held_out_prompts(hf_tokenizer, 4)
    solutions = hf_tokenizer([r["solution"] for r in records], add_special_tokens=False)["input_ids"]
    seqs = [p + s + [EOS_ID] for p, s in zip(prompt_ids, solutions)]
    length = min(map(len, seqs))
    task = np.array([s[:length] for s in seqs], np.int32)
    noise = np.random.default_rng(0).integers(0, VOCAB_SIZE, size=(2, 40)).astype(np.int32)
    for ids in (task, noise):
        ours = np.asarray(jrl_model(ids))
        with torch.no_grad():
            theirs = hf_model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
        assert ours.shape == theirs.shape == (*ids.shape, VOCAB_SIZE)
        assert np.isfinite(ours).all()
        diff = float(np.abs(ours - theirs).max())
        assert diff <= 1e-4, f"max |jrl - transformers| logits = {diff}"
        # Trained, not random: the logits are far from uniform.
        assert float(np.abs(theirs).max()) > 1.0


def _card_json_block(card: str, heading: str) -> dict:
    section = card.split(f"## {heading}", 1)
    assert len(section) == 2, f"model card has no '## {heading}' section"
    m = re.search(r"```json\n(.*?)\n```", section[1], re.S)
    assert m, f"model card section '{heading}' has no json block"
    return json.loads(m.group(1))


def test_config_is_what_the_model_card_says(card):
    from safetensors import safe_open

    from jrl.models import ModelConfig

    stated = _card_json_block(card, "Architecture")
    config = json.loads((MODEL_DIR / "config.json").read_text())
    for key, value in stated.items():
        if key != "num_parameters":
            assert config[key] == value, f"config.json {key}={config[key]!r}, model card says {value!r}"
    with safe_open(MODEL_DIR / "model.safetensors", "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert sum(t.size for t in tensors.values()) == stated["num_parameters"]
    assert ModelConfig.from_hf(config).num_params() == stated["num_parameters"]
    assert {str(t.dtype) for t in tensors.values()} == {stated["dtype"]}
    assert config["vocab_size"] == VOCAB_SIZE and config["head_dim"] == 64
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (BOS_ID, EOS_ID, PAD_ID)
    generation = json.loads((MODEL_DIR / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS_ID
    assert "python scripts/make_default_model.py" in card
    total = sum(p.stat().st_size for p in MODEL_DIR.iterdir() if p.is_file())
    assert total < 5e6, f"{MODEL_DIR.name} holds {total} bytes; keep the shipped model under 5 MB"


def test_tokenizer_is_the_byte_tokenizer_and_round_trips(hf_tokenizer):
    tok = hf_tokenizer
    assert len(tok) == VOCAB_SIZE
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert tok.chat_template == CHAT_TEMPLATE
    for text in ("What is 7+5?", "<answer>-12</answer>", "  spaces\tand\nnewlines ", "naïve 数学 🙂"):
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
    rendered = tok.apply_chat_template([{"role": "user", "content": "What is 7+5?"}], add_generation_prompt=True,
                                       tokenize=False)
    assert rendered == "<|bos|><|user|>What is 7+5?<|eos|><|assistant|>"


def test_greedy_replies_use_the_answer_format(hf_model, hf_tokenizer):
    """transformers' own greedy generation (stopping at generation_config's EOS) on held-out prompts."""
    import torch

    records, prompt_ids = held_out_prompts(hf_tokenizer, 8)
    assert len({len(p) for p in prompt_ids}) == 1  # equal lengths: no padding needed
    with torch.no_grad():
        out = hf_model.generate(torch.tensor(prompt_ids), attention_mask=torch.ones(len(prompt_ids), len(prompt_ids[0]),
                                dtype=torch.long), do_sample=False, max_new_tokens=24)
    completions = out[:, len(prompt_ids[0]):].tolist()
    texts = [hf_tokenizer.decode(c[: c.index(EOS_ID)] if EOS_ID in c else c) for c in completions]
    ended = sum(EOS_ID in c for c in completions)
    formatted = sum(format_reward(None, texts))
    assert ended >= 4 and formatted >= 4, f"only {formatted}/8 greedy replies are well-formed: {texts}"
    # The replies depend on the question (not one memorised string), and some are right.
    assert len(set(texts)) > 1, texts
    assert sum(exact_match(None, texts, answer=[r["answer"] for r in records])) >= 1, texts


def _load_script():
    name = "jrl_make_default_model_script"
    if name not in sys.modules:  # dataclasses need the module registered while it executes
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def test_model_card_greedy_accuracy_is_reproduced(jrl_model, card):
    """Re-measure the card's greedy numbers with the script's own evaluation (deterministic)."""
    import jax

    from jrl.data.pipeline import DataConfig
    from jrl.data.tokenizer import load_byte_tokenizer

    row = re.search(r"\| exact-match accuracy \| ([0-9.]+) \| ([0-9.]+) \|", card)
    fmt = re.search(r"\| format rate [^|]*\| ([0-9.]+) \|", card)
    prompts = re.search(r"on the first\s+(\d+) held-out prompts", card)
    assert row and fmt and prompts, "model card lacks the results table or the number of evaluation prompts"
    stated_greedy, stated_sampled = float(row.group(1)), float(row.group(2))
    assert 0.1 <= stated_sampled <= 0.6, "the default model should be partly right at temperature 1.0"
    script = _load_script()
    tokenizer = load_byte_tokenizer()
    held_out = script.load_split(DataConfig(arithmetic=ArithmeticConfig(seed=1)), tokenizer)
    n = int(prompts.group(1))
    got = script.evaluate(jrl_model, held_out, tokenizer, num_prompts=n, samples_per_prompt=1, temperature=0.0,
                          key=jax.random.key(0))
    assert abs(got["accuracy"] - stated_greedy) <= 2 / n + 5e-4, (got, stated_greedy)
    assert abs(got["format_rate"] - float(fmt.group(1))) <= 2 / n + 5e-4, (got, fmt.group(1))
