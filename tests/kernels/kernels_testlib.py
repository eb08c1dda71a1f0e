"""Helpers for the kernel tests: error measure, tolerances by dtype, fresh random inputs, numpy grouped matmuls."""

from __future__ import annotations

import os
import subprocess
import sys
import zlib

import jax.numpy as jnp
import numpy as np

TOL = {"float32": 1e-5, "bfloat16": 1e-2}


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; inf when either side has a NaN/inf (NaN never passes)."""
    a = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    nb = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / (nb if nb > 0 else 1.0))


def assert_close(out, ref, dtype, what="", tol=None):
    tol = TOL[jnp.dtype(dtype).name] if tol is None else tol
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3e} > {tol:.0e} (dtype {jnp.dtype(dtype).name})"
    return err


def assert_step_close(out, ref, dtype, what):
    """A decode step with its cache write, (output [B, N, D], keys, values), against the reference's: the output of
    every row but the last (whose output the tests leave unspecified) and both caches."""
    assert out[0].shape == ref[0].shape and all(o.dtype == r.dtype for o, r in zip(out, ref))
    assert np.isfinite(np.asarray(out[0], np.float32)).all()
    assert_close(out[0][:-1], ref[0][:-1], dtype, f"{what}: output")
    assert_close(out[1], ref[1], dtype, f"{what}: keys")  # rope's float32 arithmetic may round differently
    assert_close(out[2], ref[2], dtype, f"{what}: values", tol=0.0)


def rng_for(request) -> np.random.Generator:
    """A fresh generator per test (seeded from the test id and JRL_TEST_SEED, default random)."""
    seed = os.environ.get("JRL_TEST_SEED")
    base = int(seed) if seed else int.from_bytes(os.urandom(4), "little")
    print(f"seed for {request.node.nodeid}: JRL_TEST_SEED={base}")
    return np.random.default_rng([base, zlib.crc32(request.node.nodeid.encode())])


def lower_for(platform: str, fn, *args) -> str:
    """The StableHLO text of ``fn(*args)`` lowered for ``platform`` ("cuda", "tpu") on whatever machine runs the
    test: a Pallas kernel's Triton or Mosaic lowering runs here, so what it refuses (blocks that are not powers of
    two, unsupported ops) fails on CPU instead of on the accelerator; compiling the lowered kernel still needs one."""
    import jax

    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def allow_loop_bounds_from_memory() -> None:
    """Triton 3.6's interpreter makes a loop bound read from memory (``for t in range(start, end, ...)``) an int
    with ``int()`` of its one-element array, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted
    to Python scalars"); the compiled kernels take such bounds. Called by the interpreter scripts before they run a
    kernel: the interpreter reads the element instead."""
    import triton.runtime.interpreter as interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched


def run_interpreter_script(path: str) -> None:
    """Run ``path`` (Triton kernels under Triton's interpreter against numpy, on torch tensors) on a fresh seed: a
    failure fails the test with its output."""
    seed = str(int.from_bytes(os.urandom(2), "little"))
    res = run_script(path, seed)
    assert res.returncode == 0, f"seed {seed}\n{res.stdout}\n{res.stderr[-3000:]}"


def run_script(path: str, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("JAX_PLATFORMS", "cpu")
    return subprocess.run([sys.executable, path, *args], capture_output=True, text=True, timeout=timeout, env=env)


def group_sizes_cases(t: int, e: int, rng: np.random.Generator):
    """Ragged group sizes over t rows: with empty groups, and with a sum below t (padding rows)."""
    ragged = rng.multinomial(t, rng.dirichlet(np.full(e, 0.5)))
    z = int(rng.integers(0, e))  # at least one empty group
    ragged[(z + 1) % e] += ragged[z]
    ragged[z] = 0
    short = rng.multinomial(t - t // 4, np.full(e, 1.0 / e))
    return {"ragged": ragged.astype(np.int32), "sum<T": short.astype(np.int32)}


def np_gmm(lhs, rhs, gs):
    """Grouped matmul in float64 numpy (rows sorted by group; rows past sum(gs) stay zero)."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    s = 0
    for g, n in enumerate(np.asarray(gs)):
        out[s:s + n] = lhs[s:s + n] @ rhs[g]
        s += n
    return out


def np_tgmm(lhs, dout, gs):
    """Transposed grouped matmul ``out[g] = lhs_g^T @ dout_g`` in float64 numpy."""
    lhs, dout = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
    out = np.zeros((len(gs), lhs.shape[1], dout.shape[1]))
    s = 0
    for g, n in enumerate(np.asarray(gs)):
        out[g] = lhs[s:s + n].T @ dout[s:s + n]
        s += n
    return out
