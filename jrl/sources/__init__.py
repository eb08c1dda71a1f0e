"""Where a trainer's batches come from: the rollout source over an engine and its weight syncs
(:mod:`jrl.sources.rollout`), the producer thread that generates ahead (:mod:`jrl.sources.prefetch`), the replay
buffer of groups with signal (:mod:`jrl.sources.replay`) and the re-roll of prompts that failed
(:mod:`jrl.sources.reroll`)."""
