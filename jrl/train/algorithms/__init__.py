"""Training algorithms behind one protocol (:mod:`jrl.train.algorithms.base`), registered by name:
``grpo`` (the GRPO family), ``ebft_structured`` and ``ebft_strided``."""

from jrl.train.algorithms import ebft_strided as _ebft_strided  # noqa: F401  (registers ``ebft_strided``)
from jrl.train.algorithms import ebft_structured as _ebft_structured  # noqa: F401  (registers ``ebft_structured``)
from jrl.train.algorithms import grpo as _grpo  # noqa: F401  (registers ``grpo``)
from jrl.train.algorithms.base import ALGORITHMS, Algorithm

__all__ = ["ALGORITHMS", "Algorithm"]
