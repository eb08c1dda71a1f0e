"""The prompt pipeline: loading (JSONL / JSON / Parquet / save_to_disk), rendering, length filtering,
deterministic shuffling, checkpointable iterator state, sharding, padding, and every error."""

import dataclasses
import json
import logging
from collections import Counter

import numpy as np
import pytest

from jrl.data import tokenizer as bt
from jrl.data.pipeline import (
    DataConfig,
    PromptBatch,
    build_prompt_dataset,
    left_pad,
    load_records,
    make_prompt_loader,
)
from jrl.data.tasks.arithmetic import ArithmeticConfig


@pytest.fixture(scope="module")
def tok():
    return bt.load_byte_tokenizer()


def _rows(n):
    return [{"prompt": f"question {i}", "answer": i, "meta": {"k": i % 3}} for i in range(n)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _chat_ids(text):
    """Independent rendering of a single-user-turn prompt with the byte tokenizer's template."""
    return [bt.BOS_ID, bt.USER_ID, *text.encode(), bt.EOS_ID, bt.ASSISTANT_ID]


def _take(loader, k):
    return [next(loader) for _ in range(k)]


def _ids(batches):
    return [b.indices for b in batches]


# ---------------------------------------------------------------------------------------------
# Loading


def test_builtin_default(tok):
    cfg = DataConfig(prompts_per_batch=4, arithmetic=ArithmeticConfig(num_examples=40))
    loader = make_prompt_loader(cfg, tok)
    b = next(loader)
    assert isinstance(b, PromptBatch) and len(b) == 4
    assert set(b.columns) == {"prompt", "answer", "solution", "expression"}
    assert b.prompts == b.columns["prompt"]
    for p, ids, text in zip(b.prompts, b.prompt_ids, b.prompt_texts):
        assert ids == _chat_ids(p)
        assert text == f"<|bos|><|user|>{p}<|eos|><|assistant|>"
    assert len(loader.dataset) == 40 and loader.dataset.num_filtered == 0


def test_jsonl_plain_text(tmp_path, tok):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(10))
    cfg = DataConfig(source=str(path), use_chat_template=False, shuffle=False, prompts_per_batch=5, num_epochs=1)
    batches = list(make_prompt_loader(cfg, tok))
    assert _ids(batches) == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    b = batches[0]
    assert b.prompt_ids[1] == [bt.BOS_ID, *b"question 1"]
    assert b.columns["answer"] == [0, 1, 2, 3, 4]
    assert b.columns["meta"][4] == {"k": 1}


def test_json_variants(tmp_path):
    rows = _rows(4)
    (tmp_path / "list.json").write_text(json.dumps(rows))
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in rows))
    cols = {k: [r[k] for r in rows] for k in rows[0]}
    (tmp_path / "cols.json").write_text(json.dumps(cols))
    for name in ("list.json", "lines.json", "cols.json"):
        assert load_records(DataConfig(source=str(tmp_path / name))) == rows, name


def test_parquet(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows(12)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert load_records(DataConfig(source=str(tmp_path / "d.parquet"))) == rows
    ds = build_prompt_dataset(DataConfig(source=str(tmp_path / "d.parquet")), tok)
    assert ds.prompt_ids[3] == _chat_ids("question 3")


def test_save_to_disk_dataset_and_dict(tmp_path, tok):
    import datasets

    rows = _rows(6)
    d = datasets.Dataset.from_list(rows)
    d.save_to_disk(str(tmp_path / "single"))
    assert load_records(DataConfig(source=str(tmp_path / "single"))) == rows

    dd = datasets.DatasetDict({"train": d, "test": datasets.Dataset.from_list(_rows(2))})
    dd.save_to_disk(str(tmp_path / "dict"))
    assert load_records(DataConfig(source=str(tmp_path / "dict"))) == rows  # train by default
    assert load_records(DataConfig(source=str(tmp_path / "dict"), split="test")) == _rows(2)
    with pytest.raises(ValueError, match=r"split='valid' is not in .*splits are \['train', 'test'\]"):
        load_records(DataConfig(source=str(tmp_path / "dict"), split="valid"))
    with pytest.raises(ValueError, match="single Dataset"):
        load_records(DataConfig(source=str(tmp_path / "single"), split="train"))

    datasets.DatasetDict({"a": d, "b": d}).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(ValueError, match=r"splits \['a', 'b'\]; choose one with DataConfig.split"):
        load_records(DataConfig(source=str(tmp_path / "ab")))
    loader = make_prompt_loader(DataConfig(source=str(tmp_path / "dict"), prompts_per_batch=2), tok)
    assert len(loader.dataset) == 6


#: Run in a child process with HF_HUB_OFFLINE=1 and its own HF_DATASETS_CACHE: puts ``tiny/arith`` in the cache
#: the way ``datasets`` leaves a downloaded hub dataset (its builder's arrow files under ``tiny___arith/``), then
#: loads hub ids through jrl's data config.
HUB_CACHE_SCRIPT = """
import glob, json, os, shutil, sys
import datasets
from jrl.data.pipeline import DataConfig, load_records

data = sys.argv[1]
built = datasets.load_dataset("json", data_files={"train": data + "/train.jsonl", "test": data + "/test.jsonl"})
src = next(p for p in glob.glob(os.path.join(datasets.config.HF_DATASETS_CACHE, "json", "*", "*", "*"))
           if os.path.isdir(p))
dst = os.path.join(datasets.config.HF_DATASETS_CACHE, "tiny___arith", "default", "0.0.0", os.path.basename(src))
shutil.copytree(src, dst)
for f in os.listdir(dst):
    if f.startswith("json-"):
        os.rename(os.path.join(dst, f), os.path.join(dst, "arith-" + f[len("json-"):]))
out = {"train": load_records(DataConfig(source="tiny/arith")),
       "test": load_records(DataConfig(source="tiny/arith", split="test"))}
for source in ("tiny/missing", "missing_dir"):
    try:
        load_records(DataConfig(source=source))
    except FileNotFoundError as e:
        out[source] = str(e)
print(json.dumps(out))
"""


def test_hub_dataset_ids_resolve_from_the_local_cache_offline(tmp_path):
    import os
    import subprocess
    import sys

    _write_jsonl(tmp_path / "train.jsonl", _rows(4))
    _write_jsonl(tmp_path / "test.jsonl", _rows(2))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", HUB_CACHE_SCRIPT, str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["train"] == _rows(4) and out["test"] == _rows(2)
    for missing in ("tiny/missing", "missing_dir"):  # a hub id not cached, a directory that does not exist
        assert f"DataConfig.source='{missing}' is neither a local file or directory nor" in out[missing]
        assert str(tmp_path / "cache") in out[missing] and "load_dataset('" + missing in out[missing]
    with pytest.raises(ValueError, match=r"DataConfig\.hub_config=.*'owner/name'"):
        DataConfig(source=str(tmp_path / "train.jsonl"), hub_config="main")
    with pytest.raises(ValueError, match=r"DataConfig\.split=.*has none"):
        DataConfig(source=str(tmp_path / "train.jsonl"), split="train")


def test_chat_messages_and_system_prompt(tmp_path, tok):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}], "id": 0},
        {"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "yo"}], "id": 1},
    ]
    path = _write_jsonl(tmp_path / "chat.jsonl", rows)
    cfg = DataConfig(
        source=str(path), prompt_column="messages", system_prompt="SYS", shuffle=False, prompts_per_batch=2
    )
    ds = build_prompt_dataset(cfg, tok)
    assert ds.prompt_texts == [
        "<|bos|><|system|>SYS<|eos|><|user|>hi<|eos|><|assistant|>",
        "<|bos|><|system|>own<|eos|><|user|>yo<|eos|><|assistant|>",  # an existing system turn is kept
    ]
    assert ds.prompt_ids[0] == [
        bt.BOS_ID,
        bt.SYSTEM_ID,
        *b"SYS",
        bt.EOS_ID,
        bt.USER_ID,
        *b"hi",
        bt.EOS_ID,
        bt.ASSISTANT_ID,
    ]
    b = next(make_prompt_loader(cfg, tok))
    assert b.prompts == [r["messages"] for r in rows]


def test_max_examples(tmp_path, tok):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(30))
    ds = build_prompt_dataset(DataConfig(source=str(path), max_examples=7), tok)
    assert len(ds) == 7 and ds.columns["answer"] == list(range(7))


# ---------------------------------------------------------------------------------------------
# Length filter


def test_length_filter_counts_and_logs(tmp_path, tok, caplog):
    rows = [{"prompt": "x" * n, "n": n} for n in (1, 5, 10, 11, 30, 2)]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    limit = 10 + 4  # chat overhead: BOS, <|user|>, <|eos|>, <|assistant|>
    with caplog.at_level(logging.WARNING, logger="jrl.data.pipeline"):
        ds = build_prompt_dataset(DataConfig(source=str(path), max_prompt_length=limit), tok)
    assert ds.columns["n"] == [1, 5, 10, 2]
    assert ds.source_rows == [0, 1, 2, 5]
    assert (ds.num_loaded, ds.num_filtered) == (6, 2)
    assert all(len(p) <= limit for p in ds.prompt_ids)
    assert "dropped 2 of 6 prompts longer than max_prompt_length=14" in caplog.text

    ds = build_prompt_dataset(DataConfig(source=str(path), max_prompt_length=None), tok)
    assert len(ds) == 6 and ds.num_filtered == 0
    with pytest.raises(ValueError, match="every one of the 6 prompts .* longer than DataConfig.max_prompt_length=3"):
        build_prompt_dataset(DataConfig(source=str(path), max_prompt_length=3), tok)


# ---------------------------------------------------------------------------------------------
# Order, epochs, state


def _cfg(path, **kw):
    base = dict(source=str(path), use_chat_template=False, prompts_per_batch=4, seed=7)
    base.update(kw)
    return DataConfig(**base)


@pytest.fixture
def data20(tmp_path):
    return _write_jsonl(tmp_path / "d.jsonl", _rows(20))


def test_shuffle_deterministic_by_seed(data20, tok):
    a = _ids(_take(make_prompt_loader(_cfg(data20), tok), 15))
    b = _ids(_take(make_prompt_loader(_cfg(data20), tok), 15))
    c = _ids(_take(make_prompt_loader(_cfg(data20, seed=8), tok), 15))
    assert a == b
    assert a != c
    flat = [i for batch in a for i in batch]
    epochs = [flat[k : k + 20] for k in range(0, 60, 20)]
    for e in epochs:
        assert sorted(e) == list(range(20))  # each epoch is a permutation
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    assert epochs[0] != list(range(20))
    plain = _ids(_take(make_prompt_loader(_cfg(data20, shuffle=False), tok), 6))
    assert [i for batch in plain for i in batch] == list(range(20)) + list(range(4))


def test_finite_epochs_and_remainder(data20, tok):
    loader = make_prompt_loader(_cfg(data20, prompts_per_batch=6, num_epochs=1), tok)
    assert loader.batches_per_epoch == 3
    batches = list(loader)
    assert [len(b) for b in batches] == [6, 6, 6]
    loader = make_prompt_loader(_cfg(data20, prompts_per_batch=6, num_epochs=2, drop_remainder=False), tok)
    sizes = [len(b) for b in loader]
    assert sum(sizes) == 40 and sizes[-1] == 4
    with pytest.raises(ValueError, match="fewer than DataConfig.prompts_per_batch=30"):
        make_prompt_loader(_cfg(data20, prompts_per_batch=30, num_epochs=1), tok)


@pytest.mark.parametrize("num_epochs", [None, 3])
def test_state_save_restore_gives_identical_batches(data20, tok, num_epochs):
    cfg = _cfg(data20, prompts_per_batch=3, num_epochs=num_epochs)
    first = make_prompt_loader(cfg, tok)
    _take(first, 5)  # into the second epoch
    state = json.loads(json.dumps(first.get_state()))  # survives a JSON round trip (checkpoint)
    expected = _take(first, 12)

    resumed = make_prompt_loader(cfg, tok)
    resumed.set_state(state)
    got = _take(resumed, 12)
    assert [dataclasses.asdict(b) for b in got] == [dataclasses.asdict(b) for b in expected]

    # rewinding the same loader works too
    first.set_state(state)
    assert _ids(_take(first, 12)) == _ids(expected)


def test_state_mismatch(data20, tmp_path, tok, caplog):
    state = make_prompt_loader(_cfg(data20), tok).get_state()
    other_seed = make_prompt_loader(_cfg(data20, seed=99), tok)
    with pytest.raises(ValueError, match="seed was 7, now 99"):
        other_seed.set_state(state)
    other_data = make_prompt_loader(_cfg(_write_jsonl(tmp_path / "e.jsonl", _rows(21))), tok)
    with pytest.raises(ValueError, match="the prompts .* differ"):
        other_data.set_state(state)
    with caplog.at_level(logging.WARNING, logger="jrl.data.pipeline"):
        other_seed.set_state(state, strict=False)
    assert "applying it anyway" in caplog.text
    with pytest.raises(ValueError, match="not a PromptLoader state"):
        other_seed.set_state({"next_index": 3})
    with pytest.raises(ValueError, match="version"):
        other_seed.set_state({**state, "version": 99})


def test_shards_disjoint_and_complete(data20, tok):
    seen = []
    for k in range(3):
        loader = make_prompt_loader(_cfg(data20, prompts_per_batch=1, num_epochs=1), tok, shard_index=k, shard_count=3)
        seen.append([i for b in loader for i in b.indices])
    assert sorted(i for s in seen for i in s) == list(range(20))
    assert all(len(set(a) & set(b)) == 0 for a in seen for b in seen if a is not b)
    with pytest.raises(ValueError, match="shard_index < shard_count"):
        make_prompt_loader(_cfg(data20), tok, shard_index=3, shard_count=3)


# ---------------------------------------------------------------------------------------------
# Batch helpers


def test_left_pad_and_repeat():
    ids, mask = left_pad([[1, 2, 3], [4], []], pad_id=9)
    np.testing.assert_array_equal(ids, [[1, 2, 3], [9, 9, 4], [9, 9, 9]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [0, 0, 1], [0, 0, 0]])
    assert ids.dtype == np.int32
    ids, _ = left_pad([[1, 2, 3]], pad_id=0, multiple_of=4)
    np.testing.assert_array_equal(ids, [[0, 1, 2, 3]])
    ids, _ = left_pad([[1]], pad_id=0, length=3)
    np.testing.assert_array_equal(ids, [[0, 0, 1]])
    with pytest.raises(ValueError, match="more than length=2"):
        left_pad([[1, 2, 3]], pad_id=0, length=2)

    b = PromptBatch(
        prompt_ids=[[1], [2, 3]], prompt_texts=["a", "b"], prompts=["a", "b"], columns={"x": [1, 2]}, indices=[5, 6]
    )
    r = b.repeat(3)
    assert r.columns["x"] == [1, 1, 1, 2, 2, 2] and r.indices == [5, 5, 5, 6, 6, 6] and len(r) == 6
    pids, pmask = b.left_pad(0)
    np.testing.assert_array_equal(pids, [[0, 1], [2, 3]])


# ---------------------------------------------------------------------------------------------
# Errors


def test_missing_file_names_path(tmp_path, tok):
    missing = tmp_path / "nope" / "prompts.jsonl"
    with pytest.raises(FileNotFoundError, match=f"dataset path '{missing}' does not exist"):
        make_prompt_loader(DataConfig(source=str(missing)), tok)


def test_unknown_extension(tmp_path, tok):
    p = tmp_path / "d.csv"
    p.write_text("prompt\nx\n")
    with pytest.raises(ValueError, match=r"unsupported file extension '\.csv'.*\.jsonl, \.json, \.parquet"):
        load_records(DataConfig(source=str(p)))


def test_missing_prompt_column_lists_columns(data20, tok):
    with pytest.raises(
        ValueError, match=r"prompt_column='question' is not a column .* available columns: \['prompt', 'answer', 'meta'\]"
    ):
        build_prompt_dataset(DataConfig(source=str(data20), prompt_column="question"), tok)


def test_bad_files(tmp_path, tok):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_records(DataConfig(source=str(bad)))
    latin = tmp_path / "latin.jsonl"  # one Latin-1 line among UTF-8 ones
    latin.write_bytes('{"prompt": "a"}\n{"prompt": "b"}\n'.encode() + '{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.jsonl: line 3 is not UTF-8 .*re-encode the file as UTF-8"):
        load_records(DataConfig(source=str(latin)))
    latin_json = tmp_path / "latin.json"
    latin_json.write_bytes('[{"prompt": "a"},\n {"prompt": "caf\u00e9"}]'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.json: line 2 is not UTF-8"):
        load_records(DataConfig(source=str(latin_json)))
    arr = tmp_path / "arr.jsonl"
    arr.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="line 1 is a JSON list, expected an object"):
        load_records(DataConfig(source=str(arr)))
    scalar = tmp_path / "s.json"
    scalar.write_text("3")
    with pytest.raises(ValueError, match="expected a JSON list of objects"):
        load_records(DataConfig(source=str(scalar)))
    plain_dir = tmp_path / "plain_dir"
    plain_dir.mkdir()
    with pytest.raises(ValueError, match="not one written by datasets' save_to_disk"):
        load_records(DataConfig(source=str(plain_dir)))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="holds no records"):
        build_prompt_dataset(DataConfig(source=str(empty)), tok)
    holes = _write_jsonl(tmp_path / "holes.jsonl", [{"prompt": "a"}, {"other": 1}])
    with pytest.raises(
        ValueError, match="1 record\\(s\\) have no value in prompt column 'prompt' \\(first rows: \\[1\\]\\)"
    ):
        build_prompt_dataset(DataConfig(source=str(holes)), tok)


def test_prompt_type_errors(tmp_path, tok):
    chat = _write_jsonl(tmp_path / "chat.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ValueError, match="use_chat_template=False needs plain-text prompts"):
        build_prompt_dataset(DataConfig(source=str(chat), use_chat_template=False), tok)
    num = _write_jsonl(tmp_path / "num.jsonl", [{"prompt": 5}])
    with pytest.raises(ValueError, match="row 0: column 'prompt' must hold a string or a list"):
        build_prompt_dataset(DataConfig(source=str(num)), tok)
    tool = _write_jsonl(tmp_path / "tool.jsonl", [{"prompt": [{"role": "tool", "content": "x"}]}])
    with pytest.raises(ValueError, match="row 0: the tokenizer's chat template failed"):
        build_prompt_dataset(DataConfig(source=str(tool)), tok)


def test_tokenizer_without_chat_template(data20):
    no_template = bt.load_byte_tokenizer()
    no_template.chat_template = None
    with pytest.raises(ValueError, match="tokenizer has no chat template"):
        build_prompt_dataset(DataConfig(source=str(data20)), no_template)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"source": ""}, "DataConfig.source"),
        ({"source": "builtin:chess"}, r"unknown built-in task 'chess'; built-in tasks: \['arithmetic'\]"),
        ({"prompt_column": ""}, "DataConfig.prompt_column"),
        ({"use_chat_template": False, "system_prompt": "s"}, "DataConfig.system_prompt"),
        ({"max_prompt_length": 0}, "DataConfig.max_prompt_length"),
        ({"max_examples": 0}, "DataConfig.max_examples"),
        ({"num_epochs": 0}, "DataConfig.num_epochs"),
        ({"prompts_per_batch": 0}, "DataConfig.prompts_per_batch"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**kwargs)


def test_config_from_tyro(tmp_path):
    import tyro

    cfg = tyro.cli(
        DataConfig,
        args=[
            "--source",
            "builtin:arithmetic",
            "--arithmetic.max-operand",
            "20",
            "--arithmetic.ops",
            "+",
            "*",
            "--num-epochs",
            "2",
        ],
    )
    assert cfg.arithmetic.max_operand == 20 and cfg.arithmetic.ops == ("+", "*") and cfg.num_epochs == 2


def test_builtin_ops_reach_batches(tok):
    cfg = DataConfig(prompts_per_batch=50, num_epochs=1, arithmetic=ArithmeticConfig(num_examples=100, ops=("*",)))
    ops = Counter(e[1] for b in make_prompt_loader(cfg, tok) for e in b.columns["expression"])
    assert set(ops) == {"*"}
