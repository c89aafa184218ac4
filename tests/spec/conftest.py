from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))

from tiny_models import make_tiny_model


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("target")
    make_tiny_model("llama", path, seed=0)
    return str(path)


@pytest.fixture(scope="session")
def tiny_other(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Another random model with the same tokenizer: a draft that is rarely right."""
    path = tmp_path_factory.mktemp("other")
    make_tiny_model("qwen2", path, seed=1)
    return str(path)
