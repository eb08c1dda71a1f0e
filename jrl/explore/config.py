"""The ``explore`` section of a :class:`~jrl.train.TrainConfig`: how a trainer (``mode='train'``) and its explorer
processes (``mode='explore'``, ``jrl explore``) find each other — the experience queue they share, the directory the
trainer publishes its weights to — and the explorer's name and pace (:mod:`jrl.train.exploration`)."""

from __future__ import annotations

import dataclasses
import os
import socket
from pathlib import Path

from jrl.validation import check_int, check_real, invalid

#: The default experience queue (a file in the run's output directory) and weights directory, under output_dir.
DEFAULT_QUEUE_FILE = "experience.db"
DEFAULT_WEIGHTS_DIR = "published"


@dataclasses.dataclass(frozen=True)
class ExploreConfig:
    """Shared by the trainer and its explorers (pass them the same config file); read only with ``mode`` set to
    ``train`` or ``explore``."""

    queue: str = ""
    """Experience queue URL: ``sqlite:///path/queue.db`` (processes on one machine) or
    ``postgresql://user@host:5432/db`` (several machines); ``?table=NAME`` picks a table. Empty:
    ``sqlite:///<output_dir>/experience.db``."""
    weights_dir: str = ""
    """Where the trainer publishes versioned weights and explorers read them (on several machines, a directory
    they all see, e.g. NFS). Empty: ``<output_dir>/published``."""
    name: str = ""
    """This explorer's name, in the queue and in ``<output_dir>/explorers/<name>/metrics.jsonl``; it also seeds
    the explorer's prompt order and sampling. Empty: ``<hostname>-<pid>``."""
    max_queued: int | None = None
    """An explorer waits while the queue holds this many groups nobody has trained on yet (so explorers do not run
    far ahead of the trainer and produce groups that go stale). None: ``data.prompts_per_batch`` (one step's worth:
    on the default run two explorers then lose no group to ``rollout.max_staleness`` 2; twice that lost a fifth)."""
    timeout_s: float = 600.0
    """Seconds the trainer waits for a step's groups, and an explorer for the trainer's first weights (or, while the
    queue is full, for a new version), before stopping with an error that says what was missing."""
    max_batches: int | None = None
    """Prompt batches this explorer writes before it exits (e.g. a budget on a spot machine); None: until the trainer
    finishes or the explorer is stopped."""
    keep_versions: int = 3
    """Published weight versions kept on disk (an explorer reading one that was just deleted takes the newest)."""

    def __post_init__(self):
        if self.name and not all(c.isalnum() or c in "-_." for c in self.name):
            raise invalid("ExploreConfig", "name", self.name, "use letters, digits, '-', '_' or '.' (it names a "
                          "directory)")
        check_int(self, "max_queued", lo=1, optional=True, fix="use an int >= 1, or None for prompts_per_batch")
        check_real(self, "timeout_s", gt=0, fix="use a number of seconds > 0")
        check_int(self, "max_batches", lo=1, optional=True, fix="use an int >= 1, or None for no limit")
        check_int(self, "keep_versions", lo=1)

    def queue_url(self, output_dir: str | Path) -> str:
        return self.queue or f"sqlite:///{Path(output_dir).absolute() / DEFAULT_QUEUE_FILE}"

    def weights_path(self, output_dir: str | Path) -> Path:
        return Path(self.weights_dir) if self.weights_dir else Path(output_dir) / DEFAULT_WEIGHTS_DIR

    def explorer_name(self) -> str:
        return self.name or f"{socket.gethostname()}-{os.getpid()}"

    def queue_limit(self, prompts_per_batch: int) -> int:
        return self.max_queued or prompts_per_batch
