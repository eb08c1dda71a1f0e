"""Held-out evaluation during a run: every ``eval_every`` steps (and before the first step of a fresh run) the
eval prompts are completed once each with greedy and/or sampled decoding by the rollout engine holding the
current weights, scored by the run's reward functions, and logged as ``eval/<decoding>/...`` metrics
(``eval.jsonl`` and TensorBoard) with a few sample completions (``eval_samples.jsonl`` and TensorBoard text).

With the arithmetic task's ``exact_match`` reward, ``eval/greedy/reward/exact_match/mean`` is the held-out
accuracy.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import NamedTuple

import numpy as np

from jrl.data.config import DataConfig
from jrl.data.pipeline import PromptDataset, build_prompt_dataset
from jrl.rollout.base import SamplingParams
from jrl.sharding import is_main_process
from jrl.validation import invalid
from jrl.train.eval_config import EvalConfig  # noqa: F401 (public name)


def sampling_for(decoding: str, sampling: SamplingParams) -> SamplingParams:
    """The run's sampling parameters, or greedy ones (top-k 1) with the same length and stop tokens."""
    if decoding == "sampled":
        return sampling
    return dataclasses.replace(sampling, temperature=1.0, top_p=1.0, top_k=1)


class Completions(NamedTuple):
    """One completion per prompt of a batch."""

    texts: list[str]
    ids: list[list[int]]
    truncated: np.ndarray
    """[N] bool: no stop token within ``max_new_tokens``."""
    episode_rewards: np.ndarray | None = None
    """[N] float32 reward of each multi-turn episode (``env``), scored with the reward functions' columns."""


class Evaluator:
    """Evaluates the engine's current weights on ``prompts`` (see the module docstring).

    The algorithm supplies ``complete(engine, prompt_batch, sampling, seed) -> Completions`` and
    ``score(prompt_batch, completions, step) -> (rewards [N, F], names, reward metrics)``.
    """

    def __init__(self, cfg: EvalConfig, prompts: PromptDataset, *, sampling: SamplingParams, complete, score,
                 weights, output_dir: str | Path, seed: int):
        self.cfg, self.prompts, self.sampling = cfg, prompts, sampling
        self._all = prompts.batch(range(len(prompts)))  # every eval prompt with its columns, for the rewards
        self._complete, self._score = complete, score
        self.weights = np.asarray(weights, np.float32)
        self.samples_path = Path(output_dir) / "eval_samples.jsonl"
        self.seed = seed

    def run(self, engine, step: int, writer) -> dict[str, float]:
        """Evaluate at ``step``; the ``eval/*`` metrics (the samples go to ``eval_samples.jsonl`` and ``writer``)."""
        out: dict[str, float] = {}
        for decoding in self.cfg.decodings:
            params = sampling_for(decoding, self.sampling)
            parts = []
            for start in range(0, len(self.prompts), self.cfg.batch_size):
                batch = self.prompts.batch(range(start, min(start + self.cfg.batch_size, len(self.prompts))))
                parts.append(self._complete(engine, batch, params, seed=self.seed + 7919 * step + start))
            episodes = [p.episode_rewards for p in parts]
            done = Completions([t for p in parts for t in p.texts], [x for p in parts for x in p.ids],
                               np.concatenate([p.truncated for p in parts]),
                               None if episodes[0] is None else np.concatenate(episodes))
            rewards, names, metrics = self._score(self._all, done, step)
            lengths = np.asarray([len(x) for x in done.ids], np.float32)
            metrics = {**metrics, "completions/mean_length": float(lengths.mean()),
                       "completions/truncated_fraction": float(np.mean(done.truncated))}
            out.update({f"eval/{decoding}/{k}": v for k, v in metrics.items()})
            if is_main_process():  # the same samples on every process
                self._write_samples(step, decoding, done.texts, rewards, names, writer)
        return out

    def _write_samples(self, step: int, decoding: str, texts, rewards: np.ndarray, names, writer) -> None:
        n = min(self.cfg.num_samples, len(texts))
        if n == 0:
            return
        prompts = self._all.prompts
        rows = []
        for i in range(n):
            per_fn = {name: (float(v) if np.isfinite(v) else None) for name, v in zip(names, rewards[i])}
            total = float(np.nansum(rewards[i] * self.weights)) if np.isfinite(rewards[i]).any() else None
            rows.append({"step": int(step), "decoding": decoding, "prompt": prompts[i], "completion": texts[i],
                         "rewards": per_fn, "reward": total})
        with self.samples_path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row, allow_nan=False, default=str) + "\n")
        table = ["| prompt | completion | reward |", "|---|---|---|"]
        table += [f"| {_cell(r['prompt'])} | {_cell(r['completion'])} | {r['reward']} |" for r in rows]
        writer.write_text(f"eval/{decoding}/samples", "\n".join(table), step)


def _cell(value) -> str:
    """``value`` as one Markdown table cell."""
    return str(value).replace("|", "\\|").replace("\n", "<br>")


def split_eval_prompts(cfg: EvalConfig, data: DataConfig, train: PromptDataset, tokenizer, *,
                       tools: list[dict] | None = None) -> tuple[PromptDataset, PromptDataset]:
    """(the training prompts, the eval prompts): the last ``holdout`` of ``train`` when ``cfg.source`` is None,
    else ``train`` and the prompts of ``cfg.source`` rendered as the ``data`` section renders prompts (declaring
    ``tools`` as the training prompts do)."""
    if cfg.source is None:
        if not 0 < cfg.holdout < len(train):
            raise invalid("EvalConfig", "holdout", cfg.holdout,
                          f"the training source has {len(train)} prompts; hold out fewer, or give eval.source")
        return train.hold_out(cfg.holdout)
    eval_data = DataConfig(source=cfg.source, prompt_column=data.prompt_column,
                           use_chat_template=data.use_chat_template, system_prompt=data.system_prompt,
                           max_prompt_length=data.max_prompt_length, shuffle=False)
    return train, build_prompt_dataset(eval_data, tokenizer, tools=tools)
