"""Kernels: one package per kernel, each with a pure-JAX reference and an ``api.py`` dispatcher (the shared one is
:mod:`jrl.kernels._dispatch`); :func:`backend` names the platform the dispatchers choose for."""

from jrl.kernels._dispatch import backend

__all__ = ["backend"]
