"""Child process of ``test_rollout_mesh.py``: on 2 fake CPU devices, a paged generation continued twice from its kept
pages, the rows' groups split over both devices without naming the device that kept them (so kept rows move between
devices) and naming it (so none moves), against one generation on one device, noting where each device's pool was
allocated; prints JSON."""

from __future__ import annotations

import dataclasses
import json
import sys

import jax
import numpy as np
from flax import nnx
from rollout_testlib import PAD, continue_from_kept, random_prompts, tiny_model

from jrl.rollout import SamplingParams
from jrl.rollout.jax_engine import row_bucket
from jrl.rollout.kv_config import KVCacheConfig
from jrl.rollout import paged
from jrl.rollout.paged import device_parts, generate_paged, new_groups


def _noting_pools(pools: dict) -> None:
    """Note in ``pools`` the devices of each pool :func:`paged._empty_pool` returns, by its weights' device."""
    empty_pool = paged._empty_pool

    def noted(graphdef, state, **kw):
        out = empty_pool(graphdef, state, **kw)
        held = pools.setdefault(str(paged._device(state)), set())
        held.update(str(d) for x in jax.tree.leaves(out) for d in x.devices())
        return out

    paged._empty_pool = noted


def main(lengths_json):
    assert jax.device_count() == 2, jax.devices()
    pools: dict[str, set] = {}
    _noting_pools(pools)
    prompts = random_prompts(np.random.default_rng(6), json.loads(lengths_json))
    params = SamplingParams(max_new_tokens=40, temperature=1.0, stop_token_ids=(5, 9, 17))
    kv = KVCacheConfig(layout="paged", page_size=8, round_steps=4, slots=8)
    graphdef, state = nnx.split(tiny_model("llama", seed=5))
    states = [jax.device_put(state, d) for d in jax.devices()]
    whole = generate_paged(graphdef, states[:1], new_groups(prompts, 3), params, seed=7, kv=kv, pad_id=PAD,
                           prompt_bucket=8, slot_bucket=row_bucket)
    kvs = (kv, dataclasses.replace(kv, slots=2), kv)
    n = [int(m.sum()) for m in whole["mask"]]
    result = dict(whole_tokens=[whole["tokens"][r, :k].tolist() for r, k in enumerate(n)],
                  whole_logprobs=[whole["logprobs"][r, :k].tolist() for r, k in enumerate(n)])
    for name, homes in (("moving", False), ("homed", True)):
        tokens, logprobs, outs = continue_from_kept(graphdef, states, prompts, params, kvs, g=3, needed=(1, 2, 0),
                                                    homes=homes)
        moved = 0  # kept rows placed on another device than the one that kept them
        for out in outs[1:]:
            for part, members in enumerate(device_parts(out["groups"], 2)):
                for i in members:
                    row = out["groups"][i].kept[0]
                    moved += row is not None and jax.devices()[part] not in row.pages.logits.devices()
        result[name] = dict(tokens=tokens, logprobs=logprobs, moved=int(moved), generations=len(outs),
                            homes=[int(h) for out in outs for h in out["home"]])
    result["pools"] = {device: sorted(held) for device, held in pools.items()}
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
