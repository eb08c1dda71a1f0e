"""The ``wandb`` config section (:class:`WandbConfig`, read by :mod:`jrl.train.observability`)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jrl.validation import check_choice, invalid


@dataclasses.dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases logging beside ``metrics.jsonl`` and TensorBoard (needs the ``wandb`` package)."""

    project: str | None = None
    """W&B project to log the run to; None = no W&B logging."""
    mode: Literal["offline", "online"] = "offline"
    """``offline`` writes the W&B run under ``<output_dir>/wandb`` without any network (``wandb sync`` uploads it
    later); ``online`` streams it to the W&B server."""
    entity: str | None = None
    """W&B entity (user or team); None = the logged-in account's default."""
    name: str | None = None
    """Run name; None = the name of ``output_dir``."""

    def __post_init__(self):
        check_choice(self, "mode", ("offline", "online"))
        if self.project is None and (self.mode, self.entity, self.name) != ("offline", None, None):
            raise invalid("WandbConfig", "project", None, "the W&B settings take effect only with a project: set "
                          "--wandb.project NAME, or leave mode, entity and name at their defaults")
