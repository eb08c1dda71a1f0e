"""Fixtures of the trainer tests."""

import pytest
from train_testlib import save_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random tiny Llama with jrl's byte tokenizer, as a Hugging Face directory."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny_llama"))
