"""HF model directories: config.json plus one or many *.safetensors files.

A config.json with a `quantization_config` names an int4 format (AWQ, GPTQ) whose linear layers
are stored as several packed tensors (qweight, qzeros, scales, ...) in place of `.weight`: each
layer's parts are gathered into one `Int4Weight` (yaie/model/int4_checkpoints.py), handed out as
the layer's `.weight`, dequantized unless the caller keeps it quantized.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from yaie.errors import ModelLoadError, UnsupportedModelError
from yaie.model.int4_checkpoints import Int4Config, Int4Weight


class HFCheckpoint:
    def __init__(self, path: Path) -> None:
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelLoadError(f"{path} has no config.json")
        self.path = path
        self.files = sorted(path.glob("*.safetensors"))
        if not self.files:
            raise ModelLoadError(f"{path} has no *.safetensors weights (other formats are not supported)")
        self._config: dict[str, Any] = json.loads(config_file.read_text())
        generation = path / "generation_config.json"
        if generation.is_file():
            # generation_config.json often lists extra end-of-turn ids (e.g. Llama 3's <|eot_id|>).
            eos = json.loads(generation.read_text()).get("eos_token_id")
            if eos is not None:
                self._config["eos_token_id"] = eos
        self.int4: Int4Config | None = None  # the format of the quantized layers, if any
        if "quantization_config" in self._config:
            try:
                self.int4 = Int4Config.from_hf(self._config["quantization_config"])
            except ValueError as exc:
                raise UnsupportedModelError(f"{path.name}: {exc}") from exc

    def _names(self) -> dict[str, Path]:
        """Every tensor's name -> the file that holds it."""
        names: dict[str, Path] = {}
        for file in self.files:
            with safe_open(str(file), framework="pt") as f:
                names |= dict.fromkeys(f.keys(), file)
        return names

    def _int4_part(self, name: str, names: dict[str, Path]) -> str | None:
        """The part (qweight, scales, ...) of a quantized layer that tensor `name` is, if it is one."""
        module, _, part = name.rpartition(".")
        if self.int4 is None or part not in self.int4.parts or f"{module}.qweight" not in names:
            return None
        return part

    @property
    def num_tensors(self) -> int:
        """Tensors `weights` hands out: one for each quantized layer's parts."""
        names = self._names()
        return sum(self._int4_part(n, names) in (None, "qweight") for n in names)

    def hf_config(self) -> dict[str, Any]:
        return self._config

    def weights(self, dtype: torch.dtype, keep_quantized: bool = False
                ) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
        """HF-named tensors in `dtype`; an AWQ / GPTQ layer's parts as its `.weight`, dequantized
        to `dtype`, or with `keep_quantized` as the `Int4Weight` itself."""
        names = self._names()
        with ExitStack() as stack:
            handles = {file: stack.enter_context(safe_open(str(file), framework="pt")) for file in self.files}
            for name, file in names.items():
                part = self._int4_part(name, names)
                if part is None:
                    yield name, handles[file].get_tensor(name).to(dtype)
                elif part == "qweight":
                    module = name.removesuffix(".qweight")
                    weight = self._int4_weight(module, names, handles)
                    yield f"{module}.weight", weight if keep_quantized else weight.dense(dtype)

    def _int4_weight(self, module: str, names: dict[str, Path], handles: dict[Path, Any]) -> Int4Weight:
        assert self.int4 is not None
        parts = {p: handles[names[f"{module}.{p}"]].get_tensor(f"{module}.{p}")
                 for p in self.int4.parts if f"{module}.{p}" in names}  # fmt: skip
        missing = [p for p in ("qweight", "qzeros", "scales") if p not in parts]
        if missing:
            raise ModelLoadError(f"{self.int4.name} layer {module} lacks {', '.join(missing)}")
        return Int4Weight.from_tensors(parts, self.int4)
