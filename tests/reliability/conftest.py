"""Fixtures of the reliability tests: one tiny model with a real tokenizer per session."""

from __future__ import annotations

import pytest
from reliability_fixtures import build_tiny_model_dir, load_tiny

from daemon.engine import LoadedModel


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> LoadedModel:
    return load_tiny(build_tiny_model_dir(tmp_path_factory.mktemp("tiny-smol")))
