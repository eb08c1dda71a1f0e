"""The ``eval`` config section (:class:`EvalConfig`, read by :mod:`jrl.train.evaluation`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jrl.validation import check_int, invalid


DECODINGS = ("greedy", "sampled")


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """What the evaluation of ``TrainConfig.eval_every`` runs on and how (``grpo``)."""

    source: str | None = None
    """Eval prompts: a file or ``save_to_disk`` directory in ``data.source``'s formats, read with the ``data``
    section's prompt column, chat template and length limit; None = the last ``holdout`` prompts of the
    training source, which are then not trained on."""
    holdout: int = 64
    """Prompts held out of the training source as the eval set when ``source`` is None."""
    decodings: tuple[Literal["greedy", "sampled"], ...] = ("greedy",)
    """``greedy`` (the most likely token at every step) and/or ``sampled`` (the ``rollout`` section's
    temperature, top-p and top-k); one completion per prompt each, metrics ``eval/<decoding>/...``."""
    batch_size: int = 64
    """Prompts per generate call."""
    num_samples: int = 8
    """Completions per decoding written to ``eval_samples.jsonl`` and TensorBoard text at every eval (prompt,
    completion, rewards); 0 = none."""

    def __post_init__(self):
        check_int(self, "holdout", lo=1)
        check_int(self, "batch_size", lo=1)
        check_int(self, "num_samples", lo=0)
        if not self.decodings or any(d not in DECODINGS for d in self.decodings) or len(set(self.decodings)) < len(
                self.decodings):
            raise invalid("EvalConfig", "decodings", self.decodings, f"give one or both of {DECODINGS}, each once")
        if self.source is not None and (not isinstance(self.source, str) or not self.source.strip()):
            raise invalid("EvalConfig", "source", self.source, "give a path to a prompt file or directory, or None")
