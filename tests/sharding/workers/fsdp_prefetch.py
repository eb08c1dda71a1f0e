"""Worker (8 fake CPU devices): the per-device FSDP path (jrl.models.fsdp: the token lookup in each device's table
columns, layers scanned with their weights gathered a layer ahead, the loss-fused head per device) against XLA's
partitioning of the same model on the same mesh and against one device: loss, log-probs, entropies, intermediate
layers' outputs and every gradient, for a full model and one with LoRA, on fsdp-only and data x fsdp meshes; the
collectives the head and the lookup compile to; a gradient reduced in bfloat16; under a remat policy, the layer
weights gathered again in the backward; the layers gathered in groups. Prints one JSON line."""

from __future__ import annotations

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import common
from jrl import sharding as S
from jrl.models import ModelConfig, Transformer
from jrl.models.lora import LoraConfig, LoRAParam, apply_lora

VOCAB, ROWS, SEQ = 96, 8, 12
CONFIG = ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, tie_word_embeddings=True)
MESHES = {"fsdp8": dict(fsdp=8), "data2_fsdp4": dict(data=2, fsdp=4), "fsdp4_of_4": dict(fsdp=4)}


@dataclasses.dataclass(frozen=True)
class WeightedLogp:
    """A row-separable loss of the fused head: -Σ weight · (logp + 0.1 · entropy)."""

    def __call__(self, lp, ent, rows, aux):
        return -jnp.sum(rows * (lp + 0.1 * ent)) * aux


def make(kind: str, mesh, rules, **runtime) -> Transformer:
    config = dataclasses.replace(CONFIG, **runtime)
    model = Transformer(config, rngs=nnx.Rngs(0), mesh=mesh, rules=rules)
    if kind == "lora":
        apply_lora(model, LoraConfig(rank=4, alpha=8.0, target_modules=("q_proj", "down_proj")), seed=0)
        for i, (_, var) in enumerate(sorted(nnx.to_flat_state(nnx.state(model, nnx.Param)), key=lambda kv: str(kv[0]))):
            if "lora_b" in str(_):
                var.set_value(0.3 * jax.random.normal(jax.random.key(i), var.shape, var.dtype))
    return model


def batch():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, VOCAB, (ROWS, SEQ)).astype(np.int32)
    lengths = rng.integers(SEQ // 2, SEQ + 1, ROWS)
    mask = (np.arange(SEQ)[None] < lengths[:, None]).astype(np.int32)
    weights = rng.normal(size=(ROWS, SEQ - 1)).astype(np.float32) * mask[:, 1:]
    return ids, mask, weights


def loss(model: Transformer, ids, mask, weights):
    hidden = model.hidden_states(ids, attention_mask=mask)
    value, lp, ent = model.head_loss(hidden[:, :-1], ids[:, 1:], WeightedLogp(), weights, jnp.float32(0.5),
                                     with_entropy=True)
    return value, (lp, ent)


def run(kind: str, mesh_name: str | None, **runtime):
    if mesh_name is None:
        mesh = rules = None
        devices = jax.devices()[:1]
    else:
        cfg = S.MeshConfig(**MESHES[mesh_name])
        devices = jax.devices()[:int(np.prod(list(MESHES[mesh_name].values())))]
        mesh, rules = S.make_mesh(cfg, devices), cfg.logical_rules()
    model = make(kind, mesh, rules, **runtime)
    if mesh is not None:
        S.shard_model(model, mesh, rules)
    trainable = LoRAParam if kind == "lora" else nnx.Param
    graphdef, params, rest = nnx.split(model, trainable, ...)
    ids, mask, weights = batch()
    if mesh is not None:
        ids, mask, weights = (S.make_global_batch(x, mesh, rules) for x in (ids, mask, weights))

    @jax.jit
    def step(params, rest, ids, mask, weights):
        f = lambda p: loss(nnx.merge(graphdef, p, rest), ids, mask, weights)  # noqa: E731
        return jax.value_and_grad(f, has_aux=True)(params)

    @jax.jit
    def features(params, rest, ids, mask):  # EBFT's intermediate layers: the scan's collected outputs
        return nnx.merge(graphdef, params, rest).hidden_states(ids, attention_mask=mask, return_layers=(1, 2))[1]

    (value, (lp, ent)), grads = step(params, rest, ids, mask, weights)
    hlo = step.lower(params, rest, ids, mask, weights).compile().as_text()
    layers = np.stack([S.gather_to_host(h) for h in features(params, rest, ids, mask)])
    return dict(loss=float(value), lp=S.gather_to_host(lp), ent=S.gather_to_host(ent), layers=layers,
                grads=dict(S.iter_to_host(grads)), hlo=hlo)


def vocab_collectives(hlo: str) -> dict[str, int]:
    """Collectives of the compiled step whose result has a vocabulary-sized dimension, by op."""
    found: dict[str, int] = {}
    for line in hlo.splitlines():
        m = re.search(r"= (\(?[^=]*?\)?) (all-reduce|reduce-scatter|all-gather|all-to-all)(-start)?\(", line)
        if m and re.search(rf"[\[,]{VOCAB}[,\]]", m.group(1)):
            found[m.group(2)] = found.get(m.group(2), 0) + 1
    return found


def lookup_all_to_alls(hlo: str) -> int:
    """All-to-alls of a ``shard_map`` in the compiled step (a dense model's: the token lookup's)."""
    return sum(1 for line in hlo.splitlines()
               if re.search(r" all-to-all(-start)?\(", line) and "shard_map/all_to_all" in line)


def layer_gathers(hlo: str) -> int:
    """All-gathers in the compiled step whose result is a whole gate/up kernel of one layer ([hidden, intermediate])."""
    shape = rf"\[{CONFIG.hidden_size},{CONFIG.intermediate_size}\]"
    return sum(1 for line in hlo.splitlines() if re.search(r" all-gather(-start)?\(", line) and re.search(shape, line))


def group_gathers(hlo: str) -> dict[str, int]:
    """All-gathers in the compiled step whose result is a group of gate/up kernels ([layers, hidden, intermediate]),
    by the group's layer count."""
    found: dict[str, int] = {}
    for line in hlo.splitlines():
        m = re.search(rf"\[(\d+),{CONFIG.hidden_size},{CONFIG.intermediate_size}\]", line)
        if m and re.search(r" all-gather(-start)?\(", line):
            found[m.group(1)] = found.get(m.group(1), 0) + 1
    return found


def compare(a: dict, b: dict) -> dict:
    grads = {k: common.rel_err(a["grads"][k], b["grads"][k]) for k in b["grads"]}
    return dict(loss=abs(a["loss"] - b["loss"]) / abs(b["loss"]), lp=common.rel_err(a["lp"], b["lp"]),
                layers=common.rel_err(a["layers"], b["layers"]),
                ent=common.rel_err(a["ent"], b["ent"]), grad=max(grads.values()), grad_worst=max(grads, key=grads.get),
                finite=bool(np.isfinite(a["loss"]) and all(np.all(np.isfinite(g)) for g in a["grads"].values())))


def main() -> None:
    assert jax.device_count() == 8, jax.devices()
    out = {"cases": {}, "collectives": {}}
    for kind in ("full", "lora"):
        single = run(kind, None)
        for mesh_name in MESHES:
            explicit = run(kind, mesh_name)
            xla = run(kind, mesh_name, fsdp_prefetch=False)
            out["cases"][f"{kind}/{mesh_name}"] = dict(
                vs_single=compare(explicit, single), vs_xla=compare(explicit, xla), xla_vs_single=compare(xla, single))
            out["collectives"][f"{kind}/{mesh_name}"] = dict(explicit=vocab_collectives(explicit["hlo"]),
                                                             xla=vocab_collectives(xla["hlo"]),
                                                             lookup_all_to_alls=lookup_all_to_alls(explicit["hlo"]),
                                                             xla_all_to_alls=lookup_all_to_alls(xla["hlo"]))
    single = run("full", None)
    out["bf16_reduce"] = compare(run("full", "fsdp8", grad_reduce_dtype="bfloat16"), single)
    # Under a remat policy the layers' weights are gathered again in the backward instead of being kept.
    policy = run("full", "fsdp8", remat="dots_with_no_batch_dims_saveable")
    kept = run("full", "fsdp8", remat="none")
    out["regather"] = dict(vs_single=compare(policy, single), gathers=layer_gathers(policy["hlo"]),
                           gathers_kept=layer_gathers(kept["hlo"]))
    # The layers gathered 2 at a time (3 layers: a group of 2, then the remaining 1): each group's weights gathered
    # once and kept for the backward, also under the remat policy that makes the per-layer program gather again.
    grouped = run("full", "fsdp8", remat="dots_with_no_batch_dims_saveable", fsdp_layers_per_gather=2)
    out["groups"] = dict(vs_single=compare(grouped, single), vs_per_layer=compare(grouped, policy),
                         group_gathers=group_gathers(grouped["hlo"]), layer_gathers=layer_gathers(grouped["hlo"]),
                         ones_vs_single=compare(run("full", "fsdp8", remat="dots_with_no_batch_dims_saveable",
                                                    fsdp_layers_per_gather=1), single))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
