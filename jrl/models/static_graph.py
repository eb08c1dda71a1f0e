"""A model split for jitted functions called many times a second: its structure a static argument that costs nothing
to pass, its weights a flat list of arrays.

``jax.jit`` hashes its static arguments on every call and compares them with those its cached programs were traced
with. An NNX ``GraphDef`` hashes by walking the whole graph (over a millisecond for a 16-layer model on a 2-core
CPU) and compares equal to the graphdef of another split of the same model only by walking both; an ``nnx.State``
is flattened in Python, a function call per variable. A program called every few milliseconds (the paged sampler's
decode rounds) paid all three on every call, with the accelerator idle meanwhile where the host waits for the
previous call's results. :func:`split_static` hashes the structure once and gives equal structures one
:class:`StaticGraph`, so the cache's comparison is an identity test, and passes the weights as a list of arrays.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx


class StaticGraph:
    """A model's graphdef and the tree structure of its state, hashed once (made by :func:`split_static`, which
    shares one object per equal structure)."""

    __slots__ = ("graphdef", "treedef", "_hash")

    def __init__(self, graphdef, treedef):
        self.graphdef, self.treedef = graphdef, treedef
        self._hash = hash((graphdef, treedef))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, StaticGraph) and self._hash == other._hash
                                 and (self.graphdef, self.treedef) == (other.graphdef, other.treedef))

    def merge(self, weights: list):
        """The model of this structure with ``weights`` (:func:`split_static`'s list)."""
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, weights))


@functools.lru_cache(maxsize=64)
def _interned(graphdef, treedef) -> StaticGraph:
    return StaticGraph(graphdef, treedef)


def split_static(model) -> tuple[StaticGraph, list]:
    """``model`` as (its structure, the same object for every equal one of the last 64 split; its weights as a list of
    arrays)."""
    graphdef, state = nnx.split(model)
    weights, treedef = jax.tree.flatten(state)
    return _interned(graphdef, treedef), weights
