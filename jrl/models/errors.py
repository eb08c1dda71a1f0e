"""Errors of model loading that the model-family files raise too (a leaf module: they cannot import the config)."""


class UnsupportedModelError(ValueError):
    """A checkpoint whose ``model_type`` (or a feature of it) jrl does not implement."""
