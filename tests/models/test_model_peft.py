"""PEFT adapter export: real peft loads jrl's adapter onto the transformers model and reproduces jrl's logits."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from model_testlib import hf_logits, layer_param

from jrl.models import from_pretrained, merge_lora, named_params, save_peft_adapter, save_pretrained
from jrl.models.lora import MOE_LORA_TARGETS, ExpertsLoRA, LoraConfig, LoRAParam, apply_lora, lora_disabled, lora_layers

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-4


def _lora_model(path, cfg: LoraConfig, seed: int = 0):
    """jrl float32 model of ``path`` with random non-zero A and B (a fresh adapter has B = 0)."""
    model = from_pretrained(path, dtype=jnp.float32)
    apply_lora(model, cfg, seed=seed)
    key = jax.random.key(100 + seed)
    for i, layer in enumerate(lora_layers(model).values()):
        ka, kb = jax.random.split(jax.random.fold_in(key, i))
        layer.lora_a.set_value(jax.random.normal(ka, layer.lora_a[...].shape) * 0.3)
        layer.lora_b.set_value(jax.random.normal(kb, layer.lora_b[...].shape) * 0.3)
    return model


def _peft_logits(path, adapter_dir, ids) -> tuple[np.ndarray, object]:
    """Logits of peft's ``PeftModel.from_pretrained`` (fresh float32 transformers model); fails on missing keys."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*missing adapter keys.*")
        pm = peft.PeftModel.from_pretrained(hf, adapter_dir)
    pm.eval()
    return hf_logits(pm, ids), pm


def _check_loaded_exactly(pm, adapter_dir):
    """Every tensor in the file is a LoRA weight of the peft model (no unexpected keys), every LoRA weight of
    the model comes from the file (no missing keys), with the file's values."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.numpy import load_file

    saved = {k: np.asarray(v, np.float32) for k, v in load_file(str(adapter_dir / "adapter_model.safetensors")).items()}
    loaded = {k: v.float().numpy() for k, v in get_peft_model_state_dict(pm).items()}
    assert set(saved) == set(loaded)
    for k, v in saved.items():
        np.testing.assert_array_equal(loaded[k], v, err_msg=k)
    result = pm.load_adapter(str(adapter_dir), adapter_name="reload")
    assert not result.missing_keys and not result.unexpected_keys, result


@pytest.mark.parametrize("family,use_rslora,targets", [
    ("llama_rope3", False, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    ("qwen3", True, ("q_proj", "o_proj", "down_proj")),  # head_dim * heads != hidden: o_proj A is [r, N*D]
    # MLP targets hit the dense layer's MLP and the MoE layers' shared expert (never the routed experts).
    ("qwen2_moe", False, ("q_proj", "gate_proj", "up_proj", "down_proj")),
])
def test_peft_loads_adapter_and_matches_jrl_logits(hf_checkpoints, ids, tmp_path, family, use_rslora, targets):
    _, path = hf_checkpoints(family)
    cfg = LoraConfig(rank=4, alpha=6.0, use_rslora=use_rslora, target_modules=targets)
    model = _lora_model(path, cfg)
    want = np.asarray(model(jnp.asarray(ids)))
    with lora_disabled(model):
        base = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(want - base).max() > 0.1  # the adapters change the model, so a dropped adapter fails below

    out = save_peft_adapter(model, tmp_path / "adapter", dtype="float32", config=cfg,
                            base_model_name_or_path=str(path))
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    meta = json.loads((out / "adapter_config.json").read_text())
    assert (meta["peft_type"], meta["task_type"], meta["bias"], meta["fan_in_fan_out"]) == ("LORA", "CAUSAL_LM",
                                                                                        "none", False)
    assert (meta["r"], meta["lora_alpha"], meta["use_rslora"]) == (4, 6, use_rslora)
    assert sorted(meta["target_modules"]) == sorted(targets) and meta["base_model_name_or_path"] == str(path)

    got, pm = _peft_logits(path, out, ids)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()
    _check_loaded_exactly(pm, out)
    scaling = [m.scaling["default"] for m in pm.modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    layers = model.config.num_hidden_layers
    assert len(scaling) == layers * len(targets) and scaling == pytest.approx([cfg.scale] * len(scaling))


def test_key_format_and_layouts_match_peft_save(hf_checkpoints, tmp_path):
    """jrl writes the same keys, shapes and (for the same update) tensors as peft's own save_pretrained."""
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    _, path = hf_checkpoints("qwen3")
    cfg = LoraConfig(rank=3, alpha=3.0, target_modules=("q_proj", "k_proj", "o_proj", "up_proj", "down_proj"))
    model = _lora_model(path, cfg, seed=1)
    save_peft_adapter(model, tmp_path / "jrl", dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=3, lora_alpha=3, target_modules=list(cfg.target_modules),
                                                 task_type="CAUSAL_LM"))
    # peft's A/B filled with jrl's values through the documented relation, then saved by peft
    for name, module in pm.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            jrl_path = name.removeprefix("base_model.model.model.").replace("self_attn", "attn")
            a, b = layer_param(model, f"{jrl_path}.lora_a"), layer_param(model, f"{jrl_path}.lora_b")
            with torch.no_grad():
                module.lora_A["default"].weight.copy_(torch.from_numpy(a.reshape(-1, 3).T.copy()))
                module.lora_B["default"].weight.copy_(torch.from_numpy(b.reshape(3, -1).T.copy()))
    pm.save_pretrained(tmp_path / "peft")
    ref = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    ours = load_file(str(tmp_path / "jrl" / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(ref) and len(ours) == 2 * 2 * 5
    assert "base_model.model.model.layers.1.self_attn.o_proj.lora_A.weight" in ours
    for k in ref:
        assert ours[k].dtype == np.float32
        np.testing.assert_array_equal(ours[k], ref[k], err_msg=k)
    # Without the LoraConfig: alpha = scale * r, and keys peft's own config also has.
    meta = json.loads((tmp_path / "jrl" / "adapter_config.json").read_text())
    peft_meta = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert meta["lora_alpha"] == 3 and meta["use_rslora"] is False
    assert set(meta) <= set(peft_meta)
    assert meta["base_model_name_or_path"] == str(Path(path).resolve())


def test_bfloat16_default_export_loads(hf_checkpoints, ids, tmp_path):
    _, path = hf_checkpoints("llama_rope3")
    cfg = LoraConfig(rank=2, alpha=4.0, target_modules=("v_proj", "up_proj"))
    model = _lora_model(path, cfg, seed=2)
    out = save_peft_adapter(model, tmp_path / "bf16")
    from safetensors import safe_open

    with safe_open(str(out / "adapter_model.safetensors"), "np") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    got, pm = _peft_logits(path, out, ids)
    _check_loaded_exactly(pm, out)
    # Same logits as jrl with its adapters rounded to bf16 (the base stays float32 on both sides).
    for var in named_params(model).values():
        if isinstance(var, LoRAParam):
            var.set_value(var[...].astype(jnp.bfloat16).astype(jnp.float32))
    want = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()


def test_errors(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints("llama_rope3")
    model = from_pretrained(path, dtype=jnp.float32)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_peft_adapter(model, tmp_path / "none")
    apply_lora(model, LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj",)))
    with pytest.raises(ValueError, match="does not match"):
        save_peft_adapter(model, tmp_path / "wrong", config=LoraConfig(rank=2, alpha=4.0, use_rslora=True))
    with pytest.raises(ValueError, match="dtype"):
        save_peft_adapter(model, tmp_path / "int", dtype="int8")
    assert not any(tmp_path.iterdir())  # nothing half-written

    with pytest.raises(ValueError, match="has no MoE layers"):
        apply_lora(from_pretrained(path, dtype=jnp.float32), LoraConfig(target_parameters=("mlp.experts.down_proj",)))
    with pytest.raises(ValueError, match=r"target_parameters=\('experts',\) is invalid"):
        LoraConfig(target_parameters=("experts",))
    with pytest.raises(ValueError, match="targets nothing"):
        LoraConfig(target_modules=())
    with pytest.raises(ValueError, match="merge them first"):
        save_pretrained(model, tmp_path / "with-adapters")
    assert not any(tmp_path.iterdir())


def _randomize_all_adapters(model, seed: int) -> None:
    """Every LoRAParam (Linear, router and expert adapters) random and non-zero."""
    key = jax.random.key(seed)
    for i, (_, var) in enumerate(sorted(nnx.to_flat_state(nnx.state(model, LoRAParam)), key=lambda kv: str(kv[0]))):
        var.set_value(0.3 * jax.random.normal(jax.random.fold_in(key, i), var.shape, var.dtype))


@pytest.mark.parametrize("family,targets", [
    ("qwen3_moe", MOE_LORA_TARGETS),  # MoE and dense layers: unstacked
    ("mixtral", MOE_LORA_TARGETS),  # stacked layers; block_sparse_moe on disk, mlp at run time
    ("qwen2_moe", ("mlp.experts.down_proj",)),  # one expert weight: no base_layer nesting
    ("glm4_moe", ("mlp.experts.gate_up_proj", "mlp.gate.weight")),
    ("olmoe", MOE_LORA_TARGETS[:2]),
])
def test_expert_lora_adapter_loads_in_peft_and_merges(hf_checkpoints, ids, tmp_path, family, targets):
    """LoRA on the experts (and router) exports as PEFT target_parameters: peft loads it onto the transformers
    model with jrl's logits and PEFT's per-expert deltas equal jrl's; the merged checkpoint loads in transformers
    with the same logits."""
    from transformers import AutoModelForCausalLM

    _, path = hf_checkpoints(family)
    cfg = LoraConfig(rank=3, alpha=5.0, target_modules=("q_proj",), target_parameters=targets)
    model = apply_lora(from_pretrained(path, dtype=jnp.float32), cfg)
    _randomize_all_adapters(model, 7)
    experts = [layer for layer in lora_layers(model).values() if isinstance(layer, ExpertsLoRA)]
    assert experts and all(layer.lora_enabled for layer in experts)
    want = np.asarray(model(jnp.asarray(ids)))
    with lora_disabled(model):
        base = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(want - base).max() > 0.1

    out = save_peft_adapter(model, tmp_path / "adapter", dtype="float32", config=cfg)
    meta = json.loads((out / "adapter_config.json").read_text())
    assert meta["target_modules"] == ["q_proj"] and meta["target_parameters"] == list(targets)
    got, pm = _peft_logits(path, out, ids)
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()
    _check_loaded_exactly(pm, out)

    # PEFT's delta of each wrapped expert weight [E, out, in] is jrl's s·A_e@B_e [E, in, out], transposed.
    wrappers = {(name.split(".")[4], m.parameter_name): m for name, m in pm.named_modules()
                if isinstance(m, peft.tuners.lora.ParamWrapper) and m.parameter_name != "weight"}
    jrl_layers = {int(p.split(".")[1]) if not model.config.stacked_layers else None: layer
                  for p, layer in lora_layers(model).items() if isinstance(layer, ExpertsLoRA)}
    assert len(wrappers) == sum(t.startswith("mlp.experts") for t in targets) * sum(
        model.config.layer_is_moe(i) for i in range(model.config.num_hidden_layers))
    for (number, param), wrapper in wrappers.items():
        layer = jrl_layers[None] if model.config.stacked_layers else jrl_layers[int(number)]
        deltas = {k: np.asarray(v) for k, v in layer.deltas().items()}
        if model.config.stacked_layers:
            deltas = {k: v[int(number)] for k, v in deltas.items()}
        ours = (np.concatenate([deltas["gate_proj"], deltas["up_proj"]], axis=-1) if param == "gate_up_proj"
                else deltas["down_proj"]).transpose(0, 2, 1)
        theirs = wrapper.get_delta_weight("default").detach().numpy()
        np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-6, err_msg=f"layer {number} {param}")

    merged_dir = save_pretrained(merge_lora(model), tmp_path / "merged")
    hf = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32, attn_implementation="eager")
    merged = hf_logits(hf.eval(), ids)
    assert np.abs(merged - want).max() <= TOL, np.abs(merged - want).max()


def test_export_script_adapter_only(hf_checkpoints, ids, tmp_path, capsys):
    """scripts/export.py CKPT OUT --adapter-only on an orbax training checkpoint of a LoRA run."""
    from flax import nnx

    from jrl.train.checkpoint import TrainCheckpointer
    from jrl.train.export import export_checkpoint

    _, path = hf_checkpoints("llama_rope3")
    cfg = LoraConfig(rank=2, alpha=3.0, use_rslora=True, target_modules=("k_proj", "o_proj", "gate_proj"))
    model = _lora_model(path, cfg, seed=3)
    params = nnx.state(model, LoRAParam)
    ckpt = TrainCheckpointer(tmp_path / "run" / "checkpoints")
    meta = {"step": 1, "seed": 7, "model": {"path": str(Path(path).resolve()), "dtype": "float32",
                                            "param_dtype": "float32"},
            "lora": dataclasses.asdict(cfg)}
    ckpt.save(1, params, params, meta)
    ckpt.close()

    spec = importlib.util.spec_from_file_location("jrl_export_script", REPO / "scripts" / "export.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main([str(tmp_path / "run"), str(tmp_path / "adapter"), "--adapter-only", "--dtype", "float32"]) == 0
    assert "adapter" in capsys.readouterr().out
    meta_out = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (meta_out["r"], meta_out["lora_alpha"], meta_out["use_rslora"]) == (2, 3, True)
    got, _ = _peft_logits(path, tmp_path / "adapter", ids)
    want = np.asarray(model(jnp.asarray(ids)))
    assert np.abs(got - want).max() <= TOL, np.abs(got - want).max()

    # A full fine-tuning checkpoint has no adapters to export.
    full = TrainCheckpointer(tmp_path / "full")
    base = from_pretrained(path, dtype=jnp.float32)
    full.save(1, nnx.state(base, nnx.Param), {"x": jnp.zeros(())}, {**meta, "lora": None})
    full.close()
    with pytest.raises(ValueError, match="no LoRA adapters"):
        export_checkpoint(tmp_path / "full", tmp_path / "adapter_full", adapter_only=True)
