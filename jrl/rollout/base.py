"""The contract every rollout backend (embedded JAX sampler, external vLLM server) implements."""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import numpy as np

from jrl.registry import Registry


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How completions are sampled."""

    max_new_tokens: int = 32
    """Most tokens generated per completion (a completion that reaches it without a stop token is
    marked truncated)."""
    temperature: float = 1.0
    """Softmax temperature; the reported sampling logprobs are taken at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability mass reaches ``top_p``."""
    top_k: int = 0
    """Keep only the ``top_k`` most likely tokens (0 = no limit)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion (included in the completion and its mask)."""

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens} must be >= 1")
        if not self.temperature > 0:
            raise ValueError(
                f"SamplingParams.temperature={self.temperature} must be > 0 (use a small value such as 1e-4 "
                "for near-greedy sampling)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k} must be >= 0 (0 disables top-k)")


@dataclasses.dataclass
class RolloutBatch:
    """Completions for ``P`` prompts x ``G`` generations, grouped per prompt (rows ``p*G .. p*G+G-1``).

    All arrays are host NumPy arrays with ``N = P * G`` rows.
    """

    prompt_ids: np.ndarray
    """[N, Lp] int32, left-padded prompt token ids."""
    prompt_mask: np.ndarray
    """[N, Lp] int32, 1 for prompt tokens, 0 for padding."""
    completion_ids: np.ndarray
    """[N, Lc] int32, right-padded completion token ids (padding holds a valid id, e.g. pad)."""
    completion_mask: np.ndarray
    """[N, Lc] int32, 1 up to and including the stop token, 0 after."""
    sampling_logprobs: np.ndarray
    """[N, Lc] float32 logprob of each sampled token under the sampler at the sampling temperature
    (NaN where the backend did not report one)."""
    truncated: np.ndarray
    """[N] bool, True where the completion hit ``max_new_tokens`` without a stop token."""
    policy_version: int = 0
    """Version of the weights that generated the batch (for staleness and IS bookkeeping)."""
    loss_mask: np.ndarray | None = None
    """[N, Lc] int32, 1 on the tokens the model wrote (the loss's tokens), 0 on the others; None: the
    ``completion_mask``. Multi-turn episodes (:mod:`jrl.envs`) put the environment's tokens in the completion as
    context, with ``completion_mask`` 1 and ``loss_mask`` 0."""

    def prompt_lists(self) -> list[list[int]]:
        """Each row's prompt tokens without the padding."""
        return [np.asarray(ids)[np.asarray(m) > 0].tolist() for ids, m in zip(self.prompt_ids, self.prompt_mask)]


@runtime_checkable
class RolloutEngine(Protocol):
    """A source of completions with sampling logprobs for the current policy.

    Threads: with prefetching (``rollout.prefetch_depth > 0``) the trainer calls :meth:`generate` from a
    producer thread while its own thread trains and calls :meth:`sync_weights`. The trainer never syncs
    while a batch that needs the previous weights is still to be generated, but an engine must still
    be safe for the two calls overlapping: a ``generate`` call samples from the weights of one sync
    (the latest when it starts) and tags the batch with that sync's ``version``. An engine that runs
    programs on the trainer's own devices, from the arrays it was synced with, sets the attribute
    ``shares_trainer_devices = True`` (False: a remote server, or a sampler on a mesh of its own, which copy what
    they keep); on a multi-device mesh the trainer then never runs its update while it generates, and it syncs such
    an engine a copy of the weights when it may generate after the next update.

    ``capabilities`` names what an engine can do beyond these methods, for the algorithms that need it
    (``Algorithm.engine_needs``): ``blocks``, block-parallel sampling for strided EBFT (``generate_blocks``);
    ``sessions``, conversations continued on their KV cache (``start_session`` / ``continue_session``, used by
    multi-turn episodes, :mod:`jrl.envs.episodes`). The registered factory carries the same set, so a config is
    checked before any engine is built.
    """

    shares_trainer_devices: bool
    capabilities: frozenset[str]

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, *, num_generations: int,
                 seed: int) -> RolloutBatch:
        """Sample ``num_generations`` completions for each prompt (unpadded token-id lists); the batch's
        ``policy_version`` is the ``version`` of the weights it was sampled from."""
        ...

    def sync_weights(self, model, version: int) -> None:
        """Make the engine sample from ``model``'s current weights, tagged ``version``. The engine may
        keep references to ``model``'s arrays; the caller keeps them unchanged until the next sync for
        as long as a ``generate`` call may run on them (it passes a copy when it trains meanwhile)."""
        ...

    def close(self) -> None:
        """Release what the engine started or holds (connections, servers it launched)."""
        ...


#: ``rollout.backend`` name → engine factory ``(model, *, pad_id, mesh, rules, rollout, output_dir) ->
#: RolloutEngine`` (``rollout``: the run's :class:`~jrl.rollout.config.RolloutConfig`; ``output_dir``: where
#: the engine may write weight syncs). A factory carries ``ignores`` (the ``TrainConfig`` fields its engine does not
#: read, refused when set) and ``capabilities`` (its engine's). ``jax`` registers in :mod:`jrl.rollout.jax_engine`,
#: ``vllm`` in :mod:`jrl.rollout.vllm_engine`; importing :mod:`jrl.rollout` registers both.
ROLLOUT_ENGINES = Registry("rollout engine", "rollout.backend", how_to_register="@ROLLOUT_ENGINES.register(name)")


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of ``step`` of something seeded with ``seed`` (a trainer's step, a chunk of a batch, an
    episode's turn): a pure function of both."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


def check_generate_args(prompt_ids: list[list[int]], num_generations: int) -> None:
    """The errors every :meth:`RolloutEngine.generate` gives for no prompts, an empty prompt or
    ``num_generations < 1``."""
    if num_generations < 1:
        raise ValueError(f"generate: num_generations={num_generations} must be >= 1")
    if not prompt_ids:
        raise ValueError("generate: prompt_ids is empty; pass at least one prompt")
    empty = [i for i, ids in enumerate(prompt_ids) if len(ids) == 0]
    if empty:
        raise ValueError(f"generate: prompts {empty[:10]} are empty; every prompt needs at least one token")


def pad_columns(x, width: int, value, *, left: bool = False) -> np.ndarray:
    """``x`` [N, T] padded with ``value`` to ``width`` columns (on the left with ``left``)."""
    x = np.asarray(x)
    extra = width - x.shape[1]
    if extra < 0:
        raise ValueError(f"rows of {x.shape[1]} columns do not fit in {width}")
    return np.pad(x, ((0, 0), (extra, 0) if left else (0, extra)), constant_values=value)


def concat_rollouts(parts: list[RolloutBatch], pad_id: int, *, policy_version: int | None = None) -> RolloutBatch:
    """One batch of the rows of ``parts`` (in order): prompts left-padded to the longest, completions right-padded
    (``pad_id``, mask 0, NaN log-probs) to the longest. The parts must share one policy version, unless
    ``policy_version`` tags the joined batch (e.g. the oldest of them)."""
    versions = {p.policy_version for p in parts} if policy_version is None else {policy_version}
    if len(versions) != 1:
        raise ValueError(f"cannot join rollout batches of different policy versions {sorted(versions)}")
    lp = max(p.prompt_ids.shape[1] for p in parts)
    t = max(p.completion_ids.shape[1] for p in parts)
    return RolloutBatch(
        prompt_ids=np.concatenate([pad_columns(p.prompt_ids, lp, pad_id, left=True) for p in parts]),
        prompt_mask=np.concatenate([pad_columns(p.prompt_mask, lp, 0, left=True) for p in parts]),
        completion_ids=np.concatenate([pad_columns(p.completion_ids, t, pad_id) for p in parts]),
        completion_mask=np.concatenate([pad_columns(p.completion_mask, t, 0) for p in parts]),
        sampling_logprobs=np.concatenate([pad_columns(np.asarray(p.sampling_logprobs, np.float32), t, np.nan)
                                          for p in parts]),
        truncated=np.concatenate([np.asarray(p.truncated, bool) for p in parts]),
        policy_version=versions.pop(),
        loss_mask=None if all(p.loss_mask is None for p in parts) else np.concatenate(
            [pad_columns(p.completion_mask if p.loss_mask is None else p.loss_mask, t, 0) for p in parts]))
