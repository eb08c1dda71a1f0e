"""A rollout's completions as the reward functions get them: texts and token-id lists."""

from __future__ import annotations

import numpy as np

from jrl.data.tokenizer import load_byte_tokenizer
from jrl.rollout.base import RolloutBatch
from jrl.train.algorithms.group_sampler import completion_token_lists, decoded_completions


def _rollout(rng, rows: int, width: int) -> RolloutBatch:
    lengths = rng.integers(0, width + 1, rows)
    lengths[:2] = (0, width)  # an empty completion and a full one
    mask = (np.arange(width)[None] < lengths[:, None]).astype(np.int32)
    return RolloutBatch(prompt_ids=np.ones((rows, 3), np.int32), prompt_mask=np.ones((rows, 3), np.int32),
                        completion_ids=rng.integers(0, 262, (rows, width)).astype(np.int32), completion_mask=mask,
                        sampling_logprobs=np.zeros((rows, width), np.float32), truncated=lengths == width)


def test_decoded_completions_match_decoding_each_id_list():
    rng = np.random.default_rng()
    tok = load_byte_tokenizer()
    rollout = _rollout(rng, 64, 40)
    texts, ids = decoded_completions(tok, rollout)
    lengths = rollout.completion_mask.sum(-1)
    assert ids == [[int(t) for t in row[:n]] for row, n in zip(rollout.completion_ids, lengths)]
    assert ids == completion_token_lists(rollout)
    assert all(type(t) is int for row in ids for t in row)  # plain ints: the reward functions' inputs are JSON-able
    assert texts == [tok.decode(x, skip_special_tokens=True) for x in ids]
    assert texts[0] == "" and any(t for t in texts)
