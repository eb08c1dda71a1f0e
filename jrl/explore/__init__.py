"""The durable parts of the explorer/trainer split: the experience queue explorers write scored groups to
(:mod:`jrl.explore.queue`, SQLite or PostgreSQL), the versioned weights the trainer publishes for them
(:mod:`jrl.explore.publication`) and the ``explore`` config section (:mod:`jrl.explore.config`). The two loops that
use them, an explorer and a trainer fed by the queue, are in :mod:`jrl.train.exploration` (they compose the
trainer's parts); docs/exploration.md has the protocol."""
