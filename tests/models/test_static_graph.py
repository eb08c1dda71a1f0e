"""A model split for jitted functions called often (jrl.models.static_graph): equal structures share one static
argument, other structures do not, and the weights merge back into the same model."""

from __future__ import annotations

import jax
import numpy as np

from jrl.models.config import ModelConfig
from jrl.models.static_graph import StaticGraph, split_static
from jrl.models.transformer import create_model

CONFIG = dict(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def test_equal_structures_share_one_static_graph_and_merge_back():
    first, second = (create_model(ModelConfig(**CONFIG), seed=s) for s in (0, 1))
    deeper = create_model(ModelConfig(**{**CONFIG, "num_hidden_layers": 3}), seed=0)
    graph, weights = split_static(first)
    again, other_weights = split_static(second)
    assert again is graph  # the jit cache's comparison is then an identity test
    assert isinstance(graph, StaticGraph) and all(isinstance(w, jax.Array) for w in weights)
    deep_graph, _ = split_static(deeper)
    assert deep_graph != graph and hash(deep_graph) != hash(graph)
    ids = np.random.default_rng(0).integers(1, 64, size=(2, 7)).astype(np.int32)
    for model, w in ((first, weights), (second, other_weights)):
        np.testing.assert_array_equal(np.asarray(graph.merge(w)(ids)), np.asarray(model(ids)))
    assert not np.allclose(np.asarray(first(ids)), np.asarray(second(ids)))
