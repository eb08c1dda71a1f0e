"""Kernels: one package per kernel, each with a pure-JAX reference and an ``api.py`` dispatcher."""
