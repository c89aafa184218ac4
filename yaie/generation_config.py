"""The sampling defaults a model's creator recommends, read from its generation_config.json.

An OpenAI-style request that leaves out `temperature` samples at 1.0, which makes many small
instruction-tuned models ramble; their creators put the settings they were tuned for in
generation_config.json. vLLM (`--generation-config auto`, its default) starts each request from
that file's sampling fields, and so does yaie's server (EngineConfig.generation_config): a field
the request sets wins, one it leaves out comes from here, and one neither sets keeps the API's
default. `max_new_tokens`, HF's name for max_tokens, caps the length of a request that leaves
max_tokens out.

The file is read as written (JSON), not through transformers' GenerationConfig: that class drops
values equal to its own defaults (top_k 50, for one), which would silently ignore them.

Where the file is: in a HF model directory; beside a GGUF file (GGUF metadata has no sampling
defaults, so a GGUF model has them only if someone put the file there).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from yaie.errors import InvalidRequestError, ModelLoadError
from yaie.sampling_params import SamplingParams

FILE_NAME = "generation_config.json"
# The fields vLLM takes from the file, all named as in SamplingParams, and their types.
SAMPLING_FIELDS: Mapping[str, type] = {
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
}


@dataclass(frozen=True)
class GenerationDefaults:
    """What a request that leaves a field out gets instead of the API's default."""

    sampling: Mapping[str, float | int] = field(default_factory=dict)  # SamplingParams fields
    max_tokens: int | None = None  # from max_new_tokens: a cap for requests without max_tokens
    source: Path | None = None  # the file they came from

    def describe(self) -> str:
        """One line for the server's log."""
        if self.source is None:
            return "none (requests get the API's defaults)"
        values = dict(self.sampling)
        if self.max_tokens is not None:
            values["max_tokens"] = self.max_tokens
        if not values:
            return f"none ({self.source} has no sampling fields)"
        return ", ".join(f"{name}={value}" for name, value in values.items()) + f" (from {self.source})"


def find(model_path: Path) -> Path | None:
    """The generation_config.json of the model at `model_path` (a HF directory or a GGUF file)."""
    directory = model_path if model_path.is_dir() else model_path.parent
    path = directory / FILE_NAME
    return path if path.is_file() else None


def load(model_path: Path) -> GenerationDefaults:
    """The sampling defaults of the model at `model_path`; none if it has no generation_config.json.

    A file that is not a JSON object, or holds a sampling field that is not a number of its
    type, is an error: a server that quietly ignored it would sample unlike what its owner expects.
    """
    path = find(model_path)
    if path is None:
        return GenerationDefaults()
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read it as JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ModelLoadError(f"{path}: must hold a JSON object")
    sampling = {
        name: _number(path, name, config[name], kind)
        for name, kind in SAMPLING_FIELDS.items()
        if config.get(name) is not None
    }
    max_new_tokens = config.get("max_new_tokens")
    max_tokens = None if max_new_tokens is None else int(_number(path, "max_new_tokens", max_new_tokens, int))
    if max_tokens is not None and max_tokens < 1:
        raise ModelLoadError(f"{path}: max_new_tokens must be at least 1, got {max_tokens}")
    try:  # the ranges SamplingParams accepts, checked once here rather than failing every request
        SamplingParams(**sampling)  # type: ignore[arg-type]
    except InvalidRequestError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    return GenerationDefaults(sampling, max_tokens, path)


def _number(path: Path, name: str, value: object, kind: type) -> float | int:
    # bool is an int to Python, but `"top_k": true` is no number of tokens.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(f"{path}: {name} must be a number, got {value!r}")
    if kind is int:
        if not float(value).is_integer():
            raise ModelLoadError(f"{path}: {name} must be an integer, got {value!r}")
        return int(value)
    if not math.isfinite(value):
        raise ModelLoadError(f"{path}: {name} must be finite, got {value!r}")
    return float(value)
