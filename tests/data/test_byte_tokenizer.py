"""The byte-level tokenizer: files that AutoTokenizer loads offline, exact round trips, chat template."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from jrl.data import tokenizer as bt

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return bt.save_byte_tokenizer(tmp_path_factory.mktemp("byte_tok"))


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    return AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)


def test_files_and_layout(tok_dir, hf_tok):
    assert sorted(p.name for p in tok_dir.iterdir()) == [
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["chat_template"] == bt.CHAT_TEMPLATE
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<|bos|>", "<|eos|>", "<|pad|>")

    assert len(hf_tok) == bt.VOCAB_SIZE == 262
    assert (hf_tok.pad_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id) == (256, 257, 258)
    assert hf_tok.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"]) == [259, 260, 261]
    # token id == byte value, for every byte
    assert hf_tok(bytes(range(128)).decode("ascii"), add_special_tokens=False)["input_ids"] == list(range(128))


def test_reproducible_bytes(tmp_path, tok_dir):
    again = bt.save_byte_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (again / name).read_bytes() == (tok_dir / name).read_bytes()
    assert not [p for p in again.iterdir() if p.name.startswith(".")]  # no temp files left behind


@settings(max_examples=200, deadline=None)
@given(text=st.text())
def test_round_trip_any_text(hf_tok, text):
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert hf_tok.decode(ids) == text
    if not any(s in text for s in bt.SPECIAL_TOKENS):  # literal "<|eos|>" etc. become the special token
        assert ids == list(text.encode("utf-8"))  # independent: one token per UTF-8 byte


@pytest.mark.parametrize("text", ["", "héllo wörld 🙂", "\x00\n\t  x  ", "日本語テキスト", "a" * 3000])
def test_round_trip_examples(hf_tok, text):
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert hf_tok.decode(ids) == text


def test_literal_special_token_text_round_trips(hf_tok):
    text = "say <|eos|> and <|user|>"
    ids = hf_tok(text, add_special_tokens=False)["input_ids"]
    assert bt.EOS_ID in ids and bt.USER_ID in ids
    assert hf_tok.decode(ids) == text


def test_plain_text_gets_bos_and_specials_skip(hf_tok):
    ids = hf_tok("ab")["input_ids"]
    assert ids == [bt.BOS_ID, 97, 98]
    assert hf_tok.decode(ids, skip_special_tokens=True) == "ab"
    assert hf_tok.decode(ids + [bt.EOS_ID, bt.PAD_ID]) == "<|bos|>ab<|eos|><|pad|>"


def test_chat_template(hf_tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 7+5?"},
        {"role": "assistant", "content": "<answer>12</answer>"},
        {"role": "user", "content": "And 2+2?"},
    ]
    text = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|bos|><|system|>Be brief.<|eos|><|user|>What is 7+5?<|eos|>"
        "<|assistant|><answer>12</answer><|eos|><|user|>And 2+2?<|eos|><|assistant|>"
    )
    no_gen = hf_tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=False)
    assert no_gen == "<|bos|><|system|>Be brief.<|eos|><|user|>What is 7+5?<|eos|>"
    ids = hf_tok(
        hf_tok.apply_chat_template(msgs[1:2], tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )["input_ids"]
    expected = [bt.BOS_ID, bt.USER_ID, *b"What is 7+5?", bt.EOS_ID, bt.ASSISTANT_ID]
    assert ids == expected


def test_chat_template_rejects_unknown_role(hf_tok):
    with pytest.raises(Exception, match="unknown role tool"):
        hf_tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_in_memory_tokenizer_matches_files(hf_tok):
    mem = bt.load_byte_tokenizer()
    msgs = [{"role": "user", "content": "hi ü"}]
    assert mem.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == hf_tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )
    assert mem("xyz é")["input_ids"] == hf_tok("xyz é")["input_ids"]
    assert (mem.pad_token_id, mem.bos_token_id, mem.eos_token_id, len(mem)) == (256, 257, 258, 262)


def test_bad_model_max_length(tmp_path):
    with pytest.raises(ValueError, match="model_max_length"):
        bt.save_byte_tokenizer(tmp_path, model_max_length=0)


def test_script_writes_loadable_dir(tmp_path):
    out = tmp_path / "tok"
    r = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tokenizer.py"), str(out), "--model-max-length", "512"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    assert tok.model_max_length == 512 and len(tok) == 262
