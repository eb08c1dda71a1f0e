"""Router statistics of MoE forward passes, gathered while a function is traced: the load-balance metric, the
router z-loss, the load-balancing auxiliary loss and the share of routed rows an expert-parallel capacity dropped.

Inside ``with collecting() as stats:`` every MoE block that runs adds a :class:`RouterStats` of its tokens to
``stats`` (outside one, blocks record nothing and cost nothing extra). A layer run under ``jax.checkpoint`` or
``jax.lax.scan`` is traced in a scope of its own, so the layer step opens its own collector and returns what it
gathered as outputs, which the caller records again (:mod:`jrl.models.transformer`): every value lives in the
trace of the function that opened the outer collector. Statistics count the real tokens (the attention mask's
non-padding positions); with an explicit attention mask every position counts.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

import jax
import jax.numpy as jnp

_ACTIVE: contextvars.ContextVar[list | None] = contextvars.ContextVar("jrl_router_stats", default=None)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RouterStats:
    """One MoE block's routing (leading axes: blocks or layers stacked together), float32."""

    load: jax.Array
    """[..., E] share of the block's top-k assignments that went to each expert (sums to 1)."""
    prob: jax.Array
    """[..., E] mean router probability (softmax of the logits) of each expert over the tokens."""
    z: jax.Array
    """[...] mean over the tokens of ``logsumexp(router logits)²`` (the router z-loss)."""
    dropped: jax.Array
    """[...] share of the block's routed (token, expert) rows that an expert-parallel capacity dropped (0 without
    one; padding counts as any token)."""

    @staticmethod
    def of(router_logits: jax.Array, expert_ids: jax.Array, token_mask: jax.Array | None = None,
           dropped: jax.Array | None = None) -> RouterStats:
        """From router logits [T, E] and the chosen experts [T, K] of T tokens, counting only those of
        ``token_mask`` [T] (True = a real token; None = all); ``dropped``: the share of rows a capacity dropped."""
        logits = router_logits.astype(jnp.float32)
        t, e = logits.shape
        w = jnp.ones((t,), jnp.float32) if token_mask is None else token_mask.astype(jnp.float32)
        count = jnp.maximum(jnp.sum(w), 1.0)
        k = expert_ids.shape[-1]
        load = jnp.zeros((e,), jnp.float32).at[expert_ids.reshape(-1)].add(jnp.repeat(w, k)) / (k * count)
        return RouterStats(load=load, prob=jnp.sum(w[:, None] * jax.nn.softmax(logits, axis=-1), axis=0) / count,
                           z=jnp.sum(w * jax.nn.logsumexp(logits, axis=-1) ** 2) / count,
                           dropped=jnp.zeros((), jnp.float32) if dropped is None else dropped.astype(jnp.float32))

    @property
    def max_over_mean(self) -> jax.Array:
        """[...] the busiest expert's load over the mean load (1 = perfectly balanced, E = one expert takes all)."""
        return self.load.shape[-1] * jnp.max(self.load, axis=-1)

    @property
    def aux_loss(self) -> jax.Array:
        """[...] the load-balancing loss ``E · Σ_e load_e · prob_e`` (Switch Transformer's; 1 when balanced and
        uniform); its gradient reaches the router through ``prob``."""
        return self.load.shape[-1] * jnp.sum(jax.lax.stop_gradient(self.load) * self.prob, axis=-1)


@contextlib.contextmanager
def collecting():
    """Gather the :class:`RouterStats` of the MoE blocks that run inside the ``with`` block into the yielded list."""
    stats: list[RouterStats] = []
    token = _ACTIVE.set(stats)
    try:
        yield stats
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    """Whether a collector is open (MoE blocks then record their statistics)."""
    return _ACTIVE.get() is not None


def record(stats: RouterStats) -> None:
    """Add ``stats`` to the open collector (nothing when none is open)."""
    collected = _ACTIVE.get()
    if collected is not None:
        collected.append(stats)


def stack(stats: list[RouterStats]) -> RouterStats | None:
    """The statistics of several blocks as one, stacked on a new leading axis (None for none)."""
    if not stats:
        return None
    return jax.tree.map(lambda *xs: jnp.stack(xs), *stats)


def summary(stats: list[RouterStats]) -> dict[str, jax.Array]:
    """Means over every block recorded: ``moe/expert_load_max_over_mean``, ``moe/router_z_loss``, ``moe/aux_loss``
    and ``moe/dropped_rows``."""
    all_blocks = RouterStats(load=jnp.concatenate([s.load.reshape(-1, s.load.shape[-1]) for s in stats]),
                             prob=jnp.concatenate([s.prob.reshape(-1, s.prob.shape[-1]) for s in stats]),
                             z=jnp.concatenate([s.z.reshape(-1) for s in stats]),
                             dropped=jnp.concatenate([s.dropped.reshape(-1) for s in stats]))
    return {"moe/expert_load_max_over_mean": jnp.mean(all_blocks.max_over_mean),
            "moe/router_z_loss": jnp.mean(all_blocks.z), "moe/aux_loss": jnp.mean(all_blocks.aux_loss),
            "moe/dropped_rows": jnp.mean(all_blocks.dropped)}
