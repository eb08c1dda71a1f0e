"""The algorithm protocol and its registry.

An algorithm is everything a training method adds to the generic loop (:class:`~jrl.train.trainer.Trainer`):
how a prompt batch is sampled (its sampling parameters, one temperature in one place: the ``rollout``
section), how a rollout becomes an *experience* (a typed pytree of host arrays: tokens, masks, rewards,
advantages, log-probs, whatever the method adds) and which loss terms the learner descends on it. The
loop owns the data, the rollout source, the weight syncs, checkpoints and logs; the learner owns the
parameters and the optimizer. An algorithm is built as ``cls(cfg, policy, learner)`` and registered by
name in :data:`ALGORITHMS` (``TrainConfig.algorithm``).

An algorithm owns its knobs: ``config_type`` is the type of the ``algo`` section it reads (``--algorithm`` picks
the algorithm and with it that section's type and flags; None for an algorithm without one), ``sections`` names the
shared algorithm sections it reads besides (:data:`~jrl.train.config.ALGORITHM_SECTIONS`: EBFT's feature network),
and ``check_config(cfg)`` checks its section against the rest of the run. ``ignores`` lists the other config fields
(dotted paths from :class:`~jrl.train.TrainConfig`, a whole section or one field) that the algorithm does not
read; :class:`~jrl.train.TrainConfig` rejects a non-default value in those and in the algorithm sections it does
not read, so no flag is silently without effect. An algorithm that reads ``eval_every`` / ``eval`` (the others list
them in ``ignores``) also has ``evaluator(eval_cfg, prompts, *, output_dir, seed)`` returning a
:class:`~jrl.train.evaluation.Evaluator`. Optional too: ``state(step) -> dict`` and ``load_state(dict)`` (what the
algorithm carries across steps, JSON-safe, saved in the checkpoint at ``step``) and ``rerolled_prompts(k) ->
list[int]`` (dataset indices of prompts rollout batch ``k`` samples in place of its last ones), and the class
attribute ``explorer``: a class ``(cfg, policy)`` with ``generate(engine, prompt_batch, *, seed)``,
``score(rollout, prompt_batch, step)`` and ``close()``, which is what an explorer process runs (``mode='explore'``,
:mod:`jrl.train.exploration`); an algorithm without it runs in ``mode='both'`` only; and ``plan_update(learner,
experience)`` with ``start_update(learner, experience, plan)``: the first does :meth:`update`'s host work ahead (None
where it cannot), the second launches the update's work on the devices (from the plan when there is one) and returns
a call that waits for it and returns its metrics (the loop then makes the next step's rollout, experience and plan
while the devices train, where generation runs apart from them: :meth:`~jrl.train.trainer.Trainer.train_step`). An
algorithm names the optional
parts it has in ``capabilities`` (:data:`CAPABILITIES`); the loop asks that set, never the object.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from jrl.registry import Registry


class Algorithm(Protocol):
    """What the loop asks of a training method (see the module docstring)."""

    config_type: ClassVar[type | None]
    """The type of the ``algo`` section it reads (a frozen dataclass of its own knobs), or None (``algo`` unset)."""
    sections: ClassVar[tuple[str, ...]]
    """The shared algorithm sections (names in :data:`~jrl.train.config.ALGORITHM_SECTIONS`) it reads."""
    ignores: ClassVar[tuple[str, ...]]
    """Other config fields this algorithm does not read (rejected when set)."""
    progress_desc: ClassVar[str]
    """Label of the progress bar."""
    plot_keys: ClassVar[tuple[str, ...]]
    """Metrics of the final plot (``curves.png``)."""
    summary_keys: ClassVar[tuple[str, ...]]
    """Metrics of the last step that the command line's closing line prints."""
    capabilities: ClassVar[frozenset[str]]
    """The optional parts it has (names of :data:`CAPABILITIES`)."""
    engine_needs: ClassVar[frozenset[str]]
    """What it asks of a rollout engine beyond the protocol (names of the engines' ``capabilities``)."""
    samples_field: ClassVar[str]
    """The config field (dotted path) holding the samples per prompt: a step has ``prompts_per_batch`` x that
    rows."""

    @staticmethod
    def check_config(cfg) -> None:
        """Raise a ``ValueError`` naming the field when its ``algo`` section (or a field it reads) does not fit the
        rest of ``cfg`` (a :class:`~jrl.train.TrainConfig` whose own checks passed); called at construction."""
        ...

    def generate(self, engine, prompt_batch, *, step: int, seed: int) -> Any:
        """Sample the rollout of ``prompt_batch`` that training step ``step`` consumes, from ``engine``, with the
        sampling seed ``seed`` (may run in the rollout producer thread, ahead of the trainer). The result has a
        ``policy_version`` attribute: the engine's version that generated it."""
        ...

    def make_experience(self, rollout, prompt_batch, learner, step: int) -> tuple[Any, dict[str, float]]:
        """(experience, metrics): score the rollout (rewards, advantages, reference values)."""
        ...

    def update(self, learner, experience) -> dict[str, float]:
        """Optimizer update(s) on the experience through ``learner.step``; the step's loss metrics."""
        ...

    def generated_tokens(self, rollout) -> int:
        """Tokens the rollout generated (for ``tokens_per_second``)."""
        ...

    def progress_postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        """The values the progress bar shows after a step."""
        ...

    def log_summary(self, metrics: dict[str, float]) -> str:
        """What the periodic log line says of a step besides its number and loss."""
        ...

    def close(self) -> None:
        """Release what the algorithm started (e.g. reward worker processes)."""
        ...


#: The optional parts of an algorithm, by the name it lists in ``capabilities``, and the members each one brings (none
#: for a behaviour of members every algorithm has).
CAPABILITIES: dict[str, tuple[str, ...]] = {
    "state": ("state", "load_state"),  # carries state across steps, saved in checkpoints
    "reroll": ("rerolled_prompts",),  # samples some prompts of a batch again
    "explorer": ("explorer",),  # runs in explorer processes (mode='explore') beside a queue-fed trainer
    "partial": (),  # trains on partial rollouts (rollout.partial: its generate may return earlier steps' groups)
    # plans and launches its update apart from reading its metrics: the loop prepares the next step in between
    "deferred_update": ("plan_update", "start_update"),
}

#: ``TrainConfig.algorithm`` name → algorithm class ``(cfg, policy, learner) -> Algorithm``.
ALGORITHMS = Registry("algorithm", "TrainConfig.algorithm", how_to_register="@ALGORITHMS.register(name)")
