"""Reading a model's sampling defaults from its generation_config.json: no model needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from yaie import generation_config
from yaie.errors import ModelLoadError


def write(directory: Path, config: Any) -> Path:
    path = directory / "generation_config.json"
    path.write_text(json.dumps(config))
    return path


def test_a_hf_directory_s_sampling_fields(tmp_path: Path) -> None:
    source = write(
        tmp_path,
        {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "temperature": 0.6, "top_p": 0.95,
         "top_k": 20, "min_p": 0, "repetition_penalty": 1.05, "max_new_tokens": 512},
    )  # fmt: skip
    defaults = generation_config.load(tmp_path)
    assert defaults.sampling == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.0,
        "repetition_penalty": 1.05,
    }
    assert (defaults.max_tokens, defaults.source) == (512, source)
    assert isinstance(defaults.sampling["top_k"], int) and isinstance(defaults.sampling["min_p"], float)
    assert defaults.describe() == (
        "temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.05, max_tokens=512"
        f" (from {source})"
    )


def test_a_gguf_file_s_defaults_sit_beside_it(tmp_path: Path) -> None:
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    assert generation_config.load(gguf) == generation_config.GenerationDefaults()  # no file: none
    source = write(tmp_path, {"temperature": 0.2})
    assert generation_config.load(gguf) == generation_config.GenerationDefaults(
        {"temperature": 0.2}, None, source
    )


def test_a_file_without_sampling_fields_gives_none(tmp_path: Path) -> None:
    source = write(tmp_path, {"eos_token_id": 2, "temperature": None})
    defaults = generation_config.load(tmp_path)
    assert (defaults.sampling, defaults.max_tokens) == ({}, None)
    assert defaults.describe() == f"none ({source} has no sampling fields)"
    assert "none" in generation_config.GenerationDefaults().describe()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("[1, 2]", "a JSON object"),
        ("{", "as JSON"),
        ('{"temperature": "hot"}', "temperature must be a number"),
        ('{"top_k": true}', "top_k must be a number"),
        ('{"top_k": 2.5}', "top_k must be an integer"),
        ('{"top_p": NaN}', "top_p must be finite"),
        ('{"temperature": -1}', "temperature"),
        ('{"top_p": 1.5}', "top_p"),
        ('{"max_new_tokens": 0}', "max_new_tokens must be at least 1"),
    ],
)
def test_a_bad_file_is_refused_at_load(tmp_path: Path, config: str, message: str) -> None:
    """Not ignored, and not left to fail every request: the server does not start with it."""
    (tmp_path / "generation_config.json").write_text(config)
    with pytest.raises(ModelLoadError, match=message):
        generation_config.load(tmp_path)
