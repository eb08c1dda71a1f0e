"""Multi-turn episodes (jrl.envs.episodes) on the real embedded sampler with a tiny random model: a row is the
prompt, then the model's turns and the environment's observations in order, the loss mask covering the model's
tokens only; the sampler's log-probs of every turn equal the trainer's on the assembled row; episodes end at done,
max_turns or the token budget; an environment that raises, returns junk or hangs ends its episode with no reward
(NaN), counted by kind, and the other episodes go on."""

from __future__ import annotations

import dataclasses
import math
import threading

import numpy as np
import pytest

from jrl.data.pipeline import PromptBatch
from jrl.envs import EnvConfig, EnvSteps, StepResult, run_episodes
from jrl.models import ModelConfig, create_model
from jrl.rollout import SamplingParams
from jrl.rollout.jax_engine import JaxRolloutEngine

VOCAB, PAD, TEMPERATURE = 48, 0, 0.7
OBS = [40, 41, 42]
RELEASE = threading.Event()  # set at the end of the module: lets the hanging environment's thread finish


@pytest.fixture(scope="module", autouse=True)
def release_hung_steps():
    yield
    RELEASE.set()


@pytest.fixture(scope="module")
def engine():
    model = create_model(ModelConfig(model_type="llama", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=256, initializer_range=0.3, pad_token_id=PAD), seed=3)
    return model, JaxRolloutEngine(model, pad_id=PAD, prompt_bucket=16)


@dataclasses.dataclass
class Scripted:
    """An environment whose episodes answer turn ``k`` with ``script[k]`` (a StepResult, or "raise"/"junk"/"hang"
    for the row indices in ``bad``); every turn's token ids are recorded per episode."""

    script: list
    bad: dict = dataclasses.field(default_factory=dict)
    seen: list = dataclasses.field(default_factory=list)

    def reset(self, row):
        episode = ScriptedEpisode(self, len(self.seen), [])
        self.seen.append(episode.turns)
        return episode


@dataclasses.dataclass
class ScriptedEpisode:
    env: Scripted
    index: int
    turns: list

    def step(self, text, token_ids):
        self.turns.append(list(token_ids))
        what = self.env.bad.get(self.index)
        if what == "raise":
            raise RuntimeError("environment bug")
        if what == "junk":
            return {"reward": 1.0}
        if what == "hang":
            RELEASE.wait(60)
        return self.env.script[min(len(self.turns) - 1, len(self.env.script) - 1)]


def prompts(n=3):
    rng = np.random.default_rng(0)
    ids = [rng.integers(1, 30, size=int(k)).tolist() for k in (5, 9, 3)[:n]]
    return PromptBatch(prompt_ids=ids, prompt_texts=[""] * n, prompts=[""] * n, columns={"answer": list(range(n))},
                       indices=list(range(n)))


def play(engine, env, *, max_turns=4, budget=200, timeout=20.0, g=2, max_new=6):
    steps = EnvSteps(timeout)
    try:
        return run_episodes(engine, env, prompts(), SamplingParams(max_new_tokens=max_new, temperature=TEMPERATURE,
                                                                   stop_token_ids=(5, 9, 17)),
                            num_generations=g, seed=1, cfg=EnvConfig(name="x", max_turns=max_turns,
                                                                    max_episode_tokens=budget, step_timeout_s=timeout),
                            encode=lambda t: [int(x) for x in t.split()], decode=lambda ids: " ".join(map(str, ids)),
                            pad_id=PAD, steps=steps)
    finally:
        steps.close()


def test_rows_hold_model_turns_and_observations_with_the_loss_on_the_model_tokens(engine):
    _, eng = engine
    env = Scripted([StepResult(observation=OBS, reward=0.25), StepResult(observation="43 44", reward=0.5),
                    StepResult(reward=1.0, done=True)])
    out = play(eng, env)
    r = out.rollout
    assert r.completion_ids.shape[0] == 6 and out.turns.tolist() == [3] * 6
    np.testing.assert_allclose(out.rewards, 1.75)
    for i, turns in enumerate(env.seen):
        row_ids = r.completion_ids[i][r.completion_mask[i] > 0].tolist()
        assert row_ids == turns[0] + OBS + turns[1] + [43, 44] + turns[2]  # in order, nothing dropped
        loss = r.loss_mask[i][r.completion_mask[i] > 0].tolist()
        assert loss == [1] * len(turns[0]) + [0] * 3 + [1] * len(turns[1]) + [0] * 2 + [1] * len(turns[2])
        lp = r.sampling_logprobs[i][r.completion_mask[i] > 0]
        assert np.isnan(lp[np.asarray(loss) == 0]).all() and (lp[np.asarray(loss) == 1] < 0).all()
    assert not r.truncated.any() and out.errors == {}


def test_sampler_logprobs_of_every_turn_equal_the_trainers(engine):
    from jrl.train.algorithms.grpo_update import build_step_batch, completion_logprobs

    model, eng = engine
    out = play(eng, Scripted([StepResult(observation=OBS), StepResult(observation=OBS), StepResult(done=True)]))
    r = out.rollout
    batch = build_step_batch(r, np.zeros(len(r.truncated), np.float32), pad_id=PAD,
                             completion_length=r.completion_ids.shape[1])
    assert (batch.completion_mask == r.loss_mask).all()  # the loss covers the model's tokens
    assert (batch.attention_mask[:, -r.completion_ids.shape[1]:] == r.completion_mask).all()  # all are attended
    trainer = np.asarray(completion_logprobs(model, batch, temperature=TEMPERATURE)[0])
    model_tokens = r.loss_mask > 0
    assert model_tokens.sum() > 3 * len(r.truncated)  # several turns of several tokens
    assert np.abs(trainer - r.sampling_logprobs)[model_tokens].max() <= 1e-4


def test_episodes_end_at_max_turns_and_at_the_token_budget(engine):
    _, eng = engine
    out = play(eng, Scripted([StepResult(observation=OBS)]), max_turns=2)
    assert out.turns.tolist() == [2] * 6
    assert [(r > 0).sum() for r in out.rollout.loss_mask] == [
        int(m.sum()) - 3 for m in out.rollout.completion_mask]  # two turns, one observation between them
    out = play(eng, Scripted([StepResult(observation=OBS)]), max_turns=10, budget=12)
    assert (out.rollout.completion_mask.sum(-1) <= 12).all() and out.rollout.completion_mask.shape[1] <= 12
    assert out.rollout.truncated.all()


def test_a_failing_environment_ends_its_episode_with_no_reward(engine):
    _, eng = engine
    env = Scripted([StepResult(observation=OBS, reward=0.5), StepResult(reward=1.0, done=True)],
                   bad={0: "raise", 2: "junk", 4: "hang"})
    out = play(eng, env, timeout=1.0)
    assert out.errors == {"exception": 1, "bad_result": 1, "timeout": 1}
    bad = [0, 2, 4]
    assert np.isnan(out.rewards[bad]).all() and out.turns[bad].tolist() == [1, 1, 1]
    np.testing.assert_allclose(np.delete(out.rewards, bad), 1.5)  # the other episodes played on
    assert not math.isnan(float(np.delete(out.rewards, bad).sum()))


def test_episodes_on_the_kv_cache_equal_episodes_prefilled_again(engine):
    """Greedy decoding (top_k=1): continuing on the cache gives the tokens of prefilling every turn's conversation."""
    _, eng = engine
    env = Scripted([StepResult(observation=OBS, reward=0.25), StepResult(observation=[], reward=0.5),
                    StepResult(observation="43 44 45 46 47 1 2 3 4 5", reward=0.5), StepResult(done=True)])
    greedy = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1, stop_token_ids=(5, 9, 17))
    runs = []
    for reuse in (True, False):
        steps = EnvSteps(20.0)
        try:
            runs.append(run_episodes(eng, env, prompts(), greedy, num_generations=2, seed=1,
                                     cfg=EnvConfig(name="x", max_turns=4, max_episode_tokens=200,
                                                   reuse_kv_cache=reuse),
                                     encode=lambda t: [int(x) for x in t.split()],
                                     decode=lambda ids: " ".join(map(str, ids)), pad_id=PAD, steps=steps))
        finally:
            steps.close()
    cached, prefilled = (r.rollout for r in runs)
    assert (runs[0].turns == 4).all() and cached.completion_ids.shape == prefilled.completion_ids.shape
    np.testing.assert_array_equal(cached.completion_ids, prefilled.completion_ids)
    np.testing.assert_array_equal(cached.loss_mask, prefilled.loss_mask)


def test_a_session_continues_like_generate_on_the_whole_conversation(engine):
    """The engine's own contract: continue_session (an addition, an empty one, rows in another order) samples what
    generate samples on the conversation so far, with the same log-probs, at temperature 0.7 with the same seed."""
    _, eng = engine
    params = SamplingParams(max_new_tokens=5, temperature=TEMPERATURE, stop_token_ids=(5,))
    first, session = eng.start_session(prompts().prompt_ids, params, num_generations=2, seed=3)
    conversations = [list(p) + list(c[m > 0]) for p, c, m in zip(np.repeat(np.asarray(
        prompts().prompt_ids, dtype=object), 2), first.completion_ids, first.completion_mask)]
    rows, added = [4, 0, 3], [[7, 8], [], [11]]
    second, _ = eng.continue_session(session, rows, added, params, seed=9)
    again = eng.generate([conversations[r] + a for r, a in zip(rows, added)], params, num_generations=1, seed=9)
    np.testing.assert_array_equal(second.completion_ids, again.completion_ids)
    np.testing.assert_array_equal(second.completion_mask, again.completion_mask)
    m = second.completion_mask > 0
    assert np.abs(second.sampling_logprobs - again.sampling_logprobs)[m].max() <= 1e-5
    with pytest.raises(ValueError, match="outside the session"):
        eng.continue_session(session, [6], [[1]], params, seed=0)
