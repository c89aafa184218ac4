from __future__ import annotations

import pytest

from tests.model.gguf_writer import Q, byte_level_vocab, write_gguf
from tests.model.tiny_models import make_tiny_model


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


@pytest.fixture(scope="session")
def tiny_gguf_q8(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama GGUF file storing its weights in Q8_0, as llama.cpp's converter writes one."""
    path = tmp_path_factory.mktemp("gguf")
    model = make_tiny_model("llama", path, seed=2)
    tokens, merges = byte_level_vocab(60)  # the tokenizer make_tiny_model saved
    gguf = path / "tiny-Q8_0.gguf"
    write_gguf(gguf, "llama", model.config, model.state_dict(), tokens, merges, tensor_type=Q.Q8_0)
    return str(gguf)
