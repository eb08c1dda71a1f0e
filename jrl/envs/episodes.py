"""Multi-turn episodes on any rollout engine: the model's turn, the environment's answer, the model's next turn.

The first turn samples ``num_generations`` completions per prompt; each later turn one continuation per live
episode, from token ids, so the ids the engine continues from are the ids trained on (no re-tokenisation between
turns). An engine with the ``sessions`` capability (the embedded sampler) keeps each episode's KV cache between
turns and prefills only the observation (``JaxRolloutEngine.continue_session``); others (vLLM), or
``env.reuse_kv_cache=False``, get the episode's whole token sequence so far as the next turn's prompt.

The trained row is the prompt followed by the episode: every model turn and observation in order, with
``completion_mask`` 1 over all of them (the model attends to everything) and ``loss_mask`` 1 on the model's tokens
only, so observations are context, never targets; their sampler log-probs are NaN. An episode ends when its
environment says ``done``, after ``env.max_turns`` model turns, or when it reaches ``env.max_episode_tokens``
(truncated: the last piece is cut to fit). An environment step that raises, takes longer than
``env.step_timeout_s`` or returns something else than a :class:`~jrl.envs.base.StepResult` ends its episode with a
NaN reward (no reward, as a failed reward function's), counted by kind.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
from collections.abc import Callable

import numpy as np

from jrl.envs.base import Episode, StepResult
from jrl.envs.config import EnvConfig
from jrl.rollout.base import RolloutBatch, SamplingParams, concat_rollouts, step_seed

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EpisodeRollout:
    """The episodes of a prompt batch: the trained rows, each episode's reward and turns, and the environment's
    errors by kind (``exception``, ``timeout``, ``bad_result``)."""

    rollout: RolloutBatch
    rewards: np.ndarray
    """[N] float32, the sum of each episode's turn rewards (NaN where the environment failed)."""
    turns: np.ndarray
    """[N] int, model turns per episode."""
    errors: dict[str, int]

    @property
    def policy_version(self) -> int:
        return self.rollout.policy_version


def join_episodes(parts: list[EpisodeRollout], pad_id: int) -> EpisodeRollout:
    """The episodes of ``parts`` (chunks of one prompt batch, in order) as one: rows joined (completions padded to the
    longest), rewards and turns in row order, errors added up."""
    errors: collections.Counter = collections.Counter()
    for part in parts:
        errors.update(part.errors)
    return EpisodeRollout(concat_rollouts([p.rollout for p in parts], pad_id),
                          np.concatenate([p.rewards for p in parts]), np.concatenate([p.turns for p in parts]),
                          dict(errors))


@dataclasses.dataclass
class _Row:
    """One episode being played."""

    episode: Episode | None
    context: list[int]
    pieces: list[tuple[list[int], list[float], bool]] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    used: int = 0
    truncated: bool = False
    live: bool = True
    pending: list[int] = dataclasses.field(default_factory=list)
    """The observation the next turn continues after."""


class EnvSteps:
    """Environment steps with a time limit each: run in threads; a step past its limit is abandoned (its thread
    left to finish alone) and its episode ends."""

    def __init__(self, timeout_s: float, workers: int = 8):
        self.timeout_s = timeout_s
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="jrl-env")

    def run(self, calls: list[tuple[Episode, str, list[int]]]) -> list[StepResult | str]:
        """Each call's result, or the kind of its failure."""
        futures = [self.pool.submit(episode.step, text, ids) for episode, text, ids in calls]
        out: list[StepResult | str] = []
        for future in futures:
            try:
                result = future.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                out.append("timeout")
                continue
            except Exception as e:  # noqa: BLE001 - an environment's failure ends its episode, counted
                logger.warning("environment step raised %s: %s (the episode ends with no reward)",
                               type(e).__name__, e)
                out.append("exception")
                continue
            ok = (isinstance(result, StepResult) and isinstance(result.reward, (int, float))
                  and math.isfinite(result.reward))
            out.append(result if ok else "bad_result")
        return out

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def run_episodes(engine, env, prompt_batch, sampling: SamplingParams, *, num_generations: int, seed: int,
                 cfg: EnvConfig, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str],
                 pad_id: int, steps: EnvSteps) -> EpisodeRollout:
    """Play one episode per completion row of ``prompt_batch`` (``num_generations`` per prompt) against ``env``
    (module docstring)."""
    g = num_generations
    rows = []
    for p, ids in enumerate(prompt_batch.prompt_ids):
        columns = {k: v[p] for k, v in prompt_batch.columns.items()}
        columns.setdefault("prompt", prompt_batch.prompt_texts[p])
        for _ in range(g):
            rows.append(_Row(env.reset(dict(columns)), list(ids)))
    errors: collections.Counter = collections.Counter()
    live = list(range(len(rows)))
    turn, version, session, previous = 0, None, None, live
    sessions = cfg.reuse_kv_cache and "sessions" in getattr(engine, "capabilities", ())
    while live:
        if turn == 0 and sessions:
            batch, session = engine.start_session(prompt_batch.prompt_ids, sampling, num_generations=g, seed=seed)
        elif turn == 0:
            batch = engine.generate(prompt_batch.prompt_ids, sampling, num_generations=g, seed=seed)
        elif sessions:  # the rows of ``session`` are the episodes live at the previous turn, in order
            slot = {i: k for k, i in enumerate(previous)}
            batch, session = engine.continue_session(session, [slot[i] for i in live], [rows[i].pending for i in live],
                                                     sampling, seed=step_seed(seed, turn))
        else:
            batch = engine.generate([rows[i].context for i in live], sampling, num_generations=1,
                                    seed=step_seed(seed, turn))
        version = batch.policy_version if version is None else version
        if batch.policy_version != version:
            raise RuntimeError(f"turn {turn} was sampled from weights version {batch.policy_version}, the episode's "
                               f"first turn from {version}")
        lengths = np.asarray(batch.completion_mask).sum(-1).astype(int)
        last_turn = turn + 1 >= cfg.max_turns
        calls, stepping = [], []
        for k, i in enumerate(live):
            row, n = rows[i], int(lengths[k])
            ids = [int(t) for t in batch.completion_ids[k, :n]]
            lps = [float(x) for x in batch.sampling_logprobs[k, :n]]
            room = cfg.max_episode_tokens - row.used
            cut = n > room
            ids, lps = ids[:room], lps[:room]
            row.pieces.append((ids, lps, True))
            row.used += len(ids)
            row.context += ids
            row.turns += 1
            row.truncated = cut or bool(batch.truncated[k])
            if cut or row.used >= cfg.max_episode_tokens:
                row.truncated, row.live = True, False
            calls.append((row.episode, decode(ids), ids))
            stepping.append(i)
        for i, result in zip(stepping, steps.run(calls)):
            row = rows[i]
            if isinstance(result, str):
                errors[result] += 1
                row.reward, row.live = math.nan, False
                continue
            row.reward += float(result.reward)
            if result.done:
                row.live, row.truncated = False, False
            elif row.live and last_turn:
                row.live = False
            elif row.live:
                obs = list(result.observation) if not isinstance(result.observation, str) else encode(
                    result.observation)
                obs = [int(t) for t in obs][:cfg.max_episode_tokens - row.used]
                row.pending = obs
                row.pieces.append((obs, [math.nan] * len(obs), False))
                row.used += len(obs)
                row.context += obs
                if row.used >= cfg.max_episode_tokens:
                    row.truncated, row.live = True, False
        previous, live = live, [i for i in live if rows[i].live]
        turn += 1
    return EpisodeRollout(_assemble(rows, prompt_batch, g, pad_id, version),
                          np.asarray([r.reward for r in rows], np.float32), np.asarray([r.turns for r in rows]),
                          dict(errors))


def _assemble(rows: list[_Row], prompt_batch, g: int, pad_id: int, version: int) -> RolloutBatch:
    """The rows as one :class:`RolloutBatch` with a ``loss_mask`` on the model's tokens."""
    p_ids, p_mask = prompt_batch.left_pad(pad_id)
    width = max(1, max(r.used for r in rows))
    n = len(rows)
    ids = np.full((n, width), pad_id, np.int32)
    mask = np.zeros((n, width), np.int32)
    loss = np.zeros((n, width), np.int32)
    lps = np.full((n, width), np.nan, np.float32)
    for i, row in enumerate(rows):
        at = 0
        for piece, piece_lps, by_model in row.pieces:
            end = at + len(piece)
            ids[i, at:end], mask[i, at:end], lps[i, at:end] = piece, 1, piece_lps
            loss[i, at:end] = int(by_model)
            at = end
    return RolloutBatch(prompt_ids=np.repeat(np.asarray(p_ids, np.int32), g, axis=0),
                        prompt_mask=np.repeat(np.asarray(p_mask, np.int32), g, axis=0), completion_ids=ids,
                        completion_mask=mask, sampling_logprobs=lps,
                        truncated=np.asarray([r.truncated for r in rows], bool), policy_version=version,
                        loss_mask=loss)
