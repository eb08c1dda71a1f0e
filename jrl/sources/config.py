"""The ``replay`` and ``reroll`` config sections (:mod:`jrl.sources.replay`, :mod:`jrl.sources.reroll`)."""

from __future__ import annotations

import dataclasses

from jrl.validation import check_int, check_real


@dataclasses.dataclass(frozen=True)
class ReplayConfig:
    """Replay of earlier groups with signal in place of a step's groups without (module docstring); ``grpo`` only."""

    buffer_size: int = 0
    """Groups with a learning signal kept for replay; 0 = off (the reference's default)."""
    max_age: int = 16
    """Steps after which a kept group is dropped (its completions come from a policy this many versions old, and
    the sampler-IS correction truncates the ratio of such old tokens)."""

    def __post_init__(self):
        check_int(self, "buffer_size", lo=0, fix="use an int >= 0 (0 = no replay)")
        check_int(self, "max_age", lo=1)


@dataclasses.dataclass(frozen=True)
class RerollConfig:
    """Deferred re-roll of all-fail prompts (module docstring); ``grpo`` only."""

    start_fraction: float = 1.0
    """Re-roll from step ``max(1, ⌊max_steps · start_fraction⌋)`` on; 1.0 = never (the reference's default)."""
    max_groups: int = 1
    """Most buffered prompts one batch takes (each replaces one of its last prompts)."""
    max_rerolls: int | None = None
    """Times one prompt is sampled again after failing: a re-roll that fails again is buffered again only while
    the prompt has had fewer re-rolls than this; None = no limit (the reference)."""

    def __post_init__(self):
        check_real(self, "start_fraction", ge=0, le=1, fix="use a fraction of max_steps in [0, 1] (1.0 = off)")
        check_int(self, "max_groups", lo=1)
        if self.max_rerolls is not None:
            check_int(self, "max_rerolls", lo=1)
