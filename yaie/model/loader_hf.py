"""HF model directories: config.json plus one or many *.safetensors files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from yaie.errors import ModelLoadError


class HFCheckpoint:
    def __init__(self, path: Path) -> None:
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{path} has no config.json")
        self.path = path
        self.files = sorted(path.glob("*.safetensors"))
        if not self.files:
            raise ModelLoadError(f"{path} has no *.safetensors weights (other formats are not supported)")
        self._config = json.loads(config_file.read_text())
        generation = path / "generation_config.json"
        if generation.is_file():
            # generation_config.json often lists extra end-of-turn ids (e.g. Llama 3's <|eot_id|>).
            eos = json.loads(generation.read_text()).get("eos_token_id")
            if eos is not None:
                self._config["eos_token_id"] = eos

    @property
    def num_tensors(self) -> int:
        total = 0
        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                total += len(f.keys())
        return total

    def hf_config(self) -> dict[str, Any]:
        return self._config

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                    yield name, f.get_tensor(name).to(dtype)
