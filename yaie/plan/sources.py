"""Where a model's config comes from: a built-in preset, a config.json, a HF folder or a GGUF file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from yaie.errors import YaieError
from yaie.plan.architecture import Architecture
from yaie.plan.presets import PRESETS


class PlanError(YaieError):
    """A model or a memory budget that cannot be planned, with what to change."""


@dataclass(frozen=True)
class ModelSource:
    name: str
    architecture: Architecture
    file_weight_bytes: int | None = None  # what the weights take in the file, when it says so


def find_preset(name: str) -> str | None:
    lowered = name.lower()
    return next((preset for preset in PRESETS if preset.lower() == lowered), None)


def load_model_source(spec: str | None) -> ModelSource:
    """A preset name, a config.json, a HF model folder or a .gguf file; None is the bundled model."""
    if spec is None:
        from yaie.model.loader import bundled_model_path  # imports torch: only when asked for

        return _from_gguf(bundled_model_path())
    preset = find_preset(spec)
    if preset is not None:
        return ModelSource(preset, Architecture.from_hf(PRESETS[preset]))
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise PlanError(f"{spec} has no config.json")
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    if path.is_file():
        try:
            config = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise PlanError(f"{path} is not a JSON config: {exc}") from exc
        name = path.parent.name if path.name == "config.json" else path.stem
        return ModelSource(name, Architecture.from_hf(config))
    raise PlanError(
        f"{spec!r} is neither a file, a folder nor a known preset; presets: {', '.join(PRESETS)}"
    )


def _from_gguf(path: Path) -> ModelSource:
    from yaie.model.loader_gguf import GGUFCheckpoint  # the engine's own reader (imports torch)

    checkpoint = GGUFCheckpoint(str(path))
    file_bytes = sum(int(tensor.n_bytes) for tensor in checkpoint.tensors.values())
    return ModelSource(path.stem, Architecture.from_hf(checkpoint.hf_config()), file_bytes)
