"""The byte-level tokenizer of jrl's built-in tiny models, built reproducibly in code.

Token ids ``0..255`` are the 256 byte values (token id == byte value), followed by six special
tokens, so ``len(tokenizer) == 262``:

======  ==================  =========================================================
id      token               role
======  ==================  =========================================================
256     ``<|pad|>``         padding (``pad_token``); never produced by the chat template
257     ``<|bos|>``         start of a sequence (``bos_token``); added to plain text by the
                            post-processor and written by the chat template
258     ``<|eos|>``         end of a turn and of a generation (``eos_token``)
259     ``<|system|>``      system turn marker
260     ``<|user|>``        user turn marker
261     ``<|assistant|>``   assistant turn marker
======  ==================  =========================================================

There are no merges: every UTF-8 byte of the text is one token, so ``decode(encode(text)) == text``
for any string (with ``add_special_tokens=False``, or ``skip_special_tokens=True`` on decode).
Literal special-token strings inside text (``"<|eos|>"``) are parsed as the special token, as with
every Hugging Face tokenizer.

The chat template (:data:`CHAT_TEMPLATE`) renders::

    <|bos|><|system|>{system}<|eos|><|user|>{user}<|eos|><|assistant|>{assistant}<|eos|>

with no extra whitespace, and ``add_generation_prompt=True`` appends ``<|assistant|>`` so the model
writes the answer and ends it with ``<|eos|>``. Only the roles ``system``, ``user`` and
``assistant`` are accepted.

:func:`save_byte_tokenizer` writes a Hugging Face tokenizer directory (``tokenizer.json``,
``tokenizer_config.json`` with the chat template and special tokens, ``special_tokens_map.json``)
that ``transformers.AutoTokenizer.from_pretrained(dir)`` loads offline; the files name the class
``PreTrainedTokenizerFast`` so that both transformers 4.x (vLLM's venv) and 5.x read them. The
bytes written depend only on this module and the installed ``tokenizers`` version.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

#: Number of byte tokens; byte ``b`` is token id ``b``.
BYTE_VOCAB_SIZE = 256
PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
#: Special tokens in id order, starting at :data:`BYTE_VOCAB_SIZE`.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN)
PAD_ID, BOS_ID, EOS_ID, SYSTEM_ID, USER_ID, ASSISTANT_ID = range(BYTE_VOCAB_SIZE, BYTE_VOCAB_SIZE + len(SPECIAL_TOKENS))
#: Total vocabulary size (bytes + specials). A model may pad its embedding beyond it.
VOCAB_SIZE = BYTE_VOCAB_SIZE + len(SPECIAL_TOKENS)
#: Default ``model_max_length`` written to ``tokenizer_config.json``.
DEFAULT_MODEL_MAX_LENGTH = 2048

#: Jinja chat template (Hugging Face ``apply_chat_template`` conventions).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('jrl byte tokenizer chat template: unknown role ' ~ message['role'] "
    "~ ' (accepted: system, user, assistant)') -}}"
    "{%- endif -%}"
    "{{- '<|' ~ message['role'] ~ '|>' ~ message['content'] ~ eos_token -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode-character map (used by byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def build_byte_tokenizer():
    """The raw ``tokenizers.Tokenizer`` (byte-level, no merges, specials at ids 256..261)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(BYTE_VOCAB_SIZE)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B:1", special_tokens=[(BOS_TOKEN, BOS_ID)]
    )
    for i, t in enumerate(SPECIAL_TOKENS):  # guard the id layout the docs promise
        assert tok.token_to_id(t) == BYTE_VOCAB_SIZE + i, (t, tok.token_to_id(t))
    return tok


def _tokenizer_config(model_max_length: int) -> dict[str, Any]:
    added = {
        str(BYTE_VOCAB_SIZE + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "additional_special_tokens": [SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "padding_side": "left",
        "model_input_names": ["input_ids", "attention_mask"],
    }


def _special_tokens_map() -> dict[str, Any]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
    }


def save_byte_tokenizer(out_dir: str | os.PathLike, *, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH) -> Path:
    """Write the byte tokenizer as a Hugging Face tokenizer directory and return its path.

    Writes ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into
    ``out_dir`` (created if needed; other files there are left alone, so it can be a model
    directory). Each file is written to a temporary name and renamed, so a crash never leaves a
    half-written file.
    """
    if not isinstance(model_max_length, int) or model_max_length <= 0:
        raise ValueError(f"model_max_length must be a positive int, got {model_max_length!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_json = build_byte_tokenizer().to_str(pretty=True)
    files = {
        "tokenizer.json": tok_json + "\n",
        "tokenizer_config.json": json.dumps(_tokenizer_config(model_max_length), indent=2, ensure_ascii=False) + "\n",
        "special_tokens_map.json": json.dumps(_special_tokens_map(), indent=2, ensure_ascii=False) + "\n",
    }
    for name, text in files.items():
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=out)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, 0o644)  # mkstemp creates 0600; tokenizer files are meant to be shared
            os.replace(tmp, out / name)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return out


def load_byte_tokenizer(*, model_max_length: int = DEFAULT_MODEL_MAX_LENGTH):
    """The byte tokenizer as an in-memory ``transformers`` tokenizer (no files needed)."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_object=build_byte_tokenizer(),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN],
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        padding_side="left",
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
