"""The kernel tests' float32 cases mean float32 arithmetic: XLA's default float32 matmul precision on an NVIDIA GPU
rounds the operands to TF32 (about 3e-4 relative error on these shapes, measured on an H200), which their 1e-5
tolerance is not for. Every kernel test runs with the highest matmul precision (on the CPU the same arithmetic as
the default); bfloat16 operands are unaffected."""

import jax
import pytest


@pytest.fixture(autouse=True)
def _float32_matmuls_in_float32():
    with jax.default_matmul_precision("highest"):
        yield
