"""Worker (8 fake CPU devices) for test_placement_guardrails.py: places a tiny model whose vocabulary (65) does not
divide tensor=2, twice, and a module with an unknown logical axis name. Prints one JSON line."""

from __future__ import annotations

import json
import logging

import jax
from flax import nnx

import common
from jrl import sharding as S
from jrl.models import create_model


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


class Odd(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jax.numpy.zeros((4, 4)), logical_axes=("embed", "mystery"))


def main() -> None:
    assert jax.device_count() == 8
    handler = Records()
    logging.getLogger("jrl.sharding").addHandler(handler)
    cfg = S.MeshConfig(fsdp=4, tensor=2)
    mesh, rules = S.make_mesh(cfg), cfg.logical_rules()
    config = common.CONFIGS["dense"].replace(vocab_size=65, tie_word_embeddings=False)
    model = create_model(config, mesh=mesh, rules=rules)
    create_model(config, mesh=mesh, rules=rules)
    lines = S.check_placement(model, mesh, rules)
    try:
        S.shard_model(Odd(), mesh, rules)
        unknown = ""
    except ValueError as e:
        unknown = str(e)
    print(json.dumps(dict(
        warnings=[m for m in handler.messages if "stay replicated" in m], lines=lines,
        expected_lines=["embed.embedding dim 0 ('vocab', 65) over tensor=2",
                        "lm_head.kernel dim 1 ('vocab', 65) over tensor=2"],
        placed_spec=list(model.embed.embedding.get_value().sharding.spec), unknown_error=unknown)))


if __name__ == "__main__":
    main()
