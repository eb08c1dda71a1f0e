"""Scan outputs allocated without a zero fill (jrl.models.scan_outputs): the hook into JAX's scan lowering exists
in the installed JAX, a GPU lowering inside the context allocates the stacked outputs with ``AllocateBuffer``
instead of broadcasting zeros (checked by lowering for CUDA on this machine), only in the thread that entered it,
and with ``per_device_only`` only for scans inside a ``shard_map``; on a GPU a scanned model's gradient is the same
with and without (the buffers are fully written)."""

from __future__ import annotations

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jrl.models.config import ModelConfig
from jrl.models.scan_outputs import available, uninitialized_scan_outputs
from jrl.models.transformer import create_model


def _scanned_grad():
    """A fresh jitted gradient of a scan (lowerings are cached per function: each case needs its own)."""
    def loss(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0].sum()

    return jax.jit(jax.grad(loss))


def _cuda_allocations(fn) -> int:
    w, x = jnp.ones((3, 4, 4)), jnp.ones((2, 4))
    return fn.trace(w, x).lower(lowering_platforms=("cuda",)).as_text().count("AllocateBuffer")


def test_the_hook_exists_in_this_jax():
    assert available(), "jax._src.lax.control_flow.loops._empty_array changed: scans keep their zero fill"


def test_gpu_lowering_allocates_scan_outputs_only_inside_the_context():
    with uninitialized_scan_outputs():
        assert _cuda_allocations(_scanned_grad()) > 0
    assert _cuda_allocations(_scanned_grad()) == 0
    with uninitialized_scan_outputs(enabled=False):
        assert _cuda_allocations(_scanned_grad()) == 0


def test_per_device_only_switches_the_scans_inside_a_shard_map():
    mesh = jax.make_mesh((1,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])

    def loss(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0].sum()

    def per_device(w, x):  # the same scan inside a shard_map, its loss summed over the mesh
        return jax.lax.psum(loss(w, x), "fsdp")

    sharded = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P("fsdp")), out_specs=P(), check_vma=False)
    with uninitialized_scan_outputs(per_device_only=True):
        assert _cuda_allocations(jax.jit(jax.grad(sharded))) > 0
        assert _cuda_allocations(jax.jit(jax.grad(loss))) == 0  # outside a shard_map: XLA's partitioner's


def test_other_threads_keep_the_zero_fill():
    counts = {}
    entered, done = threading.Event(), threading.Event()

    def other():
        assert entered.wait(60)
        counts["other"] = _cuda_allocations(_scanned_grad())
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    with uninitialized_scan_outputs():
        entered.set()
        assert done.wait(60)
        counts["this"] = _cuda_allocations(_scanned_grad())
    thread.join()
    assert counts == {"other": 0, "this": counts["this"]} and counts["this"] > 0


@pytest.mark.gpu
def test_gpu_gradient_is_unchanged():
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                         dtype="float32", scan_layers=True, remat="dots_with_no_batch_dims_saveable")
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, 64, (2, 32)), jnp.int32)

    def grads(unfilled: bool):
        model = create_model(config, seed=0)
        graphdef, state = nnx.split(model)

        def loss(state):
            return jnp.mean(jax.nn.log_softmax(nnx.merge(graphdef, state)(ids))[..., 3])

        with uninitialized_scan_outputs(unfilled):
            lowered = jax.jit(jax.grad(loss)).lower(state)
        return lowered.compile()(state), lowered.as_text()

    got, hlo = grads(True)
    want, plain = grads(False)
    assert "AllocateBuffer" in hlo and "AllocateBuffer" not in plain
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        err = float(jnp.max(jnp.abs(g - w)) / jnp.maximum(jnp.max(jnp.abs(w)), 1e-30))
        assert bool(jnp.all(jnp.isfinite(g))) and err <= 1e-5, err
