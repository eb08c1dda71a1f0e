"""Multi-turn episodes (jrl.envs) on a real vLLM server: each turn is a token-in/token-out completion of the
episode's ids so far, so the row trained on holds exactly the ids the server continued (the environment's
observations as the tokenizer encodes them, between the model's turns), and the server's log-probs of the model's
tokens of every turn agree with the trainer's on that row."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer
from vllm_testlib import EOS_ID, PAD_ID, TINY_MODEL, logprob_tolerance, trainer_logprobs

from jrl.data.pipeline import PromptBatch
from jrl.envs import ENVIRONMENTS, EnvConfig, EnvSteps, run_episodes
from jrl.models import from_pretrained
from jrl.rollout import SamplingParams
from jrl.rollout.vllm_engine import VLLMRolloutEngine

pytestmark = pytest.mark.vllm

TEMPERATURE, TURNS = 0.8, 3


def test_episodes_on_vllm_train_on_the_ids_the_server_continued(vllm_server, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    model = from_pretrained(TINY_MODEL, dtype="float32")
    engine = VLLMRolloutEngine(model, config=vllm_server.config, sync_dir=tmp_path / "sync", pad_id=PAD_ID)
    questions = ["What is 3+4?", "What is 9-2?"]
    prompts = PromptBatch(prompt_ids=[[257] + list(q.encode()) for q in questions], prompt_texts=questions,
                          prompts=questions, columns={"answer": [10 ** 6] * 2},  # never guessed: every turn is played
                          indices=[0, 1])
    cfg = EnvConfig(name="higher_lower", max_turns=TURNS, max_episode_tokens=120)
    steps = EnvSteps(cfg.step_timeout_s)
    try:
        out = run_episodes(engine, ENVIRONMENTS.get("higher_lower")(cfg), prompts,
                           SamplingParams(max_new_tokens=16, temperature=TEMPERATURE, stop_token_ids=(EOS_ID,)),
                           num_generations=3, seed=4, cfg=cfg,
                           encode=lambda t: tokenizer.encode(t, add_special_tokens=False),
                           decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True), pad_id=PAD_ID,
                           steps=steps)
    finally:
        steps.close()
        engine.close()
    r = out.rollout
    assert out.turns.tolist() == [TURNS] * 6 and (out.rewards == 0).all() and out.errors == {}
    hints = {tuple(tokenizer.encode(f" {h}\n", add_special_tokens=False)) for h in ("higher", "lower", "no answer")}
    for ids, mask, loss in zip(r.completion_ids, r.completion_mask, r.loss_mask):
        ids, loss = ids[mask > 0], loss[mask > 0]
        # Split the row at the loss mask's edges: model turn, observation, model turn, observation, model turn.
        edges = np.flatnonzero(np.diff(loss)) + 1
        pieces = np.split(ids, edges)
        assert len(pieces) == 2 * TURNS - 1 and loss[0] == 1
        assert all(tuple(p) in hints for p in pieces[1::2]), pieces  # the observations, as the tokenizer encodes them
    model_tokens = r.loss_mask > 0
    got = r.sampling_logprobs[model_tokens]
    assert np.isfinite(got).all() and np.isnan(r.sampling_logprobs[(r.completion_mask > 0) & ~model_tokens]).all()
    diff = np.abs(trainer_logprobs(model, r, TEMPERATURE)[model_tokens] - got).mean()
    assert diff <= logprob_tolerance(vllm_server.config.dtype), diff
