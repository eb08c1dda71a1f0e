"""Replay buffer of GRPO groups that carried a learning signal (docs/algorithms/grpo.md §14.9).

A group whose completions all got the same rewards teaches nothing (every advantage is zero). With
``replay.buffer_size > 0`` such groups of a step are swapped for groups with signal kept from earlier steps:

- **Kept:** each group of a step with signal, scored ``Σ_rows |A| · Σ_k std_group(r_k)`` (its advantages in the
  step that generated it, the group standard deviation of each raw reward function). When the buffer is full a
  new group replaces the lowest-scored one only if it scores higher. A group older than ``replay.max_age`` steps
  is dropped.
- **Replayed:** the step's no-signal groups (in batch order) are overwritten by groups drawn from the buffer with
  probability proportional to their scores (clamped at 1e-8), without replacement, so a batch never holds the
  same group twice: with fewer stored groups than no-signal groups, the last no-signal groups stay.
  The draw uses a generator seeded by the run seed and the step (a resumed run draws the same).
- **Nothing stale** (§21 open point 3): a replayed group brings its tokens, its sampler log-probs, its *raw*
  rewards and (episodes) its loss mask; its advantages are computed again with the batch it joins, its old and reference log-probs come
  from the current weights like every other row's, and the sampler-IS correction weighs it by the ratio of
  the current policy to the (older) sampler that generated it.

Metrics: ``replay_buffer_replacements`` (groups replayed into the step), ``replay_buffer_size`` (groups kept
after the step). The buffer is part of the checkpoint (:meth:`ReplayBuffer.state`).
"""

from __future__ import annotations

import base64
import dataclasses
import io
import warnings

import numpy as np

from jrl.data.pipeline import left_pad
from jrl.rollout.base import RolloutBatch, pad_columns
from jrl.sources.config import ReplayConfig  # noqa: F401 (public name)

#: Floor of a group's sampling weight (a zero score would never be drawn).
MIN_SCORE = 1e-8


@dataclasses.dataclass
class ReplayGroup:
    """One kept group: what the step that generated it knew of it, minus anything that depends on the weights."""

    score: float
    step: int
    """The step that generated it."""
    prompt_ids: list[int]
    """The prompt's tokens (unpadded)."""
    completion_ids: np.ndarray
    """[G, T] int32."""
    completion_mask: np.ndarray
    """[G, T] int32."""
    sampling_logprobs: np.ndarray
    """[G, T] float32."""
    truncated: np.ndarray
    """[G] bool."""
    rewards: np.ndarray
    """[G, K] float32 raw rewards (NaN where a function gave none)."""
    loss_mask: np.ndarray | None = None
    """[G, T] int32, the tokens the model wrote (episodes: not the environment's); None: the completion mask."""


def group_scores(rewards: np.ndarray, advantages: np.ndarray, group_size: int) -> np.ndarray:
    """[N // G] replay score of each group: ``Σ_rows |A| · Σ_k std_group(r_k)`` (NaN rewards ignored)."""
    r = np.asarray(rewards, np.float64).reshape(-1, group_size, np.shape(rewards)[-1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a group with no reward from a function: std NaN -> 0
        spread = np.nan_to_num(np.nanstd(r, axis=1)).sum(-1)
    weight = np.abs(np.asarray(advantages, np.float64)).reshape(-1, group_size).sum(-1)
    return weight * spread


def _pack(array: np.ndarray) -> str:
    """An array as base64 ``.npy`` text (exact, NaN included) for the JSON checkpoint meta."""
    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _unpack(text: str) -> np.ndarray:
    return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


class ReplayBuffer:
    """The kept groups and the swap of a step's no-signal groups (module docstring). ``seed``: the run's seed."""

    def __init__(self, cfg: ReplayConfig, *, group_size: int, seed: int):
        self.cfg, self.group_size, self.seed = cfg, int(group_size), int(seed)
        self.groups: list[ReplayGroup] = []

    def __len__(self) -> int:
        return len(self.groups)

    def exchange(self, rollout: RolloutBatch, rewards: np.ndarray, advantages: np.ndarray, has_signal: np.ndarray,
                 *, step: int, pad_id: int, width: int) -> tuple[RolloutBatch, np.ndarray, int]:
        """(rollout, raw rewards, groups replaced): the step's groups without signal (``has_signal`` [N // G])
        overwritten by kept groups, then the step's own groups with signal kept (scored with ``advantages``).
        Completions of the returned rollout are padded to ``width`` tokens."""
        g = self.group_size
        self.groups = [x for x in self.groups if step - x.step <= self.cfg.max_age]
        empty = np.flatnonzero(~np.asarray(has_signal, bool))
        drawn = self._draw(min(len(empty), len(self.groups)), step)
        rollout, spliced = splice_groups(rollout, rewards, {int(s) * g: x for s, x in zip(empty, drawn)},
                                         pad_id=pad_id, width=width)
        # the groups with signal are not spliced over: kept from the padded rollout, scored with this step's values
        for group in self._groups_of(rollout, rewards, advantages, has_signal, step=step):
            self._keep(group)
        return rollout, spliced, len(drawn)

    def _draw(self, n: int, step: int) -> list[ReplayGroup]:
        if n == 0:
            return []
        p = np.maximum([x.score for x in self.groups], MIN_SCORE)
        rng = np.random.default_rng([self.seed, step, 0x5E91])
        picked = rng.choice(len(self.groups), size=n, replace=False, p=p / p.sum())
        return [self.groups[i] for i in picked]

    def _groups_of(self, rollout: RolloutBatch, rewards, advantages, has_signal, *, step: int):
        g = self.group_size
        scores = group_scores(rewards, advantages, g)
        prompts = rollout.prompt_lists()
        out = []
        for k in np.flatnonzero(np.asarray(has_signal, bool)):
            rows = slice(int(k) * g, int(k) * g + g)
            out.append(ReplayGroup(float(scores[k]), int(step), [int(t) for t in prompts[rows.start]],
                                   rollout.completion_ids[rows].copy(), rollout.completion_mask[rows].copy(),
                                   rollout.sampling_logprobs[rows].copy(), rollout.truncated[rows].copy(),
                                   np.asarray(rewards[rows], np.float32).copy(),
                                   None if rollout.loss_mask is None else np.asarray(rollout.loss_mask[rows]).copy()))
        return out

    def _keep(self, group: ReplayGroup) -> None:
        if len(self.groups) < self.cfg.buffer_size:
            self.groups.append(group)
            return
        low = min(range(len(self.groups)), key=lambda i: self.groups[i].score)
        if group.score > self.groups[low].score:
            self.groups[low] = group

    # ------------------------------------------------------------------ checkpoint
    def state(self) -> list[dict]:
        """The kept groups as JSON-safe dicts (arrays as base64 ``.npy``)."""
        return [{"score": x.score, "step": x.step, "prompt_ids": x.prompt_ids,
                 **{f: _pack(getattr(x, f)) for f in _ARRAY_FIELDS},
                 **({} if x.loss_mask is None else {"loss_mask": _pack(x.loss_mask)})} for x in self.groups]

    def load_state(self, state: list[dict]) -> None:
        self.groups = [ReplayGroup(float(d["score"]), int(d["step"]), [int(t) for t in d["prompt_ids"]],
                                   **{f: _unpack(d[f]) for f in _ARRAY_FIELDS},
                                   loss_mask=_unpack(d["loss_mask"]) if "loss_mask" in d else None) for d in state]


_ARRAY_FIELDS = ("completion_ids", "completion_mask", "sampling_logprobs", "truncated", "rewards")


def splice_groups(rollout: RolloutBatch, rewards: np.ndarray, at: dict[int, ReplayGroup], *, pad_id: int,
                  width: int) -> tuple[RolloutBatch, np.ndarray]:
    """(rollout, rewards) with the rows from each key of ``at`` on taken by that group; completions padded to
    ``width`` tokens, prompts left-padded to the longest."""
    prompts = rollout.prompt_lists()
    ids = pad_columns(np.asarray(rollout.completion_ids, np.int32), width, pad_id)
    mask = pad_columns(np.asarray(rollout.completion_mask, np.int32), width, 0)
    logp = pad_columns(np.asarray(rollout.sampling_logprobs, np.float32), width, np.nan)
    masked = rollout.loss_mask is not None or any(g.loss_mask is not None for g in at.values())
    loss = pad_columns(np.asarray(rollout.completion_mask if rollout.loss_mask is None else rollout.loss_mask,
                                  np.int32), width, 0) if masked else None
    truncated = np.array(rollout.truncated, bool)
    rewards = np.array(rewards, np.float32)
    for start, group in at.items():
        rows = slice(start, start + len(group.truncated))
        prompts[rows] = [list(group.prompt_ids)] * len(group.truncated)
        ids[rows] = pad_columns(np.where(group.completion_mask > 0, group.completion_ids, pad_id), width, pad_id)
        mask[rows] = pad_columns(group.completion_mask, width, 0)
        logp[rows] = pad_columns(group.sampling_logprobs, width, np.nan)
        if masked:
            loss[rows] = pad_columns(group.completion_mask if group.loss_mask is None else group.loss_mask, width, 0)
        truncated[rows], rewards[rows] = group.truncated, group.rewards
    p_ids, p_mask = left_pad(prompts, pad_id)
    return dataclasses.replace(rollout, prompt_ids=p_ids, prompt_mask=p_mask, completion_ids=ids,
                               completion_mask=mask, sampling_logprobs=logp, truncated=truncated,
                               loss_mask=loss), rewards
