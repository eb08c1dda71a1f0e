"""Router statistics of MoE forwards (jrl.models.router_stats): the values of one block against numpy, the same
statistics whether layers are scanned (under remat) or looped, one record per MoE layer, none outside a collector."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jrl.models import ModelConfig, create_model, router_stats
from jrl.models.moe import MoE, softmax_topk
from jrl.models.router_stats import RouterStats

MOE = dict(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, qk_norm=True, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=16, dtype="float32", param_dtype="float32", initializer_range=0.3)


def test_stats_of_one_assignment_match_numpy():
    logits = np.random.default_rng(0).normal(size=(4, 4)).astype(np.float32)
    ids = np.array([[0, 1], [0, 2], [0, 3], [0, 1]])
    s = RouterStats.of(jnp.asarray(logits), jnp.asarray(ids))
    np.testing.assert_allclose(np.asarray(s.load), [0.5, 0.25, 0.125, 0.125])
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(s.prob), probs.mean(0), rtol=1e-6)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(s.z), np.mean(lse ** 2), rtol=1e-6)
    assert float(s.max_over_mean) == pytest.approx(2.0)
    np.testing.assert_allclose(float(s.aux_loss), 4 * np.sum(np.array([0.5, 0.25, 0.125, 0.125]) * probs.mean(0)),
                               rtol=1e-6)
    balanced = RouterStats.of(jnp.zeros((4, 4)), jnp.asarray([[0, 1], [2, 3], [0, 1], [2, 3]]))
    assert float(balanced.max_over_mean) == pytest.approx(1.0) and float(balanced.aux_loss) == pytest.approx(1.0)


def test_block_records_its_routing_only_inside_a_collector():
    config = ModelConfig(**MOE, num_hidden_layers=1)
    block = MoE(config, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, 32))
    assert not router_stats.active()
    block(x)  # nothing open: nothing recorded, no error
    with router_stats.collecting() as stats:
        block(x)
    assert len(stats) == 1
    logits = block.router_logits(x).reshape(-1, 4)
    _, ids = softmax_topk(logits, None, config)
    want = RouterStats.of(logits, ids)
    for got, ref in zip(jax.tree.leaves(stats[0]), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-6)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_and_looped_layers_record_the_same(remat):
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 9)))
    summaries = {}
    for scan in (True, False):
        model = create_model(ModelConfig(**MOE, num_hidden_layers=3, scan_layers=scan, remat=remat), seed=2)

        @jax.jit
        def run(ids, model=model):
            with router_stats.collecting() as stats:
                model(ids)
            return router_stats.summary(stats), [s.load.shape for s in stats]

        summaries[scan], shapes = run(ids)
        assert shapes == ([(3, 1, 4)] if scan else [(1, 4)] * 3)  # one record per MoE layer
    for key, value in summaries[True].items():
        np.testing.assert_allclose(float(value), float(summaries[False][key]), rtol=1e-5, err_msg=key)
    assert summaries[True]["moe/expert_load_max_over_mean"] >= 1.0


def test_dense_layers_of_a_moe_model_record_nothing():
    model = create_model(ModelConfig(**MOE, num_hidden_layers=3, mlp_only_layers=(1,)), seed=3)
    with router_stats.collecting() as stats:
        model(jnp.ones((1, 4), jnp.int32))
    assert len(stats) == 2


def test_padding_is_not_counted():
    """Right padding (masked) leaves every statistic as the unpadded batch has it; the masked tokens' routing
    would change them."""
    model = create_model(ModelConfig(**MOE, num_hidden_layers=2), seed=4)
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 64, (2, 6)))
    padded = jnp.concatenate([ids, jnp.asarray(np.random.default_rng(6).integers(0, 64, (2, 5)))], axis=1)
    mask = jnp.concatenate([jnp.ones((2, 6), jnp.int32), jnp.zeros((2, 5), jnp.int32)], axis=1)
    runs = {}
    for name, args in (("plain", (ids, None)), ("padded", (padded, mask)), ("unmasked", (padded, None))):
        with router_stats.collecting() as stats:
            model(args[0], attention_mask=args[1])
        runs[name] = {k: float(v) for k, v in router_stats.summary(stats).items()}
    for key, value in runs["plain"].items():
        assert runs["padded"][key] == pytest.approx(value, rel=1e-5), key
    assert any(abs(runs["unmasked"][k] - v) > 1e-4 * abs(v) for k, v in runs["plain"].items())
    logits = jnp.asarray(np.random.default_rng(7).normal(size=(5, 4)), jnp.float32)
    ids_k = jnp.asarray([[0, 1], [2, 3], [0, 2], [1, 1], [3, 3]])
    keep = jnp.asarray([True, True, False, True, False])
    masked, subset = RouterStats.of(logits, ids_k, keep), RouterStats.of(logits[keep], ids_k[keep])
    for got, want in zip(jax.tree.leaves(masked), jax.tree.leaves(subset), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
