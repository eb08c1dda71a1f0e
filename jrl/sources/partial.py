"""Partial rollouts (``rollout.partial``): a step's generation ends once it has ``data.prompts_per_batch`` finished
groups, and the rows still running go on in the next step's generation instead of holding the step up.

The first step takes two prompt batches from the loader, every later step one, and each trains on one batch's worth
of groups: so one batch's worth of groups is always carried, and a step's generation runs those and its new prompts'
until enough are finished. Each step hands the paged sampler
(:meth:`jrl.rollout.jax_engine.JaxRolloutEngine.paged_groups`) the groups carried from earlier steps first (only
their unfinished rows decode, each after the tokens it has), then the new prompts' groups, and stops once enough
groups are finished. A carried row continues from the keys and values its earlier generations computed, kept on the
device between generations (``rollout.partial_kv = "keep"``: no prefill; its group decodes on that device again, in
whichever process holds it), or from its prompt and tokens prefilled
again under the newest weights (``recompute``; also in the first generation after a checkpoint step, and after a
resume). The step trains on the first ``prompts_per_batch``
finished groups, oldest first; the others are carried. Every token keeps the log-prob it was sampled with and the
policy version that sampled it, so the train step's importance correction applies token by token; a row whose oldest
token is more than ``rollout.max_staleness`` versions older than the step that will train it (finished or not)
starts again from its prompt, so no token trained on is older than that bound, whether the generation runs with the
trainer (the sampler then holds that step's version) or ahead of it (``rollout.prefetch_depth``: the sampler's
version lags by the run-ahead, so rows survive a carry only while ``max_staleness`` exceeds it).

Generation ahead of the trainer: a step's generation continues the carry the previous one left, so generations run
one after another in the producer thread whatever the trainer does; each :class:`PartialRollout` carries the groups
its generation left (:attr:`PartialRollout.carried`, shared rows, never mutated), and a checkpoint keeps those of the
last step the trainer *consumed* (:meth:`PartialRollouts.consumed`), not the producer's newer ones — so a resumed
run continues them exactly as the uninterrupted run does (tokens, log-probs, versions and prompts are saved).
"""

from __future__ import annotations

import dataclasses
import logging

from jrl.data.pipeline import PromptBatch
from jrl.rollout.base import RolloutBatch, SamplingParams
from jrl.rollout.paged import KeptRow, RowGroup, rollout_of, row_arrays, slot_occupancy
from jrl.sources.prefetch import is_checkpoint_step

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Row:
    """A completion so far (never changed: a generation that continues it makes a new one, so the carry a step
    left stays as it was while the producer runs later steps)."""

    tokens: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    versions: tuple[int, ...] = ()
    finished: bool = False
    kv: KeptRow | None = dataclasses.field(default=None, compare=False, repr=False)
    """Its prompt's and tokens' keys and values as the generation that sampled its last token left them (none
    where they are to be prefilled again, and in a process other than the one holding them)."""
    home: int | None = dataclasses.field(default=None, compare=False)
    """The sampler device (its position in the mesh) holding ``kv``, known to every process (None: nothing kept)."""

    def state(self) -> dict:
        """What a checkpoint keeps of it (JSON-safe; not ``kv``)."""
        return {"tokens": list(self.tokens), "logprobs": list(self.logprobs), "versions": list(self.versions),
                "finished": self.finished}

    @classmethod
    def of_state(cls, state: dict) -> _Row:
        """The row a checkpoint kept (:meth:`state`), without keys and values."""
        return cls(tuple(state["tokens"]), tuple(state["logprobs"]), tuple(state["versions"]), state["finished"])


@dataclasses.dataclass(frozen=True)
class _Group:
    """A prompt (a one-prompt :class:`PromptBatch`) and its rows so far."""

    prompt: PromptBatch
    rows: tuple[_Row, ...]

    @property
    def finished(self) -> bool:
        return all(r.finished for r in self.rows)

    def without_kv(self) -> _Group:
        """The group with no row holding kept keys and values (so that it does not hold the device memory)."""
        return _Group(self.prompt, tuple(dataclasses.replace(r, kv=None, home=None) for r in self.rows))


@dataclasses.dataclass
class PartialRollout:
    """A step's finished groups: their rollout, their prompts (which may be earlier steps') and what the carry
    looked like (``metrics``)."""

    rollout: RolloutBatch
    prompt_batch: PromptBatch
    metrics: dict[str, float]
    carried: tuple[_Group, ...] = ()
    """The groups this step's generation left for later ones."""

    @property
    def policy_version(self) -> int:
        """The version of the weights this step's generation ran with (older tokens carry their own)."""
        return self.rollout.policy_version


class PartialRollouts:
    """The groups carried between steps and the generation that finishes them (module docstring)."""

    def __init__(self, *, num_generations: int, groups_per_step: int, max_staleness: int, pad_id: int,
                 prompt_bucket: int = 32, keep_kv: bool = False, checkpoint_every: int = 0):
        self.g, self.per_step, self.max_staleness = num_generations, groups_per_step, max_staleness
        self.keep_kv, self.checkpoint_every = keep_kv, checkpoint_every
        self.pad_id, self.prompt_bucket = pad_id, prompt_bucket
        self.carry: tuple[_Group, ...] = ()  # what the latest generation left (the producer's)
        self._consumed: tuple[_Group, ...] = ()  # what the latest step the trainer took left (a checkpoint's)
        self._warned = False  # about restarted rows, once

    def generate(self, engine, prompt_batch: PromptBatch, params: SamplingParams, *, step: int,
                 seed: int) -> PartialRollout:
        """The finished groups training step ``step`` takes: the carry's and ``prompt_batch``'s."""
        version = int(engine.version)
        groups, restarted = [], 0
        for group in self.carry + tuple(_Group(prompt_batch.rows(slice(i, i + 1)), (_Row(),) * self.g)
                                        for i in range(len(prompt_batch))):
            stale = [bool(r.versions) and step - min(r.versions) > self.max_staleness for r in group.rows]
            restarted += sum(stale)
            groups.append(_Group(group.prompt, tuple(_Row() if old else r for r, old in zip(group.rows, stale)))
                          if any(stale) else group)
        if restarted and not self._warned:
            self._warned = True
            logger.warning("partial rollouts: %d carried rows started again, their first tokens being more than "
                           "rollout.max_staleness=%d versions old; a row that needs more than max_staleness + 1 steps' "
                           "generations never finishes, so the trained completions lean short. Raise "
                           "rollout.max_staleness (e.g. 4) for completions longer than a step's generation "
                           "(partial/restarted_rows counts them)", restarted, self.max_staleness)
        carried_tokens = sum(len(r.tokens) for g in groups for r in g.rows)
        ready = sum(g.finished for g in groups)
        # After a checkpoint step the rows are prefilled again, as a run resumed from that checkpoint does.
        placed = self.keep_kv and not is_checkpoint_step(step, self.checkpoint_every)
        decoded = {}
        if ready < self.per_step:
            groups, decoded = self._decode(engine, groups, params, seed=seed, version=version,
                                           needed=self.per_step - ready, placed=placed)
        done = [g for g in groups if g.finished][:self.per_step]
        trained = {id(g) for g in done}
        self.carry = tuple(g for g in groups if id(g) not in trained)
        rows = [r for g in done for r in g.rows]
        oldest = min(v for r in rows for v in r.versions)
        metrics = {"partial/carried_groups": float(len(self.carry)),
                   "partial/carried_rows_running": float(sum(not r.finished for g in self.carry for r in g.rows)),
                   "partial/tokens_from_earlier_steps": float(carried_tokens),
                   "partial/restarted_rows": float(restarted), "partial/oldest_token_lag": float(step - oldest),
                   **decoded}
        return PartialRollout(self._rollout(done, params, version), PromptBatch.join([g.prompt for g in done]),
                              metrics, tuple(g.without_kv() for g in self.carry))

    def _decode(self, engine, groups: list[_Group], params: SamplingParams, *, seed: int, version: int,
                needed: int, placed: bool) -> tuple[list[_Group], dict[str, float]]:
        """Decode the unfinished rows of the unfinished groups until ``needed`` of those groups are finished (the
        rows' kept keys and values placed, not prefilled, where ``placed``); returns the groups after it (new rows
        where rows went on) and where the generation's time went (the carried rows' prefill, the decode rounds, the
        slots' occupancy)."""
        row_groups, where, kept_rows = [], [], 0
        for i, g in enumerate(groups):
            running = [k for k, r in enumerate(g.rows) if not r.finished]
            if running:
                keys = list(range(len(where), len(where) + len(running)))
                kept = tuple(g.rows[k].kv if placed else None for k in running)
                homes = [g.rows[k].home for k in running if placed and g.rows[k].home is not None]
                kept_rows += len(homes)
                row_groups.append(RowGroup(g.prompt.prompt_ids[0], [list(g.rows[k].tokens) for k in running], keys,
                                           kept, min(homes, default=None)))
                where += [(i, k) for k in running]
        # As many slots as a step can have rows (one batch carried beside one new): the same program every step.
        out = engine.paged_groups(row_groups, params, seed=seed, groups_needed=needed,
                                  slots=2 * self.per_step * self.g, keep=self.keep_kv)
        went_on: dict[int, list[_Row]] = {}  # group -> its rows, those that decoded replaced
        for j, (i, k) in enumerate(where):
            rows = went_on.setdefault(i, list(groups[i].rows))
            row, n = rows[k], int(out["mask"][j].sum())
            home = int(out["home"][j])
            rows[k] = _Row(row.tokens + tuple(out["tokens"][j, :n].tolist()),
                           row.logprobs + tuple(out["logprobs"][j, :n].tolist()), row.versions + (version,) * n,
                           bool(out["finished"][j]), out["kept"][j] if self.keep_kv else None,
                           home if home >= 0 else None)
        decoded = {"time/rollout_prefill": float(out["prefill_s"]), "time/rollout_decode": float(out["decode_s"]),
                   "time/rollout_keep": float(out["keep_s"]), "partial/kept_rows_placed": float(kept_rows),
                   "partial/decode_steps": float(out["decode_steps"]), "partial/slot_occupancy": slot_occupancy(out)}
        return [_Group(g.prompt, tuple(went_on[i])) if i in went_on else g for i, g in enumerate(groups)], decoded

    def _rollout(self, groups: list[_Group], params: SamplingParams, version: int) -> RolloutBatch:
        rows = [r for g in groups for r in g.rows]
        arrays = row_arrays([r.tokens for r in rows], [r.logprobs for r in rows], params, self.pad_id)
        return rollout_of(arrays, [g.prompt.prompt_ids[0] for g in groups for _ in g.rows], pad_id=self.pad_id,
                          prompt_bucket=self.prompt_bucket, version=version)

    def consumed(self, partial: PartialRollout) -> None:
        """The trainer took ``partial`` (from the trainer's thread): a checkpoint now keeps the groups it left."""
        self._consumed = partial.carried

    def state(self) -> list[dict]:
        """The groups the latest consumed step left, JSON-safe (a checkpoint keeps them; not their kept keys and
        values: a resumed run prefills them again)."""
        return [{"prompt": dataclasses.asdict(g.prompt), "rows": [r.state() for r in g.rows]}
                for g in self._consumed]

    def load_state(self, state: list[dict]) -> None:
        """Carry the groups of a checkpoint (the producer is not running)."""
        self.carry = self._consumed = tuple(
            _Group(PromptBatch(**d["prompt"]), tuple(_Row.of_state(r) for r in d["rows"])) for d in state)
