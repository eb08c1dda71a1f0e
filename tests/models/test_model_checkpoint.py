"""HF -> jrl -> HF round trips (bitwise), sharded export, fused-expert import, and every load error."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from model_testlib import hf_logits, jrl_logits

from jrl.models import (
    MissingTensorError,
    ShapeMismatchError,
    UnexpectedTensorError,
    UnsupportedModelError,
    from_pretrained,
    save_pretrained,
)

torch = pytest.importorskip("torch", reason="checkpoint tests need torch (pip install -e '.[dev]')")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402


def _tensors(path):
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def _load_hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def test_round_trip_bitwise(family, ids, hf_checkpoints, jrl_models, tmp_path):
    hf, src = hf_checkpoints(family)
    (src / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    model = jrl_models(family, src)
    out = save_pretrained(model, tmp_path / "export")
    before, after = _tensors(src), _tensors(out)
    assert sorted(before) == sorted(after)
    for k, v in before.items():
        assert after[k].dtype == v.dtype and after[k].shape == v.shape, k
        assert after[k].tobytes() == v.tobytes(), f"{k} differs after HF -> jrl -> HF"
    assert (out / "tokenizer_config.json").read_text() == '{"model_max_length": 128}'
    assert not list(tmp_path.glob(".export.tmp-*")), "temp dir left behind"
    # transformers loads the export as the same architecture, with identical logits.
    again = _load_hf(out)
    assert type(again) is type(hf)
    for key in ("num_hidden_layers", "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_parameters",
                "num_experts", "num_local_experts", "norm_topk_prob", "mlp_only_layers", "sliding_window",
                "attention_bias", "mlp_bias"):
        assert getattr(again.config, key, None) == getattr(hf.config, key, None), key
    np.testing.assert_array_equal(hf_logits(again, ids), hf_logits(hf, ids))


def test_sharded_export_and_reload(ids, hf_checkpoints, jrl_models, tmp_path):
    hf, src = hf_checkpoints("qwen3_moe")
    model = jrl_models("qwen3_moe", src)
    out = save_pretrained(model, tmp_path / "sharded", max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 3 and not (out / "model.safetensors").exists()
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    tensors = _tensors(out)
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in tensors.values())
    assert sorted(index["weight_map"]) == sorted(tensors)
    np.testing.assert_array_equal(hf_logits(_load_hf(out), ids), hf_logits(hf, ids))
    # bf16 export of a float32 model, re-imported by jrl through the index.
    out16 = save_pretrained(model, tmp_path / "bf16", max_shard_size="40KB", dtype=jnp.bfloat16)
    assert json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"
    again = from_pretrained(out16, dtype=jnp.float32, param_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(
        np.asarray(again.layers[0].mlp.experts.up_proj[...]),
        np.asarray(model.layers[0].mlp.experts.up_proj[...].astype(jnp.bfloat16)))
    # Overwriting an existing export replaces it whole.
    save_pretrained(model, out16)
    assert (out16 / "model.safetensors").exists() and not list(out16.glob("model-*"))


@pytest.mark.parametrize("fam", ["qwen3_moe", "mixtral"])
def test_fused_expert_layout_imports(fam, ids, hf_checkpoints, jrl_models, tmp_path):
    """transformers v5's runtime layout (fused gate_up_proj [E, 2I, H], down_proj [E, H, I]) loads too."""
    from safetensors.torch import save_file as save_torch

    hf, src = hf_checkpoints(fam)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    (tmp_path / "fused").mkdir()
    shutil.copy(src / "config.json", tmp_path / "fused" / "config.json")
    save_torch(state, str(tmp_path / "fused" / "model.safetensors"), metadata={"format": "pt"})
    fused = from_pretrained(tmp_path / "fused", dtype=jnp.float32)
    ref = jrl_models(fam, src)
    for a, b in zip(jax_leaves(fused), jax_leaves(ref), strict=True):  # same parameters => same logits
        np.testing.assert_array_equal(a, b)


def jax_leaves(model):
    from jrl.models import named_params

    return [np.asarray(v[...]) for _, v in sorted(named_params(model).items())]


# --------------------------------------------------------------------------- errors
@pytest.fixture()
def llama_copy(hf_checkpoints, tmp_path):
    _, src = hf_checkpoints("llama_rope3")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _rewrite(path, edit):
    tensors = _tensors(path)
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        from_pretrained(tmp_path / "nope")


def test_missing_config(llama_copy):
    (llama_copy / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(llama_copy)


def test_missing_weights(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights"):
        from_pretrained(llama_copy)
    (llama_copy / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="only safetensors"):
        from_pretrained(llama_copy)


def test_missing_shard(llama_copy):
    index = {"metadata": {"total_size": 0}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (llama_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        from_pretrained(llama_copy)


def test_unsupported_model_type(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*llama, qwen2, qwen3, qwen3_moe, mixtral"):
        from_pretrained(llama_copy)


def test_missing_tensor(llama_copy):
    _rewrite(llama_copy, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        from_pretrained(llama_copy)


def test_missing_expert(hf_checkpoints, tmp_path):
    _, src = hf_checkpoints("qwen3_moe")
    shutil.copytree(src, tmp_path / "moe")
    _rewrite(tmp_path / "moe", lambda t: t.pop("model.layers.2.mlp.experts.5.down_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.2\.mlp\.experts\.5\.down_proj\.weight"):
        from_pretrained(tmp_path / "moe")


def test_unexpected_tensor(llama_copy):
    _rewrite(llama_copy, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}))
    with pytest.raises(UnexpectedTensorError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        from_pretrained(llama_copy)
    _rewrite(llama_copy, lambda t: (t.pop("model.layers.0.self_attn.q_proj.bias"),
                                    t.update({"model.vision_tower.weight": np.zeros(3, np.float32)})))
    with pytest.raises(UnexpectedTensorError, match=r"model\.vision_tower\.weight"):
        from_pretrained(llama_copy)


def test_shape_mismatch(llama_copy):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = np.zeros((48, 64), np.float32)

    _rewrite(llama_copy, edit)
    match = r"model\.layers\.0\.self_attn\.k_proj\.weight.*\[48, 64\].*\[32, 64\]"
    with pytest.raises(ShapeMismatchError, match=match):
        from_pretrained(llama_copy)


def test_ignored_keys_and_tied_head(hf_checkpoints, tmp_path, ids, jrl_models):
    """Old exports carry rotary inv_freq buffers; some tied checkpoints still store lm_head: both load."""
    hf, src = hf_checkpoints("llama_tied")
    dst = tmp_path / "tied"
    shutil.copytree(src, dst)

    def edit(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros(8, np.float32)
        t["lm_head.weight"] = t["model.embed_tokens.weight"]

    _rewrite(dst, edit)
    model = from_pretrained(dst, dtype=jnp.float32)
    np.testing.assert_array_equal(jrl_logits(model, ids), jrl_logits(jrl_models("llama_tied", src), ids))


def test_both_expert_layouts_is_an_error(hf_checkpoints, tmp_path):
    from jrl.models import CheckpointError

    hf, src = hf_checkpoints("qwen3_moe")
    shutil.copytree(src, tmp_path / "moe")
    fused = hf.state_dict()["model.layers.0.mlp.experts.gate_up_proj"].numpy()
    _rewrite(tmp_path / "moe", lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj": fused}))
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.experts\.gate_proj is given more than once"):
        from_pretrained(tmp_path / "moe")


@pytest.mark.parametrize("fam", ["llama_rope3", "qwen3_moe"])
def test_jrl_created_model_loads_in_transformers(fam, ids, tmp_path):
    """A model born in jrl (no source checkpoint): config.json comes from ModelConfig.to_hf alone."""
    from model_testlib import hf_config

    from jrl.models import ModelConfig, create_model

    config = ModelConfig.from_hf(hf_config(fam).to_dict()).replace(initializer_range=0.2)
    model = create_model(config, seed=3)
    out = save_pretrained(model, tmp_path / "born")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    hf = _load_hf(out)
    assert type(hf).__name__ == json.loads((out / "config.json").read_text())["architectures"][0]
    ref, got = hf_logits(hf, ids), jrl_logits(model, ids)
    assert np.abs(ref - got).max() <= 1e-4


def test_unsupported_save_dtype_is_an_error(hf_checkpoints, jrl_models, tmp_path):
    _, src = hf_checkpoints("llama_rope3")
    model = jrl_models("llama_rope3", src)
    with pytest.raises(ValueError, match="save_pretrained: dtype 'int8' is not supported; use one of float32"):
        save_pretrained(model, tmp_path / "out", dtype=jnp.int8)
    assert not (tmp_path / "out").exists()
