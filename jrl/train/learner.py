"""The learner: a model split into trainable and frozen state, its optimizer, and gradient accumulation
over the loss terms an algorithm hands it. Nothing here knows which algorithm runs.

An update is a list of :class:`LossTerm` s. Each term names a loss function (a frozen, hashable
dataclass, so it is a static argument of the jitted step), the rows it is evaluated on (a pytree of
host arrays with a leading row axis, split into micro-batches of ``OptimConfig.micro_batch_size`` rows,
the last one shorter when they do not divide)
and ``aux``, a pytree given whole to every micro-batch (the step-global normalisers that make the sum of
the micro-batch losses the step loss, so the update does not depend on the split). The gradients of
every micro-batch of every term are summed into one donated accumulator (on a mesh, each device's own sum until
the update's end where ``OptimConfig.grad_sync`` says so; the programs are :mod:`jrl.train.update_programs`), then
one optimizer update (global-norm clip + AdamW, donated params and optimizer state) applies them. A micro-batch none
of whose rows is in the term's ``keep`` mask is skipped on the host and counted.

Each program hands its loss and metrics back as one packed vector (:class:`Scalars`) and an update's metrics
(:class:`UpdateMetrics`) stay on the devices until first read: fetching ~20 scalars one by one costs the
accelerator ~1.9 ms per update on an H100, one vector ~0.6 ms.

The model is split into ``(graphdef, params, frozen)``: with LoRA the trainable params are the
:class:`~jrl.models.lora.LoRAParam` variables, else every ``nnx.Param`` but frozen ones. After an update
``model`` holds the new weights (for the rollout engine's sync and for export).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jrl.kernels import backend as kernel_backend
from jrl.models.lora import has_lora, trainable_params
from jrl.models.transformer import on_mesh
from jrl.models.scan_outputs import uninitialized_scan_outputs
from jrl.sharding import DEFAULT_RULES, HostPack, batch_sharding, on_host, opt_state_shardings, to_host
from jrl.train.grad_sync import auto_takes_update, local_axes
from jrl.train.optim_config import OptimConfig
from jrl.train.update_programs import (Flat, Scalars, Static, apply_update, copy_tree, evaluate, gathered,
                                       local_accumulator, local_micro_step, local_step_and_apply, micro_step,
                                       micro_step_and_apply, reduce_and_apply, respelled, zeros_like)


class LossTerm(NamedTuple):
    """One part of an update's loss."""

    loss: Callable
    """``loss(model, rows, aux) -> (scalar loss, {metric: scalar})``; hashable (a frozen dataclass)."""
    rows: Any
    """Pytree of host arrays with a leading row axis (``None`` leaves allowed)."""
    aux: Any = None
    """Pytree passed whole to every micro-batch (e.g. step-global normalisers)."""
    keep: np.ndarray | None = None
    """[rows] bool: a micro-batch without a kept row is skipped (None: never skip)."""


@functools.lru_cache(maxsize=32)
def make_optimizer(cfg: OptimConfig, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW with linear warmup then constant / cosine / linear decay, after global-norm clipping.

    Cached, so learners with equal settings share one transformation object and its compiled update."""
    lr, warm = cfg.learning_rate, cfg.warmup_steps
    decay_steps = max(1, total_steps - warm)
    if cfg.schedule == "constant":
        after = optax.constant_schedule(lr)
    elif cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(lr, decay_steps)
    else:
        after = optax.linear_schedule(lr, 0.0, decay_steps)
    schedule = optax.join_schedules([optax.linear_schedule(0.0, lr, warm), after], [warm]) if warm else after
    parts = [] if cfg.max_grad_norm is None else [optax.clip_by_global_norm(cfg.max_grad_norm)]
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay))
    return optax.chain(*parts), schedule


class UpdateMetrics(Mapping):
    """One optimizer update's metrics, each a list: ``loss`` and the loss's metrics per micro-batch, ``grad_norm``
    and ``learning_rate``. The device values are fetched on first read, all in one go (:func:`fetch_metrics`)."""

    def __init__(self, **host: list[float]):
        """``host``: values already on the host. ``loss`` is always a name, also when every micro-batch is skipped."""
        self.parts: list[Scalars] = []
        self._host = {"loss": [], **host}
        self._values: dict[str, list[float]] | None = None

    def add(self, part: Scalars) -> None:
        """Add one program's packed metrics; their copy to the host starts as soon as the program ends (no
        round trip to ask for it later)."""
        if isinstance(part.values, jax.Array) and part.values.is_fully_addressable:
            part.values.copy_to_host_async()
        self.parts.append(part)

    def fill(self, parts: list[Scalars]) -> None:
        """Set the values from host copies of :attr:`parts`."""
        values: dict[str, list[float]] = {}
        for part in parts:
            for row in np.atleast_2d(np.asarray(part.values)).tolist():  # [k], or [devices, k] (one row per device)
                for name, v in zip(part.names, row):
                    values.setdefault(name, []).append(v)
        for name, vs in self._host.items():
            values.setdefault(name, []).extend(float(v) for v in vs)
        self._values = values

    @property
    def values_on_host(self) -> dict[str, list[float]]:
        if self._values is None:
            fetch_metrics([self])
        return self._values

    def __getitem__(self, name: str) -> list[float]:
        return self.values_on_host[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values_on_host)

    def __len__(self) -> int:
        return len(self.values_on_host)


def fetch_metrics(updates: list[UpdateMetrics]) -> None:
    """Bring the device values of ``updates`` to the host in one ``device_get`` (one copy per program)."""
    pending = [u for u in updates if u._values is None]
    for update, parts in zip(pending, jax.device_get([u.parts for u in pending])):
        update.fill(parts)



def row_slices(n: int, size: int | None) -> list[slice]:
    """Slices of ``size`` rows covering ``n`` rows, the last one shorter when they do not divide (None: one slice)."""
    size = size or n
    return [slice(i, i + size) for i in range(0, n, size)]


def take_rows(tree, sl: slice):
    """Rows ``sl`` of every array of a pytree of arrays with a leading row axis (``None`` leaves stay)."""
    return jax.tree.map(lambda x: x[sl], tree)


def _num_rows(tree) -> int:
    return int(jax.tree.leaves(tree)[0].shape[0])


class Learner:
    """Trainable state, optimizer and the accumulate-then-apply update of a model (see the module docstring)."""

    def __init__(self, model: nnx.Module, optim: OptimConfig, *, total_updates: int, mesh=None, rules=None):
        config = getattr(model, "config", None)
        for name in ("router_aux_loss_coef", "router_z_loss_coef"):
            if getattr(optim, name) and not (config is not None and config.is_moe):
                raise ValueError(f"OptimConfig.{name}={getattr(optim, name)} has no effect: the model has no MoE "
                                 f"layers; leave it at 0")
        self.optim, self.mesh, self.rules = optim, mesh, rules
        # Gradient programs allocate the forward's saved values without zero-filling them (jrl.models.scan_outputs;
        # on a mesh only the per-device layer scans; not on a TPU, where it is unmeasured).
        self._unfilled_scans = kernel_backend() != "tpu"
        self._unfilled_per_device = mesh is not None and mesh.size > 1
        self.lora = has_lora(model)
        self._trainable = trainable_params(model)
        graphdef, params, frozen = nnx.split(model, self._trainable, ...)
        self._params, self._frozen = Flat.of(respelled(params)), Flat.of(frozen)
        self._static_graphdef = Static(graphdef)
        self._is_moe = bool(config is not None and config.is_moe)
        self._reduce_dtype = getattr(config, "grad_reduce_dtype", None)
        # Whether grad_sync="auto" takes per-device accumulation where an update can: the weights' sizes decide, and
        # they do not change.
        self._auto_local = (mesh is not None and optim.grad_sync == "auto"
                            and auto_takes_update(self._params.leaves, self._frozen.leaves))
        self.tx, self.schedule = make_optimizer(optim, total_updates)
        if mesh is None:
            self.opt_state = jax.jit(self.tx.init)(params)
        else:
            shardings = opt_state_shardings(jax.eval_shape(self.tx.init, params), params, mesh, rules)
            self.opt_state = jax.jit(self.tx.init, out_shardings=shardings)(params)
        self.num_updates = 0

    @property
    def params(self) -> nnx.State:
        """The trainable parameters (a state of the model's graph)."""
        return self._params.tree

    @params.setter
    def params(self, value: nnx.State) -> None:
        self._params = Flat.of(respelled(value))

    @property
    def _layout(self) -> Static | None:
        """The shardings of the trainable parameters on the mesh (None without one): their gradients' too."""
        if self.mesh is None:
            return None
        return Static(tuple(x.sharding for x in self._params.leaves))

    def block_until_ready(self) -> None:
        """Wait until the weights of the last update are computed (without rebuilding their pytree)."""
        jax.block_until_ready(self._params.leaves)

    @property
    def frozen(self) -> nnx.State:
        """The model's other state (the base weights of a LoRA model)."""
        return self._frozen.tree

    @property
    def opt_state(self):
        """The optimizer's state."""
        return self._opt_state.tree

    @opt_state.setter
    def opt_state(self, value) -> None:
        self._opt_state = Flat.of(respelled(value))

    @property
    def graphdef(self) -> nnx.GraphDef:
        """The model's graph definition (the structure its params and frozen state fill)."""
        return self._static_graphdef.value

    @property
    def model(self) -> nnx.Module:
        """The model with the current weights (shares the learner's arrays)."""
        return nnx.merge(self.graphdef, self.params, self.frozen)

    def snapshot(self) -> nnx.State:
        """A copy of the trainable params now (a frozen reference or feature network: the initial weights)."""
        return copy_tree(self._params).tree

    def put(self, tree):
        """Host arrays of ``tree`` for the step's programs, packed into one buffer per device (:class:`HostPack`, see
        :meth:`_place`); on a mesh the rows are split over the batch axes (every process holds the whole host array
        and places only its own devices' rows, so it works on a multi-process mesh)."""
        return self._place(tree, self._row_shardings(tree))

    def _replicated(self, tree):
        """Step-global host values (``aux``) on every device, not split over the batch axes."""
        return self._place(tree, self._everywhere(tree))

    def _put_micro_batch(self, rows, aux):
        """(rows, aux) of one micro-batch placed as :meth:`put` and :meth:`_replicated` do, in one transfer per
        device."""
        return self._place((rows, aux), (self._row_shardings(rows), self._everywhere(aux)))

    def _row_shardings(self, tree):
        if self.mesh is None:
            return None
        return jax.tree.map(lambda x: batch_sharding(self.mesh, np.ndim(x), self.rules, shape=np.shape(x)), tree)

    def _everywhere(self, tree):
        if self.mesh is None:
            return None
        return jax.tree.map(lambda x: NamedSharding(self.mesh, PartitionSpec()), tree)

    def _place(self, tree, shardings):
        """``tree``'s host arrays as one :class:`HostPack` with ``shardings`` (a matching tree; None without a mesh,
        where the pack stays on the host and the jitted step copies it to its device itself). One small copy per
        array costs the accelerator a pause each: six arrays for a GRPO step, on each device."""
        if not jax.tree.leaves(tree):
            return tree
        return HostPack.of(tree, None if self.mesh is None else shardings)

    def chunks(self, n: int) -> list[slice]:
        """Row slices of ``optim.micro_batch_size`` rows covering ``n`` rows (the last may be shorter)."""
        return row_slices(n, self.optim.micro_batch_size)

    def micro_slices(self, n: int) -> list[slice]:
        """:meth:`chunks` of a step of ``n`` rows, which must split evenly into micro-batches."""
        mb = self.optim.micro_batch_size or n
        if n % mb:
            raise ValueError(f"the step has {n} rows, not a multiple of OptimConfig.micro_batch_size={mb}")
        return self.chunks(n)

    # ---------------------------------------------------------------- no gradient
    def evaluate(self, fn: Callable, rows, aux=None, *, params=None, disable_lora: bool = False) -> np.ndarray:
        """``fn(model, rows, aux)`` (hashable, returns an array with a leading row axis) without gradient,
        micro-batch by micro-batch (the last may be shorter), concatenated on the host. ``params``: other
        trainable params (e.g. a snapshot); ``disable_lora``: the base weights of a LoRA model."""
        params = self._params if params is None else Flat.of(params)
        aux = self._replicated(aux)
        parts = [to_host(evaluate(params, self._frozen, self.put(take_rows(rows, sl)), aux,
                                   graphdef=self._static_graphdef, fn=fn, disable_lora=disable_lora))
                 for sl in self.chunks(_num_rows(rows))]
        return np.concatenate(parts, axis=0)

    # ---------------------------------------------------------------- update
    def _plan(self, terms: list[LossTerm]) -> tuple[list[tuple[int, LossTerm, slice]], int]:
        """The (term index, term, micro-batch rows) an update runs, and how many micro-batches it skips."""
        plan, skipped = [], 0
        for index, term in enumerate(terms):
            for sl in self.chunks(_num_rows(term.rows)):
                if term.keep is not None and not np.any(term.keep[sl]):
                    skipped += 1
                else:
                    plan.append((index, term, sl))
        return plan, skipped

    @property
    def _router(self) -> tuple[float, float]:
        """The static router-loss coefficients (see :func:`jrl.train.update_programs.grads_of`)."""
        return self.optim.router_aux_loss_coef, self.optim.router_z_loss_coef

    @functools.cached_property
    def _local_graphdef(self) -> Static:
        """The model without its mesh: the one-device program each device runs when it accumulates on its own."""
        model = on_mesh(nnx.merge(self.graphdef, self.params, self.frozen), None)
        return Static(nnx.split(model, self._trainable, ...)[0])

    def _accumulate(self, plan, collected: UpdateMetrics, axes: tuple[str, ...] | None = None) -> Flat:
        """The gradient of ``plan``'s micro-batches summed, their metrics into ``collected``: reduced over the devices
        every micro-batch into an accumulator laid out as the parameters, or with batch ``axes`` each device's own
        sum, the whole weights on every device (:func:`jrl.train.update_programs.local_micro_step`): an accumulator
        with a leading device axis."""
        if axes is None:
            program, static = micro_step, dict(graphdef=self._static_graphdef, layout=self._layout)
            params, frozen = self._params, self._frozen
            acc = zeros_like(self._params, layout=self._layout)
        else:
            program, static = local_micro_step, dict(graphdef=self._local_graphdef, mesh=self.mesh, axes=axes)
            params, frozen = gathered(self._params, mesh=self.mesh), gathered(self._frozen, mesh=self.mesh)
            acc = local_accumulator(self._params, mesh=self.mesh, axes=axes)
        count = np.int32(len(plan))  # on the devices once, not with every micro-batch
        micro_batches = jax.device_put(count, self._everywhere(count))
        placed_aux: dict[int, Any] = {}  # each term's aux goes to the devices once
        for index, term, sl in plan:
            if index not in placed_aux:
                placed_aux[index] = self._replicated(term.aux)
            with uninitialized_scan_outputs(self._unfilled_scans, per_device_only=self._unfilled_per_device):
                acc, part = program(acc, params, frozen, self.put(take_rows(term.rows, sl)), placed_aux[index],
                                    micro_batches, loss=term.loss, router=self._router, **static)
            collected.add(part)
        return acc

    def _local_axes(self, plan) -> tuple[str, ...] | None:
        """The batch axes over which ``plan`` accumulates per device (:mod:`jrl.train.grad_sync`), or None."""
        return local_axes(self.optim.grad_sync, self.mesh, DEFAULT_RULES if self.rules is None else self.rules,
                          is_moe=self._is_moe, losses=[term.loss for _, term, _ in plan],
                          row_counts=[sl.stop - sl.start for _, _, sl in plan], auto_local=self._auto_local)

    def accumulate(self, terms: list[LossTerm]) -> tuple[Any, UpdateMetrics, int]:
        """(summed gradient of every term's micro-batches at the current weights, per-micro-batch metrics
        with ``loss``, number of skipped micro-batches)."""
        plan, skipped = self._plan(terms)
        collected = UpdateMetrics()
        return self._accumulate(plan, collected).tree, collected, skipped

    def apply(self, grads) -> Scalars:
        """One optimizer update with the summed gradient ``grads`` (params and optimizer state are donated
        and replaced); returns the gradient's global norm (``grad_norm``)."""
        grads = grads if isinstance(grads, Flat) else self._params.like(grads)
        self._params, self._opt_state, gnorm = apply_update(self._params, self._opt_state, grads, tx=self.tx)
        self.num_updates += 1
        return gnorm

    def step(self, terms: list[LossTerm]) -> tuple[UpdateMetrics, int]:
        """One optimizer update on ``terms``: (per-micro-batch metrics plus ``learning_rate`` and
        ``grad_norm``, number of skipped micro-batches). An update of a single micro-batch runs as one
        program (gradient and optimizer together, no accumulator); an update accumulating per device
        (``OptimConfig.grad_sync``) has each device's metrics of each micro-batch as one value."""
        plan, skipped = self._plan(terms)
        with on_host():
            learning_rate = self.schedule(self.num_updates)
        collected = UpdateMetrics(learning_rate=[learning_rate])
        axes = self._local_axes(plan)
        if len(plan) == 1:
            (_, term, sl), = plan
            batch = self._put_micro_batch(take_rows(term.rows, sl), term.aux)
            with uninitialized_scan_outputs(self._unfilled_scans, per_device_only=self._unfilled_per_device):
                if axes is None:
                    self._params, self._opt_state, part = micro_step_and_apply(
                        self._params, self._opt_state, self._frozen, batch,
                        graphdef=self._static_graphdef, loss=term.loss, tx=self.tx, router=self._router)
                else:
                    self._params, self._opt_state, part, gnorm = local_step_and_apply(
                        self._params, self._opt_state, self._frozen, batch, graphdef=self._local_graphdef,
                        loss=term.loss, tx=self.tx, router=self._router, mesh=self.mesh, axes=axes,
                        layout=self._layout, reduce_dtype=self._reduce_dtype)
                    collected.add(gnorm)
            self.num_updates += 1
            collected.add(part)
        elif axes is not None:
            acc = self._accumulate(plan, collected, axes)
            self._params, self._opt_state, gnorm = reduce_and_apply(self._params, self._opt_state, acc, tx=self.tx,
                                                                    layout=self._layout,
                                                                    reduce_dtype=self._reduce_dtype)
            self.num_updates += 1
            collected.add(gnorm)
        else:
            grads = self._accumulate(plan, collected)
            collected.add(self.apply(grads))
        return collected, skipped


def reduce_metrics(updates: list[UpdateMetrics], how: Callable[[str], str]) -> dict[str, float]:
    """One value per metric from the per-micro-batch metrics of one or more updates: each update's values
    combined with ``how(name)`` (``sum``, ``mean``, ``min`` or ``max``), then the updates averaged
    (``min`` / ``max`` metrics keep their extreme). The values are fetched from the devices in one go."""
    fetch_metrics(updates)
    out: dict[str, float] = {}
    for k in updates[0]:
        rule = how(k)
        values = [_reduce([float(x) for x in u[k]], rule) if u.get(k) else 0.0 for u in updates]
        out[k] = _reduce(values, rule if rule in ("min", "max") else "mean")
    return out


def _reduce(values: list[float], how: str) -> float:
    if how == "sum":
        return float(np.sum(values))
    if how == "min":
        return float(np.min(values))
    if how == "max":
        return float(np.max(values))
    return float(np.mean(values))
