"""Partial rollouts (``rollout.partial``): a step's generation ends once it has ``data.prompts_per_batch`` finished
groups, and the rows still running go on in the next step's generation instead of holding the step up.

The first step takes two prompt batches from the loader, every later step one, and each trains on one batch's worth
of groups: so one batch's worth of groups is always carried, and a step's generation runs those and its new prompts'
until enough are finished. Each step hands the paged sampler
(:meth:`jrl.rollout.jax_engine.JaxRolloutEngine.paged_groups`) the groups carried from earlier steps first (only
their unfinished rows decode, each after the tokens it has: prefilled again under the newest weights), then the new
prompts' groups, and stops once enough groups are finished. The step trains on the first ``prompts_per_batch``
finished groups, oldest first; the others are carried. Every token keeps the log-prob it was sampled with and the
policy version that sampled it, so the train step's importance correction applies token by token; a row whose oldest
token is more than ``rollout.max_staleness`` versions older than the sampler's weights (finished or not) starts
again from its prompt, so no token trained on is older than that bound. The carried groups are part of the
checkpoint (tokens, log-probs, versions and prompts), so a resumed run continues them exactly as the uninterrupted
run does.
"""

from __future__ import annotations

import dataclasses
import logging

from jrl.data.pipeline import PromptBatch
from jrl.rollout.base import RolloutBatch, SamplingParams
from jrl.rollout.paged import RowGroup, rollout_of, row_arrays, slot_occupancy

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _Row:
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False


@dataclasses.dataclass
class _Group:
    """A prompt (a one-prompt :class:`PromptBatch`) and its rows so far."""

    prompt: PromptBatch
    rows: list[_Row]

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.rows)


@dataclasses.dataclass
class PartialRollout:
    """A step's finished groups: their rollout, their prompts (which may be earlier steps') and what the carry
    looked like (``metrics``)."""

    rollout: RolloutBatch
    prompt_batch: PromptBatch
    metrics: dict[str, float]

    @property
    def policy_version(self) -> int:
        """The version of the weights this step's generation ran with (older tokens carry their own)."""
        return self.rollout.policy_version


class PartialRollouts:
    """The groups carried between steps and the generation that finishes them (module docstring)."""

    def __init__(self, *, num_generations: int, groups_per_step: int, max_staleness: int, pad_id: int,
                 prompt_bucket: int = 32):
        self.g, self.per_step, self.max_staleness = num_generations, groups_per_step, max_staleness
        self.pad_id, self.prompt_bucket = pad_id, prompt_bucket
        self.carry: list[_Group] = []
        self._warned = False  # about restarted rows, once

    def generate(self, engine, prompt_batch: PromptBatch, params: SamplingParams, *, seed: int) -> PartialRollout:
        version = int(engine.version)
        groups = self.carry + [_Group(prompt_batch.rows(slice(i, i + 1)), [_Row() for _ in range(self.g)])
                               for i in range(len(prompt_batch))]
        restarted = 0
        for group in groups:
            for k, row in enumerate(group.rows):
                if row.versions and version - min(row.versions) > self.max_staleness:
                    group.rows[k], restarted = _Row(), restarted + 1
        if restarted and not self._warned:
            self._warned = True
            logger.warning("partial rollouts: %d carried rows started again, their first tokens being more than "
                           "rollout.max_staleness=%d versions old; a row that needs more than max_staleness + 1 steps' "
                           "generations never finishes, so the trained completions lean short. Raise "
                           "rollout.max_staleness (e.g. 4) for completions longer than a step's generation "
                           "(partial/restarted_rows counts them)", restarted, self.max_staleness)
        carried_tokens = sum(len(r.tokens) for g in groups for r in g.rows)
        ready = sum(g.finished for g in groups)
        decoded = {}
        if ready < self.per_step:
            decoded = self._decode(engine, groups, params, seed=seed, version=version, needed=self.per_step - ready)
        done = [g for g in groups if g.finished][:self.per_step]
        trained = {id(g) for g in done}
        self.carry = [g for g in groups if id(g) not in trained]
        rows = [r for g in done for r in g.rows]
        oldest = min(v for r in rows for v in r.versions)
        metrics = {"partial/carried_groups": float(len(self.carry)),
                   "partial/carried_rows_running": float(sum(not r.finished for g in self.carry for r in g.rows)),
                   "partial/tokens_from_earlier_steps": float(carried_tokens),
                   "partial/restarted_rows": float(restarted), "partial/oldest_token_lag": float(version - oldest),
                   **decoded}
        return PartialRollout(self._rollout(done, params, version), PromptBatch.join([g.prompt for g in done]),
                              metrics)

    def _decode(self, engine, groups: list[_Group], params: SamplingParams, *, seed: int, version: int,
                needed: int) -> dict[str, float]:
        """Decode the unfinished rows of the unfinished groups until ``needed`` of those groups are finished; returns
        where the generation's time went (the carried rows' prefill, the decode rounds, the slots' occupancy)."""
        open_groups = [g for g in groups if not g.finished]
        row_groups, where = [], []
        for g in open_groups:
            running = [k for k, r in enumerate(g.rows) if not r.finished]
            keys = list(range(len(where), len(where) + len(running)))
            row_groups.append(RowGroup(g.prompt.prompt_ids[0], [g.rows[k].tokens for k in running], keys))
            where += [(g, k) for k in running]
        # As many slots as a step can have rows (one batch carried beside one new): the same program every step.
        out = engine.paged_groups(row_groups, params, seed=seed, groups_needed=needed,
                                  slots=2 * self.per_step * self.g)
        for i, (g, k) in enumerate(where):
            row, n = g.rows[k], int(out["mask"][i].sum())
            row.tokens += out["tokens"][i, :n].tolist()
            row.logprobs += out["logprobs"][i, :n].tolist()
            row.versions += [version] * n
            row.finished = bool(out["finished"][i])
        return {"time/rollout_prefill": float(out["prefill_s"]), "time/rollout_decode": float(out["decode_s"]),
                "partial/decode_steps": float(out["decode_steps"]),
                "partial/slot_occupancy": slot_occupancy(out)}

    def _rollout(self, groups: list[_Group], params: SamplingParams, version: int) -> RolloutBatch:
        rows = [r for g in groups for r in g.rows]
        arrays = row_arrays([r.tokens for r in rows], [r.logprobs for r in rows], params, self.pad_id)
        return rollout_of(arrays, [g.prompt.prompt_ids[0] for g in groups for _ in g.rows], pad_id=self.pad_id,
                          prompt_bucket=self.prompt_bucket, version=version)

    def state(self) -> list[dict]:
        """The carried groups, JSON-safe (a checkpoint keeps them)."""
        return [{"prompt": dataclasses.asdict(g.prompt), "rows": [dataclasses.asdict(r) for r in g.rows]}
                for g in self.carry]

    def load_state(self, state: list[dict]) -> None:
        self.carry = [_Group(PromptBatch(**d["prompt"]), [_Row(**r) for r in d["rows"]]) for d in state]
